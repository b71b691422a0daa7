"""serve.py's HTTP API through the official `openai` client, on tiny random models of every version.

A server (the app of `chatglm_tune.serve.app` on uvicorn, in a thread of this process) listens on a free
loopback port. Greedy answers are compared with what the library gives the same prompt alone: `chat()`
for chat, `extraction.extract` (infer.py's rows) for completions and extraction; concurrent requests
with what each returns alone; stop strings and each of GLM-4's stop ids end an answer; bad input gets
OpenAI's error JSON (400 naming the parameter, 401, 429); a client that goes away frees its slot; P-tuning,
LoRA and INT4 run directories written by train.py serve; SIGTERM stops serve.py, cutting a stream after the
grace, no traceback.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("starlette", reason='the server needs its extra: pip install -e ".[serve]"')
uvicorn = pytest.importorskip("uvicorn", reason='the server needs its extra: pip install -e ".[serve]"')
openai = pytest.importorskip("openai", reason="the tests call the server with the official client: pip install openai")

from chatglm_tune.data.dialogues import TOOL_PROMPT  # noqa: E402
from chatglm_tune.data.records import SPORecord  # noqa: E402
from chatglm_tune.decoding.batch_cache import BatchCache  # noqa: E402
from chatglm_tune.decoding.chat import chat  # noqa: E402
from chatglm_tune.decoding.engine import Engine  # noqa: E402
from chatglm_tune.decoding.generation import generate  # noqa: E402
from chatglm_tune.evaluation.extraction import extract  # noqa: E402
from chatglm_tune.options import DraftOptions, ExtractionSettings, ServingOptions, SamplingOptions  # noqa: E402
from chatglm_tune.runs import loading  # noqa: E402
from chatglm_tune.serve.app import build_app  # noqa: E402
from chatglm_tune.serve.service import Service  # noqa: E402
from commands import HANG_S, wait_until  # noqa: E402
from serving import ROOT, TEXTS, free_port, serve_py, tiny_model  # noqa: E402

LINES = (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()
GREEDY = SamplingOptions()
# GLM-Edge stands for the versions whose prompt is their directory's chat template (GLM-4-0414's too)
VERSIONS = ("chatglm", "chatglm2", "chatglm3", "glm4", "glm-edge")


class Served:
    """A running server: its URL, the in-process model and tokenizer, the Service."""

    def __init__(self, url, model, tokenizer, service, source):
        self.url, self.model, self.tokenizer, self.service, self.source = url, model, tokenizer, service, source

    def client(self, key: str = "unused") -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=HANG_S)

    def post(self, path: str, body, headers=None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json",
                                                                               **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=HANG_S) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=HANG_S) as response:
            return json.loads(response.read())


@contextlib.contextmanager
def serving(directory: Path, *, api_key=None, options=ServingOptions(), **load):
    source = loading.resolve_run(directory)
    model, tokenizer = loading.load_run(source, **load)
    service = Service(model, tokenizer, served="tiny", encoding=source.encoding, options=options)
    port = free_port()
    config = uvicorn.Config(build_app(service, api_key=api_key), host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the server starting", alive=thread.is_alive)
    try:
        yield Served(f"http://127.0.0.1:{port}", model, tokenizer, service, source)
    finally:
        server.should_exit = True
        thread.join(HANG_S)
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module", params=VERSIONS)
def served(request, tmp_path_factory):
    directory = tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    with serving(directory, options=ServingOptions(drafts=DraftOptions())) as s:  # speculative, as --speculative
        s.name = request.param
        yield s


def streamed(stream) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, usage) of a chat or completion stream."""
    text, finish, use = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            use = chunk.usage.model_dump()
        for choice in chunk.choices:
            text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
            finish = choice.finish_reason or finish
    return text, finish, use


