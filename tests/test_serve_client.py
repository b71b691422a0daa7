"""serve.py as a new user meets it through the official `openai` client and curl: a tool call's round trip and
`tool_choice`, a non-streaming client that leaves, CORS, fields that would change the answer, shutdown with
streams running, the smaller routes and errors, and a large body.

Prompts are checked against the ones the library builds for the same turn (the engine's submitted ids), never
against a tiny random model's text; waits end on events, bounded by generous safety timeouts.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("starlette", reason='the server needs its extra: pip install -e ".[serve]"')
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install -e ".[serve]"')
openai = pytest.importorskip("openai", reason="the tests call the server with the official client: pip install openai")

from chatglm_tune.data.dialogues import TOOL_PROMPT  # noqa: E402
from chatglm_tune.data.records import SPORecord  # noqa: E402
from chatglm_tune.decoding.chat import prepare_turn  # noqa: E402
from chatglm_tune.options import DEFAULT_DRAFTS, EncodingOptions, SamplingOptions, ServingOptions  # noqa: E402
from commands import HANG_S, wait_until  # noqa: E402
from serving import TEXTS, serve_py, tiny_model  # noqa: E402
from test_serve import serving  # noqa: E402

GREEDY = SamplingOptions()
# tools kept short: the tiny ChatGLM3's context is 512 tokens, about a character each
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"city": "str"}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny model directories by version, made once."""
    made = {}

    def directory(version):
        if version not in made:
            made[version] = tiny_model(version, tmp_path_factory.mktemp(version))
        return made[version]

    return directory


class Prompts:
    """The prompt ids of each request the engine is handed."""

    def __init__(self, engine, monkeypatch):
        self.ids = []
        submit = engine.submit
        monkeypatch.setattr(engine, "submit", lambda request: self.ids.append(list(request.prompt)) or submit(request))


# ----------------------------------------------------------------------------------------------
# A tool call's round trip, tool_choice


def round_trip(content):
    """The openai SDK's messages after a tool call: the assistant's call sent back, then the tool's result."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "北京"}'}}
    return [{"role": "user", "content": "北京天气"}, {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "晴，25度"}]


@pytest.mark.parametrize("version", ["chatglm3", "glm4", "glm4-0414"])
def test_a_tool_calls_round_trip_is_in_the_prompt_in_the_versions_tool_form(version, models, monkeypatch):
    """ChatGLM3 writes a call `<|assistant|>name` then a `tool_call(k=v)` code block, GLM-4-9B and GLM-4-0414
    `<|assistant|>name` then JSON; the tool's result is an `<|observation|>` turn. The tools are offered as each
    version's demos and fine-tuning data offer them: ChatGLM3 a first system turn of its tool prompt and the
    functions, GLM-4 the system message's tools as sent (GLM-4-0414's template takes them as its `tools`)."""
    arguments = "```python\ntool_call(city='北京')\n```" if version == "chatglm3" else '{"city": "北京"}'
    offered = ({"role": "system", "content": TOOL_PROMPT.rstrip("\n"), "tools": [WEATHER["function"]]}
               if version == "chatglm3" else {"role": "system", "content": "", "tools": [WEATHER]})
    with serving(models(version)) as s:
        prompts = Prompts(s.service.engine, monkeypatch)
        client = s.client()
        for content in (None, ""):
            reply = client.chat.completions.create(model="tiny", messages=round_trip(content), max_tokens=4,
                                                   temperature=0, tools=[WEATHER])
            assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
        history = [offered, {"role": "user", "content": "北京天气"},
                   {"role": "assistant", "metadata": "get_weather", "content": arguments}]
        expected = prepare_turn(s.tokenizer, "晴，25度", history, "observation", None, GREEDY).prompt
        assert prompts.ids == [expected, expected]


def test_tool_choice(models, monkeypatch):
    """"none": the tools are not offered (the prompt of the same chat without them) and no call is read;
    a named function (or "required" with one tool): the prompt goes on with the call's first line, and the
    answer is read as that call; a name not declared: 400 naming tool_choice ("required" among several tools is
    decoded under the grammar of every call: tests/test_serve_structured.py)."""
    from chatglm_tune.serve.app import _chat_answer
    from chatglm_tune.serve.protocol import parse_call
    from chatglm_tune.serve.service import Done

    messages = [{"role": "user", "content": "北京天气"}]
    with serving(models("chatglm3")) as s:
        prompts = Prompts(s.service.engine, monkeypatch)
        client = s.client()
        ask = dict(model="tiny", messages=messages, max_tokens=4, temperature=0)
        client.chat.completions.create(**ask)
        client.chat.completions.create(**ask, tools=[WEATHER], tool_choice="none")
        assert prompts.ids[1] == prompts.ids[0]
        client.chat.completions.create(**ask, tools=[WEATHER])
        named = {"type": "function", "function": {"name": "get_weather"}}
        client.chat.completions.create(**ask, tools=[WEATHER, CLOCK], tool_choice=named)
        client.chat.completions.create(**ask, tools=[WEATHER], tool_choice="required")
        with_tools, lead = prompts.ids[2], s.tokenizer.encode_text("get_weather\n")
        assert prompts.ids[4] == with_tools + lead
        assert prompts.ids[3][-len(lead):] == lead and len(prompts.ids[3]) > len(with_tools) + len(lead)
        for choice in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(**ask, tools=[WEATHER, CLOCK], tool_choice=choice)
            assert err.value.body["param"] == "tool_choice", (choice, err.value.body)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**ask, tool_choice="required")
        assert err.value.body["param"] == "tool_choice"
        # the answer of a named call is read with its first line, which the prompt gave
        call = parse_call({**ask, "tools": [WEATHER], "tool_choice": named}, kind="chat", served="tiny",
                          defaults=s.service.chat_sampling)
        turn = s.service.chat_turn(call)
        ids = s.tokenizer.encode_text("```python\ntool_call(city='北京')\n```")
        message, finish = _chat_answer(call, turn, Done("", "stop", len(ids), tuple(ids), False))
        assert finish == "tool_calls" and message["tool_calls"][0]["function"] == {
            "name": "get_weather", "arguments": json.dumps({"city": "北京"}, ensure_ascii=False)}
        # "none": a first line naming a tool is not read as a call
        call = parse_call({**ask, "tools": [WEATHER], "tool_choice": "none"}, kind="chat", served="tiny",
                          defaults=s.service.chat_sampling)
        ids = s.tokenizer.encode_text("get_weather\n```python\ntool_call(city='北京')\n```")
        message, _ = _chat_answer(call, s.service.chat_turn(call), Done("", "stop", len(ids), tuple(ids), False))
        assert "tool_calls" not in message


def answering(engine, monkeypatch, text: str, tokenizer) -> None:
    """The engine answers every request with `text` (then the version's first stop id), token by token."""
    from chatglm_tune.decoding.request import FINISH_STOP

    ids = tokenizer.encode_text(text) + tokenizer.prompt_format.stop_ids(tokenizer)[:1]

    def submit(request):
        for token in ids:
            request.on_token(token)
        request.on_finish(FINISH_STOP, None)

    monkeypatch.setattr(engine, "submit", submit)


@pytest.mark.parametrize("version", ["chatglm3", "glm4"])
def test_a_streamed_tool_call_comes_as_tool_calls_only(version, models, monkeypatch):
    """Streamed, a tool call sends no text: its first line (the tool's name) is held back until the line ends, then
    the call comes as OpenAI streams one (id and name, then the arguments), so the openai SDK's final completion has
    content None and the call, as the same answer unstreamed. A text answer (its first line empty) streams as text,
    token by token, and ends the same as unstreamed."""
    arguments = "```python\ntool_call(city='北京')\n```" if version == "chatglm3" else '{"city": "北京"}'
    ask = dict(model="tiny", messages=[{"role": "user", "content": "北京天气"}], max_tokens=40, temperature=0,
               tools=[WEATHER])
    with serving(models(version)) as s:
        client = s.client()
        answering(s.service.engine, monkeypatch, f"get_weather\n{arguments}", s.tokenizer)
        plain = client.chat.completions.create(**ask).choices[0]
        with client.chat.completions.stream(**ask) as stream:
            chunks = [event.chunk for event in stream if event.type == "chunk"]
            final = stream.get_final_completion().choices[0]
        for choice in (plain, final):
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
                ("get_weather", {"city": "北京"})]
        assert not any(c.choices and c.choices[0].delta.content for c in chunks)
        calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert [call.function.name for call in calls] == ["get_weather", None] and calls[0].function.arguments == ""

        answering(s.service.engine, monkeypatch, "\n晴，25度，微风", s.tokenizer)
        plain = client.chat.completions.create(**ask).choices[0]
        pieces = [c.choices[0].delta.content for c in client.chat.completions.create(**ask, stream=True)
                  if c.choices and c.choices[0].delta.content]
        assert plain.message.content == "".join(pieces) == "晴，25度，微风" and len(pieces) > 1
        assert plain.message.tool_calls is None


def test_a_first_line_that_cannot_name_a_tool_streams_at_once(models, monkeypatch):
    """GLM-4 reads a call only where the first line names a declared tool: a stream holds a first line back only
    while it could still become one (a prefix of a declared name), and with no tools offered not at all; ChatGLM3
    reads any first line as a call's, so it holds each until the line ends."""
    from chatglm_tune.serve.protocol import parse_call

    def held(s, text: str, tools) -> bool:
        body = dict(model="tiny", messages=[{"role": "user", "content": "好"}], **({"tools": tools} if tools else {}))
        turn = s.service.chat_turn(parse_call(body, kind="chat", served="tiny", defaults=s.service.chat_sampling))
        return turn.holding(s.tokenizer.encode_text(text))

    with serving(models("glm4")) as s:
        assert held(s, "get_wea", [WEATHER]) and held(s, " get_weather", [WEATHER])
        assert not held(s, "hello", [WEATHER]) and not held(s, "get_weatherman", [WEATHER])
        assert not held(s, "get_wea", None) and not held(s, "get_weather\n", [WEATHER])
        ask = dict(model="tiny", messages=[{"role": "user", "content": "好"}], max_tokens=40, temperature=0)
        answering(s.service.engine, monkeypatch, "晴天，25度，微风，适合出门", s.tokenizer)
        pieces = [c.choices[0].delta.content for c in s.client().chat.completions.create(**ask, stream=True)
                  if c.choices and c.choices[0].delta.content]
        assert len(pieces) > 1 and "".join(pieces) == "晴天，25度，微风，适合出门"
    with serving(models("chatglm3")) as s:
        assert held(s, "hello", [WEATHER]) and held(s, "hello", None) and not held(s, "hello\n", None)