def messages_of(served, query: str, history: list[tuple[str, str]]) -> list[dict]:
    system = [] if served.tokenizer.prompt_format.chat_in_pairs else [{"role": "system", "content": "你是一个助手。"}]
    turns = [m for q, a in history for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    return system + turns + [{"role": "user", "content": query}]


# ----------------------------------------------------------------------------------------------
# Every version, every endpoint


def test_models_and_health(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert served.health()["status"] == "ok"


def test_chat_is_the_versions_chat(served):
    history = [("发动机异响怎么办？", "检查发动机。")]
    messages = messages_of(served, "刹车失灵", history)
    reply = served.client().chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    # chat() on the same turn: the system message (role formats) is history before the pairs
    chat_history = messages[:-1] if not served.tokenizer.prompt_format.chat_in_pairs else history
    prompt_len = reply.usage.prompt_tokens
    expected, _ = chat(served.model, served.tokenizer, "刹车失灵", chat_history, max_length=prompt_len + 12,
                       sampling=GREEDY)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 12
    text, finish, use = streamed(served.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert (text, finish) == (expected, reply.choices[0].finish_reason)
    assert use == reply.usage.model_dump()


def test_completion_and_extraction_are_infer_rows(served, monkeypatch):
    """The server here decodes greedy requests speculatively (serve.py --speculative: it checks guesses,
    counted); infer.py's rows here are plain greedy decoding's: the same text."""
    checks = []
    verify = BatchCache.verify
    monkeypatch.setattr(BatchCache, "verify", lambda self, *args: checks.append(1) or verify(self, *args))
    texts = TEXTS[:3]
    settings = ExtractionSettings(encoding=served.source.encoding, max_new_tokens=10, batch_size=1, drafts=None)
    rows = [r for batch in extract(served.model, served.tokenizer, [SPORecord(t, None) for t in texts], settings)
            for r in batch]
    client = served.client()
    for text, row in zip(texts, rows):
        done = client.completions.create(model="tiny", prompt=text, max_tokens=10)
        assert done.choices[0].text == row["generated"]
        assert done.usage.completion_tokens == row["new_tokens"]
        text_streamed, finish, _ = streamed(client.completions.create(model="tiny", prompt=text, max_tokens=10,
                                                                      stream=True))
        assert text_streamed == row["generated"] and finish == done.choices[0].finish_reason
    status, body = served.post("/v1/extract", {"texts": texts, "max_tokens": 10})
    assert status == 200, body
    for got, row in zip(body["results"], rows):
        assert {k: got[k] for k in ("generated", "triples", "malformed", "new_tokens", "stopped")} == \
               {k: row[k] for k in ("generated", "triples", "malformed", "new_tokens", "stopped")}
    assert checks


def test_concurrent_requests_answer_what_each_answers_alone(served):
    client = served.client()
    jobs = [(TEXTS[i], 6 + 3 * i) for i in range(8)]

    def ask(job):
        prompt, n = job
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=n).choices[0].text

    alone = [ask(job) for job in jobs]
    steps = served.service.engine.steps
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(ask, jobs))
    assert together == alone
    # batched: far fewer decoding steps than tokens generated
    assert served.service.engine.steps - steps < sum(n for _, n in jobs) * 0.75


def test_stop_strings_end_the_answer(served):
    """Sampled with a seed (the tiny ChatGLM-6B repeats one empty piece greedily): the same seed gives the same
    answer, so the answer with a stop string is the answer without it, cut before the string."""
    client = served.client()
    messages = messages_of(served, TEXTS[0], [])
    ask = dict(model="tiny", messages=messages, max_tokens=16, temperature=1.0, top_p=1.0, seed=7)
    text = client.chat.completions.create(**ask).choices[0].message.content
    pieces = [text[i:i + 2] for i in range(1, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip()]
    assert pieces, f"the sampled answer {text!r} has no clean two-character piece to stop on"
    stop = pieces[0]
    expected = text[:text.find(stop)]
    cut = client.chat.completions.create(**ask, stop=[stop, "\x00"])
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (expected, "stop")
    text_streamed, finish, _ = streamed(client.chat.completions.create(**ask, stop=stop, stream=True))
    assert (text_streamed, finish) == (expected, "stop")


def test_each_stop_id_of_the_version_ends_the_answer(served):
    """A hook makes the model prefer one stop id from the second token on: the answer stops there, and the
    stop token's text is not in it."""
    stop_ids = served.tokenizer.prompt_format.stop_ids(served.tokenizer)
    if served.name == "glm4":
        names = [served.tokenizer.convert_ids_to_tokens(i) for i in stop_ids]
        assert set(names) == {"<|endoftext|>", "<|user|>", "<|observation|>"}
    for stop_id in stop_ids:
        def force(module, args, kwargs, output, stop_id=stop_id):
            ids = args[0] if args else kwargs["input_ids"]
            cached = kwargs["cache"].get_seq_length() - (getattr(module.config, "pre_seq_len", None) or 0)
            if cached > ids.shape[1]:  # a decoding step (one token, or a check of guesses), not a prompt
                output.logits[..., stop_id] = 1e4
            return output

        handle = served.model.register_forward_hook(force, with_kwargs=True)
        try:
            reply = served.client().chat.completions.create(model="tiny", messages=messages_of(served, TEXTS[1], []),
                                                            max_tokens=30, temperature=0)
        finally:
            handle.remove()
        assert reply.choices[0].finish_reason == "stop", stop_id
        assert reply.usage.completion_tokens == 2, stop_id
        assert served.tokenizer.convert_ids_to_tokens(stop_id) not in (reply.choices[0].message.content or "")


def test_bad_requests_get_400_naming_the_parameter(served):
    client = served.client()
    ok = [{"role": "user", "content": "你好"}]
    cases = [(dict(model="other", messages=ok), "model"),
             (dict(model="tiny", messages=ok, temperature=5), "temperature"),
             (dict(model="tiny", messages=ok, top_p=0), "top_p"), (dict(model="tiny", messages=[]), "messages"),
             (dict(model="tiny", messages=ok, max_tokens=0), "max_tokens"),
             (dict(model="tiny", messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
             (dict(model="tiny", messages=ok, max_tokens=10 ** 6), "max_tokens"),
             (dict(model="tiny", messages=ok, stop=["a", "b", "c", "d", "e"]), "stop")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kwargs)
        assert err.value.status_code == 400 and err.value.body["param"] == param, (kwargs, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:  # over the context
        client.completions.create(model="tiny", prompt="发动机异响。" * 400, max_tokens=4)
    assert err.value.body["param"] == "prompt" and "context" in err.value.body["message"]
    status, body = served.post("/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = served.post("/v1/extract", {"texts": ["ok", ""]})
    assert status == 400 and body["error"]["param"] == "texts"
    status, body = served.post("/v1/extract", {"texts": ["ok"], "stop": "x"})
    assert status == 400 and body["error"]["param"] == "stop"
    assert served.health()["status"] == "ok"


# ----------------------------------------------------------------------------------------------
# Keys, a full queue, clients that leave, shutdown


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory):
    return tiny_model("glm4", tmp_path_factory.mktemp("glm4-one"))


def test_api_key(glm4_dir):
    with serving(glm4_dir, api_key="sesame") as s:
        with pytest.raises(openai.AuthenticationError) as err:
            s.client("wrong").models.list()
        assert err.value.status_code == 401
        status, _ = s.post("/v1/extract", {"texts": ["x"]})
        assert status == 401
        assert [m.id for m in s.client("sesame").models.list().data] == ["tiny"]
        assert s.health()["status"] == "ok"  # open


@contextlib.contextmanager
def held_forwards(model, after: int = 0):
    """Every forward of `model` past the first `after` waits at its start until the `release()` this yields is called
    (or the block ends); the Event yielded beside it is set once a forward waits."""
    gate, holding, seen = threading.Event(), threading.Event(), itertools.count()

    def hold(module, inputs):
        if next(seen) >= after:
            holding.set()
            gate.wait(HANG_S)

    handle = model.register_forward_pre_hook(hold)
    try:
        yield gate.set, holding
    finally:
        gate.set()
        handle.remove()


def spy_on_cancel(monkeypatch) -> list:
    """The requests the engine is asked to cancel (`Engine.cancel`), as it is asked."""
    cancelled, cancel = [], Engine.cancel
    monkeypatch.setattr(Engine, "cancel", lambda self, request: (cancelled.append(request), cancel(self, request))[1])
    return cancelled


def test_full_queue_is_429_and_a_client_that_leaves_frees_its_slot(glm4_dir, monkeypatch):
    with serving(glm4_dir, options=ServingOptions(max_batch=1, max_queue=0)) as s:
        client = s.client()
        # the prompt's forward runs, the next one waits: the request holds its slot (it cannot end by itself) while
        # a second one is refused and while the server hears the client leave
        with held_forwards(s.model, after=1) as (release, holding):
            stream = client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=400, stream=True)
            # running, its second forward held: the one slot is taken (its first token alone may stream nothing: a
            # byte-level token can be part of a character)
            assert holding.wait(HANG_S)
            with pytest.raises(openai.RateLimitError) as err:
                client.completions.create(model="tiny", prompt=TEXTS[1], max_tokens=4)
            assert err.value.status_code == 429
            steps = s.service.engine.steps
            cancelled = spy_on_cancel(monkeypatch)
            stream.close()  # the client goes away
            wait_until(lambda: cancelled, "the server cancelling the request of a client that left")
            release()
            wait_until(lambda: s.health()["running"] == 0, "the slot of a cancelled request freed")
        assert s.service.engine.steps - steps < 10, "the abandoned request ran on"  # it had 399 tokens to go
        done = client.completions.create(model="tiny", prompt=TEXTS[1], max_tokens=4)
        assert done.usage.completion_tokens <= 4


def test_the_choices_of_a_request_leave_together(glm4_dir, monkeypatch):
    """n answers are n rows: where the queue has room for fewer, the request is a 429 and the rows it had taken are
    cancelled; a client that leaves a stream of several answers cancels every one of them."""
    with serving(glm4_dir, options=ServingOptions(max_batch=1, max_queue=0)) as s:
        cancelled = spy_on_cancel(monkeypatch)
        with pytest.raises(openai.RateLimitError):
            s.client().completions.create(model="tiny", prompt=TEXTS[0], max_tokens=400, n=2)
        assert len(cancelled) == 1
        wait_until(lambda: s.health()["running"] == 0, "the row of the refused request freed")
    with serving(glm4_dir, options=ServingOptions(max_batch=2)) as s:
        client = s.client()
        with held_forwards(s.model, after=1) as (release, holding):
            stream = client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=400, n=2, stream=True)
            assert holding.wait(HANG_S)
            steps = s.service.engine.steps
            cancelled = spy_on_cancel(monkeypatch)
            stream.close()
            wait_until(lambda: len(cancelled) >= 2, "the server cancelling both answers of a client that left")
            release()
            wait_until(lambda: s.health()["running"] == 0, "the rows of the cancelled answers freed")
        assert s.service.engine.steps - steps < 10, "an abandoned answer ran on"


def test_sigterm_stops_serve_py_and_ends_an_open_stream_after_the_grace(glm4_dir, tmp_path):
    """A stream that cannot end within the shutdown grace (a model that takes 0.5 s a forward: 400 tokens take
    minutes): SIGTERM stops serve.py, which ends the stream after its grace rather than waiting for it, with an
    error event the client raises (not a connection cut mid-answer), and says nothing it should not."""
    log = tmp_path / "server.log"
    with serve_py(glm4_dir, log, "--shutdown-grace", "1", seconds_a_forward=0.5) as (server, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=HANG_S)
        stream = iter(client.completions.create(model=glm4_dir.name, prompt=TEXTS[0], max_tokens=400, stream=True))
        next(stream)
        server.send_signal(signal.SIGTERM)
        finishes = []
        with pytest.raises(openai.APIError) as err:
            finishes += [choice.finish_reason for chunk in stream for choice in chunk.choices if choice.finish_reason]
        server.wait(HANG_S)
    assert not isinstance(err.value, openai.APIConnectionError) and "shutting down" in err.value.message
    assert finishes == []  # ended, not finished
    output = log.read_text(errors="replace")
    assert "Traceback" not in output, output[-3000:]


# ----------------------------------------------------------------------------------------------
# Run directories written by train.py: P-tuning, LoRA, and the base in INT4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import train as train_cli

    root = tmp_path_factory.mktemp("serve-runs")
    data = root / "data.jsonl"
    data.write_text("\n".join(LINES[:8]) + "\n", encoding="utf-8")
    flags = ["--train-file", data, "--max-src-len", 96, "--max-len", 112, "--batch-size", 8, "--threads", 1,
             "--max-steps", 2]
    train = lambda *args: train_cli.main([str(a) for a in args]) == 0  # noqa: E731
    assert train("--model", "tiny-glm4", "--tuning", "full", *flags, "--output-dir", root / "base")
    assert train("--model", root / "base", "--tuning", "ptuning", "--pre-seq-len", 4, *flags,
                 "--output-dir", root / "ptuning")
    assert train("--model", root / "base", "--tuning", "lora", "--lr", "1e-2", *flags, "--output-dir", root / "lora")
    return root


@pytest.mark.parametrize("kind", ["ptuning", "lora", "int4"])
def test_run_directories_serve_what_generate_gives(runs, kind):
    directory, load = (runs / "base", {"quantization_bit": 4}) if kind == "int4" else (runs / kind, {})
    with serving(directory, **load) as s:
        if kind == "ptuning":
            assert s.model.config.pre_seq_len == 4
        prompt_format = s.tokenizer.prompt_format
        stop = prompt_format.stop_ids(s.tokenizer)
        texts = TEXTS[10:14]
        alone = []
        for text in texts:
            ids, _ = prompt_format.prompt_ids(s.tokenizer, SPORecord(text, None), s.source.encoding)
            new = generate(s.model, torch.tensor([ids]), max_new_tokens=s.source.encoding.answer_budget,
                           eos_token_id=stop, vocab_limit=len(s.tokenizer))[0]
            alone.append(prompt_format.decode_answer(s.tokenizer, new))
        with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
            rows = list(pool.map(lambda t: s.post("/v1/extract", {"texts": [t]})[1]["results"][0], texts))
        assert [row["generated"] for row in rows] == alone
        assert all(row["new_tokens"] <= 112 - 96 for row in rows)  # the run's answer budget


def test_a_tool_call_is_openais_tool_calls(tmp_path):
    """ChatGLM3 writes a tool call as `name\n```python\ntool_call(k=v)\n```` after the tools in a system turn of
    its own (its tool prompt, then the functions: an OpenAI `{"type": "function", "function": f}` as `f`): the
    reply carries it as OpenAI's `tool_calls` (finish_reason "tool_calls"), as the official demo maps it. GLM-4
    keeps the tools as sent in the system message; a tool its template cannot write (the tiny tokenizer's takes
    function tools only): 400 naming the tools. GLM-4-0414's template takes the tools as its own `tools` and the
    prompt ends at `<|assistant|>`, where the model writes the tool's name, then its JSON arguments."""
    from chatglm_tune.serve.app import _chat_answer
    from chatglm_tune.serve.protocol import ApiError, parse_call
    from chatglm_tune.serve.service import Done

    tools = [{"name": "get_weather", "description": "天气", "parameters": {"type": "object"}}]
    wrapped = [{"type": "function", "function": tools[0]}]

    def turn_of(service, offered):
        body = {"messages": [{"role": "user", "content": "北京天气"}], "tools": offered}
        call = parse_call(body, kind="chat", served="tiny", defaults=service.chat_sampling)
        try:
            return call, service.chat_turn(call)
        except ApiError as err:
            assert err.status == 400 and err.param in ("tools", "tools[0]") and "tool" in err.message
            return call, None

    for name in ("chatglm3", "glm4", "glm4-0414"):
        directory = tiny_model(name, tmp_path / name)
        model, tokenizer = loading.load_run(loading.resolve_run(directory))
        service = Service(model, tokenizer, served="tiny")
        if name == "glm4-0414":
            call, turn = turn_of(service, wrapped)
            command = tokenizer.get_command
            assert turn.prompt == tokenizer.encode_chat([{"role": "user", "content": "北京天气"}], tools=wrapped,
                                                        add_generation_prompt=False) + [command("<|assistant|>")]
            answer = tokenizer.encode_text('get_weather\n{"city": "北京"}') + [command("<|observation|>")]
            message, finish = _chat_answer(call, turn, Done("", "stop", len(answer), tuple(answer), False))
            assert finish == "tool_calls"
            assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "北京"}'}
            continue
        if name == "glm4":
            assert turn_of(service, wrapped)[1].history[0] == {"role": "system", "content": "", "tools": wrapped}
            assert turn_of(service, [{"type": "python"}])[1] is None  # no name: tools[0], as training says
            assert turn_of(service, [{"type": "python", "name": "run"}])[1] is None  # not a function: the template's
            continue
        for offered in (tools, wrapped):
            call, turn = turn_of(service, offered)
            assert turn.history[0] == {"role": "system", "content": TOOL_PROMPT.rstrip("\n"), "tools": tools}
        text = "get_weather\n```python\ntool_call(city='北京')\n```"
        answer = tokenizer.encode(text, add_special_tokens=False) + tokenizer.prompt_format.stop_ids(tokenizer)[:1]
        message, finish = _chat_answer(call, turn, Done("", "stop", len(answer), tuple(answer), False))
        assert finish == "tool_calls" and message["content"] is None
        assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "北京"}'}
        plain = tokenizer.encode("晴。", add_special_tokens=False)
        message, finish = _chat_answer(call, turn, Done("", "length", len(plain), tuple(plain), False))
        assert (message, finish) == ({"role": "assistant", "content": "晴。"}, "length")


def taught(version: str, directory: Path, text: str, triples) -> Path:
    """A tiny random model of `version` taught one record (its prompt as infer.py and completions build it, its
    answer one triple a line) until every answer token leads the model's next best by a logit or more, teacher
    forced: far beyond what float rounding moves, so greedy decoding writes that multi-line answer on any CPU."""
    from chatglm_tune.data.records import Triple
    from chatglm_tune.models import registry
    from chatglm_tune.options import EncodingOptions

    torch.manual_seed(0)
    model, tokenizer = registry.VERSIONS[version].tiny(TEXTS, directory)
    row = tokenizer.prompt_format.training_row(tokenizer, SPORecord(text, tuple(Triple(*t) for t in triples)),
                                               EncodingOptions())
    ids, labels = torch.tensor([row.input_ids]), torch.tensor([row.labels])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(20):  # 80 steps are enough for both versions; a lead under 1 after 400 fails below
        model.train()
        for _ in range(20):
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if smallest_lead(model.eval(), ids, labels) >= 1:
            break
    assert smallest_lead(model, ids, labels) >= 1, "the record was not learned"
    model.save_pretrained(directory)
    return directory


def smallest_lead(model, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """The smallest margin, over the labelled positions, of the label's logit over the best other one."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    target = labels[0, 1:]
    logits, target = logits[target != -100], target[target != -100]
    chosen = logits.gather(1, target[:, None])[:, 0]
    return (chosen - logits.scatter(1, target[:, None], float("-inf")).max(1).values).min().item()


@pytest.mark.parametrize("version", ["glm4-0414", "glm-edge"])
def test_a_multi_line_chat_answer_keeps_every_line(version, tmp_path):
    """A chat answer of several lines (SPO: one triple a line) comes back whole, streamed or not: the text
    /v1/completions gives the same prompt. Without tools, GLM-4-0414's and GLM-Edge's first line never names a tool."""
    text = TEXTS[0]
    directory = taught(version, tmp_path / version, text, [("水泵", "故障", "漏油"), ("风扇", "状态", "低速")])
    with serving(directory) as s:
        prompt = s.source.encoding.prompt + text  # the chat message whose prompt is the completion's
        completion = s.client().completions.create(model="tiny", prompt=text, max_tokens=40).choices[0].text
        assert len(completion.strip().splitlines()) >= 2, completion  # the answer taught: more than one line
        messages = [{"role": "user", "content": prompt}]
        reply = s.client().chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0)
        assert reply.choices[0].message.content == completion.strip()
        stream = s.client().chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                                    stream=True)
        assert streamed(stream)[0] == completion.strip()


def test_train_and_infer_import_nothing_of_the_server():
    check = ("import sys, train, infer; loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
             "('starlette', 'uvicorn', 'openai') or m.startswith(('chatglm_tune.serve', "
             "'chatglm_tune.decoding.engine'))); print(loaded)")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