def test_the_kernels_are_built_before_the_server_is_ready(models, monkeypatch):
    """The server decodes a few tokens before it says it is ready: a CPU kernel the first request would have built
    (here the few-row float matmul of decoding, as in a process that has not built it yet) is built then, and the
    first request builds nothing."""
    from chatglm_tune.quant import fewrow_cpu, inline_build

    if not inline_build.x86():
        pytest.skip("the CPU kernels are built on x86-64 only")
    builds, build = [], inline_build.build
    monkeypatch.setattr(inline_build, "build", lambda name, *args, **kwargs: builds.append(name) or build(name, *args,
                                                                                                       **kwargs))
    monkeypatch.setattr(fewrow_cpu, "_built", [])
    with serving(models("glm4")) as s:
        ready = list(builds)
        s.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "好"}], max_tokens=4)
    assert "chatglm_fewrow_cpu" in ready and builds == ready


def test_a_server_on_a_fresh_kernel_cache_is_ready_with_its_kernels_built(models, monkeypatch, tmp_path):
    """serve.py on an empty kernel cache: when /health first answers, the kernel is in the cache, whole, and the first
    requests build nothing more (the cache's files are the same after them)."""
    from chatglm_tune.quant import inline_build

    if not (inline_build.x86() and shutil.which("c++")):
        pytest.skip("the CPU kernels are built on x86-64, with a C++ compiler")
    cache = tmp_path / "kernels"
    monkeypatch.setenv("CHATGLM_TUNE_KERNELS", str(cache))
    with serve_py(models("glm4"), tmp_path / "serve.log") as (_, base):
        built = sorted(p.relative_to(cache) for p in cache.rglob("*"))
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=HANG_S)
        client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                       messages=[{"role": "user", "content": "好"}])
        client.completions.create(model=client.models.list().data[0].id, prompt="制动钳", max_tokens=4)
        assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == built
    assert [p.name for p in built if p.suffix == ".so"] == ["chatglm_fewrow_cpu.so"]

def test_n_answers_and_a_list_of_prompts_are_each_what_one_request_answers(models):
    """`n` answers of one prompt are n rows of the batch: greedy, n equal answers; sampled with a seed, answer i is
    the one request seeded seed + i answers (so they differ). A completion's list of prompts answers each in order
    (choice p * n + i), as each alone; streamed, the chunks of each choice (by index) make the same answers. Usage
    counts each prompt once and every answer's tokens."""
    messages = [{"role": "user", "content": "制动钳异响"}]
    with serving(models("glm4")) as s:
        client = s.client()
        chat = dict(model="tiny", messages=messages, max_tokens=12)
        greedy = client.chat.completions.create(**chat, temperature=0, n=2)
        assert [c.index for c in greedy.choices] == [0, 1]
        assert greedy.choices[0].message.content == greedy.choices[1].message.content
        sampled = client.chat.completions.create(**chat, temperature=1.0, top_p=1.0, seed=7, n=2)
        alone = [client.chat.completions.create(**chat, temperature=1.0, top_p=1.0, seed=seed) for seed in (7, 8)]
        assert [c.message.content for c in sampled.choices] == [a.choices[0].message.content for a in alone]
        assert sampled.choices[0].message.content != sampled.choices[1].message.content
        assert sampled.usage.prompt_tokens == alone[0].usage.prompt_tokens
        assert sampled.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
        pieces = {0: "", 1: ""}
        for chunk in client.chat.completions.create(**chat, temperature=1.0, top_p=1.0, seed=7, n=2, stream=True):
            for choice in chunk.choices:
                pieces[choice.index] += choice.delta.content or ""
        assert list(pieces.values()) == [c.message.content for c in sampled.choices]

        prompts = ["制动钳", "水泵漏油", "风扇低速"]
        done = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, n=2)
        one = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0) for p in prompts]
        assert [c.index for c in done.choices] == list(range(6))
        assert [c.text for c in done.choices] == [o.choices[0].text for o in one for _ in range(2)]
        assert done.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one)
        texts = [""] * 6
        for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, n=2,
                                               stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == [c.text for c in done.choices]


class Answers:
    """The prompt and answer ids of each request the engine is handed."""

    def __init__(self, engine, monkeypatch):
        self.prompts, self.ids = [], []
        submit = engine.submit

        def spy(request):
            answer = []
            self.prompts.append(list(request.prompt))
            self.ids.append(answer)
            on_token = request.on_token
            request.on_token = lambda token: answer.append(token) or on_token(token)
            return submit(request)

        monkeypatch.setattr(engine, "submit", spy)


def model_logprobs(s, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """[answer tokens, vocabulary] log probabilities of each answer token's position, from one forward."""
    with torch.no_grad():
        logits = s.model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1: -1].float()
    logits[:, len(s.tokenizer):] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("drafts", [None, DEFAULT_DRAFTS], ids=["plain", "speculative"])
def test_logprobs_are_the_models_own(models, monkeypatch, drafts):
    """Chat's `logprobs` / `top_logprobs` and completions' `logprobs` give each answer token's log probability as
    the model's own forward over prompt and answer gives it (1e-4), with the likeliest alternatives (greedy: the
    token itself first), decoded plainly or speculatively (a greedy row's agreed guesses too); the stop id that
    ends an answer is not among them. Streamed, the chunks' log probabilities make the same list."""
    with serving(models("glm4"), options=ServingOptions(drafts=drafts)) as s:
        answers, client = Answers(s.service.engine, monkeypatch), s.client()
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "制动钳异响"}],
                                              max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
        done = client.completions.create(model="tiny", prompt="水泵漏油", max_tokens=12, temperature=0, logprobs=2)
        stops = s.tokenizer.prompt_format.stop_ids(s.tokenizer)
        for i, (entries, top) in enumerate([
                ([(e.logprob, [(a.token, a.logprob) for a in e.top_logprobs])
                  for e in chat.choices[0].logprobs.content], 3),
                (list(zip(done.choices[0].logprobs.token_logprobs,
                          [list(t.items()) for t in done.choices[0].logprobs.top_logprobs])), 2)]):
            ids = answers.ids[i][:-1] if answers.ids[i][-1] in stops else answers.ids[i]
            expected = model_logprobs(s, answers.prompts[i], answers.ids[i])
            assert len(entries) == len(ids) > 0
            for k, (token, (logprob, alternatives)) in enumerate(zip(ids, entries)):
                assert logprob == pytest.approx(expected[k, token].item(), abs=1e-4)
                values, alternative_ids = expected[k].topk(top)
                if i == 0:  # chat: a list, id by id
                    assert [value for _, value in alternatives] == pytest.approx(values.tolist(), abs=1e-4)
                else:  # completions: keyed by text, the likeliest of alternatives that decode alike
                    best = {}
                    for alternative, value in zip(alternative_ids.tolist(), values.tolist()):
                        best.setdefault(s.tokenizer.decode([alternative]), value)
                    assert dict(alternatives) == pytest.approx(best, abs=1e-4)
                assert alternatives[0][0] == s.tokenizer.decode([token])  # greedy: the likeliest is the one written
        assert done.choices[0].logprobs.text_offset[0] == 0
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "好"}], max_tokens=2,
                                           top_logprobs=2)
        assert err.value.body["param"] == "top_logprobs"
        # streamed: each chunk carries the log probabilities of its tokens; together, the whole answer's
        chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "制动钳异响"}],
                                                max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                                                stream=True)
        pieces = [e.model_dump() for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
        assert pieces == [e.model_dump() for e in chat.choices[0].logprobs.content]
        texts, logprobs = [], []
        for chunk in client.completions.create(model="tiny", prompt="水泵漏油", max_tokens=12, temperature=0,
                                               logprobs=2, stream=True):
            for choice in chunk.choices:
                texts.append(choice.text)
                if choice.logprobs:
                    logprobs.append(choice.logprobs)
        assert "".join(texts) == done.choices[0].text
        assert [t for part in logprobs for t in part.tokens] == done.choices[0].logprobs.tokens
        assert [v for part in logprobs for v in part.token_logprobs] == done.choices[0].logprobs.token_logprobs
        assert [o for part in logprobs for o in part.text_offset] == done.choices[0].logprobs.text_offset


def test_an_echoed_token_id_prompt_scores_as_lm_evals_loglikelihood_reads_it(models, monkeypatch):
    """lm-eval's loglikelihood request (its local-completions model): token-id prompts taken as they are (no prompt
    format around them), `echo`, `logprobs` 1, `max_tokens` 1. Each choice's text is its prompt's then the answer's,
    its token_logprobs the prompt's tokens after the first (the first: None) and then the answer's, each as the
    model's own forward gives it (1e-4); the sum over a continuation is the log-likelihood lm-eval takes. Streamed,
    the chunks make the same texts and lists. A token id the tokenizer does not have: 400 naming it."""
    with serving(models("glm4")) as s:
        answers, client = Answers(s.service.engine, monkeypatch), s.client()
        encode = s.tokenizer.encode_text
        contexts, continuation = [encode("制动钳"), encode("水泵")], encode("异响")
        prompts = [context + continuation for context in contexts]
        done = client.completions.create(model="tiny", prompt=prompts, max_tokens=1, temperature=0, logprobs=1,
                                         echo=True, seed=1234)
        assert answers.prompts == prompts  # as given: no prompt format around them
        for prompt, context, choice, answer in zip(prompts, contexts, done.choices, answers.ids):
            expected = model_logprobs(s, prompt[:1], prompt[1:] + answer[:1])
            logprobs = choice.logprobs
            assert choice.text.startswith(s.tokenizer.decode(prompt))
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            assert len(logprobs.token_logprobs) == len(prompt) + (answer[0] not in s.tokenizer.prompt_format.stop_ids(
                s.tokenizer))
            following = (prompt[1:] + answer[:1])[:len(logprobs.token_logprobs) - 1]
            want = [expected[k, token].item() for k, token in enumerate(following)]
            assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
            loglikelihood = sum(logprobs.token_logprobs[len(context): len(prompt)])
            assert loglikelihood == pytest.approx(sum(want[len(context) - 1: len(prompt) - 1]), abs=1e-4)
        streamed = [""] * 2, [[], []]
        for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=1, temperature=0, logprobs=1,
                                               echo=True, stream=True):
            for choice in chunk.choices:
                streamed[0][choice.index] += choice.text
                streamed[1][choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
        assert streamed[0] == [c.text for c in done.choices]
        assert streamed[1] == [c.logprobs.token_logprobs for c in done.choices]
        plain = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=1, echo=True, stream=True)
        assert not any(choice.logprobs for chunk in plain for choice in chunk.choices)  # none asked, none sent
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt=[1, len(s.tokenizer)], max_tokens=1)
        assert err.value.body["param"] == "prompt[1]"


@pytest.mark.parametrize("body, param", [({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
                                         ({"prompt": [[101], []]}, "prompt"), ({"prompt": [101, "a"]}, "prompt"),
                                         ({"prompt": ["a"] * 9, "n": 2}, "prompt"), ({"prompt": []}, "prompt"),
                                         ({"echo": True}, "echo"), ({"prompt": [1, 2], "echo": 1.5}, "echo"),
                                         ({"prompt": [1, 2], "logprobs": 6}, "logprobs")])
def test_choices_beyond_the_bounds_are_400_naming_the_parameter(body, param):
    from chatglm_tune.serve.protocol import ApiError, parse_call

    with pytest.raises(ApiError) as err:
        parse_call({"prompt": "你好", **body}, kind="completion", served="tiny", defaults=GREEDY)
    assert err.value.status == 400 and err.value.param == param, err.value.message


@pytest.mark.parametrize("version", ["chatglm", "glm-edge"])
def test_versions_without_tool_calls_refuse_them(version, models):
    with serving(models(version)) as s:
        client = s.client()
        for kwargs, param in ((dict(messages=round_trip(None)[:2] + [{"role": "user", "content": "好"}]),
                               "messages[1].tool_calls"),
                              (dict(messages=[{"role": "user", "content": "好"}], tools=[WEATHER]), "tools"),
                              (dict(messages=[{"role": "user", "content": "好"}], tool_choice="required"),
                               "tool_choice")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tiny", max_tokens=2, **kwargs)
            assert err.value.body["param"] == param, (kwargs, err.value.body)
        reply = client.chat.completions.create(model="tiny", max_tokens=2, tool_choice="none",
                                               messages=[{"role": "user", "content": "好"}])
        assert reply.choices[0].finish_reason in ("stop", "length")


def call_of(name: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": '{"city": "北京"}'}}


ASKED = {"role": "user", "content": "北京天气"}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "晴"}
REFUSED_TOOL_USE = [  # (version, messages, tools, the parameter named, the code: training's reason)
    ("chatglm3", [ASKED, {"role": "assistant", "content": None, "tool_calls": [call_of("get_time")]}, RESULT],
     [WEATHER], "messages[1].tool_calls[0].function.name", "undeclared_tool"),
    ("chatglm3", [ASKED, {"role": "assistant", "content": "", "tool_calls": [call_of("get_weather")]}, RESULT], None,
     "messages[1].tool_calls[0].function.name", "undeclared_tool"),
    ("chatglm3", [ASKED], [WEATHER, {"type": "function", "function": {"parameters": {}}}], "tools[1]", "bad_tool"),
    ("chatglm3", [ASKED, RESULT], [WEATHER], "messages[1].role", "observation_without_call"),
    ("chatglm3", [ASKED, {"role": "assistant", "content": "好"}, RESULT, ASKED], [WEATHER], "messages[2].role",
     "observation_without_call"),
    ("chatglm3", [ASKED, {"role": "assistant", "content": None, "tool_calls": [call_of("get_weather")]}, RESULT,
                  RESULT], [WEATHER], "messages[3].role", "observation_without_call"),  # two results of one call
    ("glm4-moe", [ASKED, {"role": "assistant", "content": "好"}, RESULT], None, "messages[2].role",
     "observation_without_call"),
    ("glm-edge", [ASKED, {"role": "assistant", "content": "好"}, RESULT], None, "messages[2].role", None),
]


@pytest.mark.parametrize("version, messages, tools, param, code", REFUSED_TOOL_USE,
                         ids=[f"{case[0]}-{case[3]}-{case[4]}" for case in REFUSED_TOOL_USE])
def test_tool_use_that_training_refuses_is_400_naming_the_parameter(version, messages, tools, param, code, models):
    """The rules conversation records with tools are trained under hold for a served chat: a call to a tool the
    request does not declare, a tool without a name, a tool's result that answers no call (ChatGLM3, GLM-4: parallel
    calls answered in turn pass; the agent GLMs, GLM-4.5 here, alike);
    a tool's result at all where the version has no tool form (GLM-Edge, whose `tools` and `tool_calls` are refused
    too). 400 naming the request's parameter, with the reason training gives (as the code, or the same message)."""
    from chatglm_tune.data.dialogues import Turn
    from chatglm_tune.runs import loading
    from chatglm_tune.serve.protocol import ApiError, parse_call
    from chatglm_tune.serve.service import Service

    model, tokenizer = loading.load_run(loading.resolve_run(models(version)))
    service = Service(model, tokenizer, served="tiny")
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    with pytest.raises(ApiError) as err:
        service.chat_turn(parse_call(body, kind="chat", served="tiny", defaults=service.chat_sampling))
    assert (err.value.status, err.value.param) == (400, param), err.value.body()
    if code is not None:
        assert err.value.code == code, err.value.body()
    else:  # what training says of an observation turn of this version
        with pytest.raises(ValueError) as trained:
            tokenizer.prompt_format.turn_ids(tokenizer, Turn("observation", "晴"))
        assert err.value.message == f"{param}: {trained.value}"


# ----------------------------------------------------------------------------------------------
# A non-streaming client that leaves


def endless(model, token: int, seconds: float):
    """A forward hook: every position prefers `token` (no stop id ever comes), each forward takes at least
    `seconds` (a throttle, so an answer of the whole context takes seconds to decode)."""
    def hook(module, args, kwargs, output):
        time.sleep(seconds)
        output.logits[..., token] = 1e4
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


def test_a_non_streaming_client_that_leaves_is_cancelled_at_once(models, monkeypatch):
    """Tokens keep coming, yet the request leaves the engine soon after its client closes the connection: far
    fewer tokens than its budget (the context) are decoded."""
    with serving(models("glm4")) as s:
        requests = []
        submit = s.service.engine.submit
        monkeypatch.setattr(s.service.engine, "submit", lambda request: requests.append(request) or submit(request))
        token = s.tokenizer.encode_text("好")[0]
        handle = endless(s.model, token, 0.02)
        try:
            body = json.dumps({"model": "tiny", "prompt": TEXTS[0], "temperature": 1.0}).encode()
            port = int(s.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                wait_until(lambda: s.service.engine.running == 1, "the request running")
            request = requests[0]
            wait_until(lambda: s.service.engine.running == 0, "the request leaving the engine")
        finally:
            handle.remove()
        assert request.cancelled
        decoded = s.service.engine.steps
        assert decoded < request.max_new_tokens / 4, (decoded, request.max_new_tokens)


# ----------------------------------------------------------------------------------------------
# CORS


def preflight(url: str, origin: str) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/v1/chat/completions", method="OPTIONS", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_S) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}


def test_cors_origins_are_allowed_only_when_named(models):
    """`--cors-origin` (repeatable) lets a browser page of that origin call the server: a preflight gets the
    allowing headers, a request the origin back; another origin, or a server without the flag, gets none."""
    import serve

    assert serve.parse_args(["--model", "m"]).options.cors_origins == ()
    args = serve.parse_args(["--model", "m", "--cors-origin", "http://ui.example", "--cors-origin", "http://b.example"])
    assert args.options.cors_origins == ("http://ui.example", "http://b.example")
    ui = "http://ui.example"
    with serving(models("glm4"), options=ServingOptions(cors_origins=(ui,)), api_key="k") as s:
        status, headers = preflight(s.url, ui)
        assert status == 200 and headers["access-control-allow-origin"] == ui
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"].lower()
        status, headers = preflight(s.url, "http://elsewhere.example")
        assert "access-control-allow-origin" not in headers
        request = urllib.request.Request(s.url + "/v1/models", headers={"Origin": ui, "Authorization": "Bearer k"})
        with urllib.request.urlopen(request, timeout=HANG_S) as response:
            assert response.headers["access-control-allow-origin"] == ui
    with serving(models("glm4")) as s:
        status, headers = preflight(s.url, ui)
        assert status == 405 and "access-control-allow-origin" not in headers
        request = urllib.request.Request(s.url + "/v1/models", headers={"Origin": ui})
        with urllib.request.urlopen(request, timeout=HANG_S) as response:
            assert "access-control-allow-origin" not in response.headers


# ----------------------------------------------------------------------------------------------
# Fields that would change the answer


def test_fields_that_change_the_answer_are_refused_naming_them(models):
    """What the server does not do is a 400 naming the field, never a 200 that ignores it; their default
    values (zero penalties, text format, no bias, no echo) are accepted. (A JSON response format is decoded under its
    schema's grammar in chat: tests/test_serve_structured.py; completions refuse it.)"""
    ok = [{"role": "user", "content": "你好"}]
    with serving(models("glm4")) as s:
        client = s.client()
        chat_cases = [(dict(response_format={"type": "xml"}), "response_format"),
                      (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}),
                       "response_format.json_schema"),
                      (dict(presence_penalty=0.5), "presence_penalty"),
                      (dict(frequency_penalty=-1), "frequency_penalty"),
                      (dict(logit_bias={"5": 10}), "logit_bias"), (dict(top_logprobs=2), "top_logprobs")]
        for kwargs, param in chat_cases:
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tiny", messages=ok, max_tokens=2, **kwargs)
            assert err.value.status_code == 400 and err.value.body["param"] == param, (kwargs, err.value.body)
        completion_cases = [(dict(echo=True), "echo"), (dict(suffix="。"), "suffix"),
                            (dict(logit_bias={"5": -100}), "logit_bias"),
                            (dict(presence_penalty=1.0), "presence_penalty"),
                            (dict(extra_body={"response_format": {"type": "json_object"}}), "response_format")]
        for kwargs, param in completion_cases:
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="tiny", prompt="你好", max_tokens=2, **kwargs)
            assert err.value.status_code == 400 and err.value.body["param"] == param, (kwargs, err.value.body)
        reply = client.chat.completions.create(model="tiny", messages=ok, max_tokens=2,
                                               response_format={"type": "text"}, presence_penalty=0,
                                               frequency_penalty=0.0, logit_bias={})
        assert reply.choices[0].finish_reason in ("stop", "length")
        done = client.completions.create(model="tiny", prompt="你好", max_tokens=2, echo=False, suffix=None)
        assert done.choices[0].finish_reason in ("stop", "length")


def test_a_seed_a_generator_cannot_take_is_400_naming_seed():
    """A seed is what `torch.Generator.manual_seed` takes, -2**63 to 2**64 - 1: beyond, a 400 naming `seed` and the
    range (streamed or not), never a request left to fail in the engine."""
    import torch

    from chatglm_tune.serve.protocol import ApiError, parse_call

    for seed in (10 ** 30, 2 ** 64 + 5, -2 ** 63 - 1):
        for stream in (False, True):
            with pytest.raises(ApiError) as err:
                parse_call({"prompt": "制动钳", "max_tokens": 3, "seed": seed, "stream": stream}, kind="completion",
                           served="tiny", defaults=GREEDY)
            assert (err.value.status, err.value.param) == (400, "seed") and str(2 ** 64 - 1) in err.value.message
    for seed in (2 ** 64 - 1, -2 ** 63, 0):
        call = parse_call({"prompt": "制动钳", "seed": seed}, kind="completion", served="tiny", defaults=GREEDY)
        torch.Generator().manual_seed(call.seed)


def test_a_request_whose_decoding_raises_is_answered_with_an_error(models, monkeypatch):
    """A request the engine fails on while admitting it (its generator raises: a 500 naming the error) or on its first
    token (its sampling raises: the stream ends with an error event) is answered; the server serves on."""
    with serving(models("glm4")) as s:
        emitter = s.service.engine.emitter
        row, emit = emitter.row, emitter.emit

        def failing_row(request):
            if request.seed == 7:
                raise ValueError("Overflow when unpacking long long")
            return row(request)

        def failing_emit(rows, scores):
            if any(r.request.seed == 8 for r in rows):
                raise RuntimeError("a broken sampler")
            return emit(rows, scores)

        monkeypatch.setattr(emitter, "row", failing_row)
        monkeypatch.setattr(emitter, "emit", failing_emit)
        client = s.client()
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="tiny", prompt="制动钳", max_tokens=3, seed=7)
        assert "Overflow when unpacking long long" in err.value.body["message"]
        with open_stream(s.url, {"prompt": "制动钳", "max_tokens": 3, "seed": 8}) as response:
            events = events_of(response, [])
        assert events[-1] == "[DONE]" and "a broken sampler" in json.loads(events[-2])["error"]["message"], events
        done = client.completions.create(model="tiny", prompt="制动钳", max_tokens=3, seed=9)
        assert done.choices[0].finish_reason in ("stop", "length")
        assert s.service.engine.unfinished == 0


# ----------------------------------------------------------------------------------------------
# Shutdown with streams running


def open_stream(url: str, body: dict):
    """A raw streaming POST: the response, to read its server-sent events line by line."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=HANG_S)


def events_of(response, first: list[str]) -> list[str]:
    """The data of every server-sent event until the connection closes (`first`: those read already)."""
    events = list(first)
    for line in response:
        if line.startswith(b"data: "):
            events.append(line[len(b"data: "):].decode().strip())
    return events


def next_event(response) -> str:
    for line in response:
        if line.startswith(b"data: "):
            return line[len(b"data: "):].decode().strip()
    raise AssertionError("the stream ended before its first event")


def shutting_down(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=HANG_S)
        return False
    except urllib.error.HTTPError as err:
        return err.code == 503 and json.loads(err.read())["status"] == "shutting_down"


def test_sigterm_refuses_newcomers_with_503_and_ends_open_streams_cleanly(models, tmp_path):
    """SIGTERM: during the grace serve.py still answers, a new request with 503 in OpenAI's error JSON (not a
    refused connection); a second SIGTERM ends the grace at once: a running stream ends with an error event
    then `data: [DONE]` (not cut mid-answer), and serve.py exits without a traceback."""
    log = tmp_path / "server.log"
    directory = models("glm4")
    with serve_py(directory, log, "--shutdown-grace", str(HANG_S), seconds_a_forward=0.5) as (server, url):
        stream = open_stream(url, {"model": directory.name, "prompt": TEXTS[0], "max_tokens": 400})
        first = next_event(stream)
        server.send_signal(signal.SIGTERM)
        wait_until(lambda: shutting_down(url), "/health saying the server is shutting down",
                   alive=lambda: server.poll() is None)
        request = urllib.request.Request(url + "/v1/completions", data=json.dumps({"prompt": "你好"}).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=HANG_S)
        assert err.value.code == 503
        assert json.loads(err.value.read())["error"]["code"] == "shutting_down"
        server.send_signal(signal.SIGTERM)
        events = events_of(stream, [first])
        server.wait(HANG_S)
    output = log.read_text(errors="replace")
    assert events[-1] == "[DONE]", (events[-3:], output[-3000:])
    assert json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]
    assert all("error" not in json.loads(e) for e in events[:-2])
    assert "Traceback" not in output, output[-3000:]
    assert "shutting down: no new requests" in output and "the shutdown grace ran out" in output, output[-3000:]


# ----------------------------------------------------------------------------------------------
# Smaller things: a model's route, 405, the prompt's real length, system and developer messages, tools on GLM-4


def status_of(url: str, method: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_model_by_id_and_a_wrong_method(models):
    with serving(models("glm4")) as s:
        client = s.client()
        assert client.models.retrieve("tiny").model_dump() == client.models.list().data[0].model_dump()
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve("other")
        assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
        status, body = status_of(s.url + "/v1/chat/completions", "GET")
        assert status == 405 and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["code"] == "method_not_allowed"


def test_the_page_names_its_icon_and_the_server_serves_it(models):
    with serving(models("glm4"), api_key="secret") as s:  # open, as the page is
        with urllib.request.urlopen(s.url + "/", timeout=HANG_S) as response:
            assert '<link rel="icon" href="/favicon.ico"' in response.read().decode()
        with urllib.request.urlopen(s.url + "/favicon.ico", timeout=HANG_S) as response:
            assert response.headers["Content-Type"] == "image/svg+xml"
            assert response.read().startswith(b"<svg ")


def test_an_over_long_prompt_is_reported_at_its_real_length(models):
    with serving(models("glm4")) as s:
        prompt = "发动机异响。" * 200
        with pytest.raises(openai.BadRequestError) as err:
            s.client().completions.create(model="tiny", prompt=prompt, max_tokens=4)
        real = len(s.service.format.prompt_ids(s.tokenizer, SPORecord(prompt, None), EncodingOptions(
            prompt=s.source.encoding.prompt, max_src_len=10 ** 6, max_len=10 ** 6 + 2))[0])
        assert real > s.service.context
        assert err.value.body["param"] == "prompt" and f"the prompt is {real} tokens" in err.value.body["message"]


def test_a_system_message_in_a_chat_of_rounds_goes_before_the_first_user_message(models, monkeypatch):
    """ChatGLM-6B (ChatGLM2 alike) has no system role: a leading system (or developer) message's text is put
    before the first user message, so the prompt is that of the chat with the user message so written."""
    with serving(models("chatglm")) as s:
        assert s.tokenizer.prompt_format.chat_in_pairs
        prompts = Prompts(s.service.engine, monkeypatch)
        client = s.client()
        ask = dict(model="tiny", max_tokens=2, temperature=0)
        client.chat.completions.create(**ask, messages=[{"role": "system", "content": "你是助手。"},
                                                        {"role": "user", "content": "你好"}])
        client.chat.completions.create(**ask, messages=[{"role": "developer", "content": "你是助手。"},
                                                        {"role": "user", "content": "你好"}])
        client.chat.completions.create(**ask, messages=[{"role": "user", "content": "你是助手。\n你好"}])
        assert prompts.ids[0] == prompts.ids[1] == prompts.ids[2]
        history = [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "甲"},
                   {"role": "assistant", "content": "乙"}, {"role": "user", "content": "丙"}]
        client.chat.completions.create(**ask, messages=history)
        client.chat.completions.create(**ask, messages=[{"role": "user", "content": "你是助手。\n甲"}, *history[2:]])
        assert prompts.ids[3] == prompts.ids[4]


def test_developer_is_system_and_a_tool_glm4_cannot_write_is_named(models, monkeypatch):
    with serving(models("glm4")) as s:
        prompts = Prompts(s.service.engine, monkeypatch)
        client = s.client()
        for role in ("developer", "system"):
            client.chat.completions.create(model="tiny", max_tokens=2, messages=[
                {"role": role, "content": "你是助手。"}, {"role": "user", "content": "你好"}])
        assert prompts.ids[0] == prompts.ids[1]
        # the tiny GLM-4 tokenizer's template: function tools only; a tool without a name: as training refuses it
        for tool, param in (({"type": "python", "name": "run"}, "tools"), ({"type": "python"}, "tools[0]")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tiny", max_tokens=2, tools=[tool],
                                               messages=[{"role": "user", "content": "你好"}])
            assert err.value.body["param"] == param and "tool" in err.value.body["message"], err.value.body


def test_max_draft_caps_the_guesses_of_a_speculative_server(capsys):
    import serve

    assert serve.parse_args(["--model", "m", "--speculative", "--max-draft", "1"]).options.drafts.max_draft == 1
    assert serve.parse_args(["--model", "m", "--speculative"]).options.drafts == DEFAULT_DRAFTS
    for flags, message in ((["--max-draft", "1"], "--max-draft applies only with --speculative"),
                           (["--speculative", "--max-draft", "-1"], "--max-draft must be >= 1, got -1")):
        with pytest.raises(SystemExit) as stop:
            serve.parse_args(["--model", "m", *flags])
        assert stop.value.code == 2 and message in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# A large body


def test_a_body_over_the_limit_is_413(models):
    import serve

    assert serve.parse_args(["--model", "m", "--max-body-mb", "2"]).options.max_body_mb == 2
    assert serve.parse_args(["--model", "m"]).options.max_body_mb == ServingOptions().max_body_mb
    with serving(models("glm4"), options=ServingOptions(max_body_mb=1)) as s:
        big = json.dumps({"model": "tiny",
                          "messages": [{"role": "user", "content": "好" * 7_000_000}]}).encode()  # 20 MB
        assert len(big) > 20 * 2 ** 20  # a client still sending when refused reads the 413, not a reset connection
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/extract"):
            status, body = status_of(s.url + path, "POST", big)
            assert status == 413 and body["error"]["type"] == "invalid_request_error", (path, body)
            assert body["error"]["code"] == "body_too_large"
        assert s.health()["status"] == "ok"


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_prompt_being_built_does_not_stall_the_server(route, models, monkeypatch):
    """The prompt is built (tokenized) off the event loop: while one is held in the middle of it, /health
    answers, and the request goes on once it is let go."""
    with serving(models("glm4")) as s:
        started, release = threading.Event(), threading.Event()
        name = "completion_prompts" if route == "completions" else "chat_turn"
        build = getattr(s.service, name)

        def held(call):
            started.set()
            assert release.wait(HANG_S)
            return build(call)

        monkeypatch.setattr(s.service, name, held)
        body = {"prompt": "你好"} if route == "completions" else {"messages": [{"role": "user", "content": "你好"}]}
        answers = []
        poster = threading.Thread(target=lambda: answers.append(status_of(
            f"{s.url}/v1/{route.replace('chat', 'chat/completions')}", "POST",
            json.dumps({**body, "max_tokens": 2}).encode())))
        poster.start()
        try:
            assert started.wait(HANG_S)
            # timeout: a safety bound; it answers at once
            with urllib.request.urlopen(s.url + "/health", timeout=60) as response:
                assert json.loads(response.read())["status"] == "ok"
        finally:
            release.set()
            poster.join(HANG_S)
        assert answers[0][0] == 200, answers
