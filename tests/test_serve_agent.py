"""serve.py's chat for the agent GLMs (GLM-4.5's template form: the tiny `glm4-moe`; GLM-4.7's: the tiny
`glm4-moe-lite`, GLM-4.7-Flash), as vLLM serves them with its glm45 / glm47 tool parsers and glm45 reasoning parser.

- The prompt is transformers' `apply_chat_template` of the tokenizer.json directory on the same conversation (tools,
  an assistant's reasoning and calls, tool results; `chat_template_kwargs` as the template's flags), nothing added
  (not the run's instruction, as for every version's chat).
- The answer: a random tiny model cannot write calls, so a forward hook makes it write a chosen answer (its logit
  for each chosen id raised far above the rest), read back through the HTTP server and the openai client, whole and
  streamed: `reasoning_content`, content, several calls (one with no arguments, arguments typed by the tools'
  schemas), finish_reason; a stream never carries a tag's text. Unforced, a greedy stream is well formed and joins
  to the answer the request gets whole.
- Bad `chat_template_kwargs`, and what these versions do not take, are 400 naming the parameter.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

pytest.importorskip("starlette", reason='the server needs its extra: pip install -e ".[serve]"')
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install -e ".[serve]"')
openai = pytest.importorskip("openai", reason="the tests call the server with the official client: pip install openai")

from chatglm_tune.data.dialogues import ToolCall  # noqa: E402
from chatglm_tune.data.xml_calls import render_calls  # noqa: E402
from chatglm_tune.models import registry  # noqa: E402
from chatglm_tune.runs import loading  # noqa: E402
from chatglm_tune.serve.protocol import ApiError, parse_call  # noqa: E402
from chatglm_tune.serve.service import Service  # noqa: E402
from serving import TEXTS, tiny_model  # noqa: E402
from test_serve import serving  # noqa: E402

VERSIONS = ("glm4-moe", "glm4-moe-lite", "glm5")  # GLM-4.5's form, GLM-4.7-Flash's (GLM-4.7's), GLM-5's
CONTEXT = 2048  # the tools block outgrows the tiny models' 512 tokens
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "天气", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                              "code": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ASKED = [{"role": "system", "content": "你是一个助手。"}, {"role": "user", "content": "北京天气和时间"}]
CALLED = {"role": "assistant", "content": None, "reasoning_content": "先查天气，再查时间。", "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": json.dumps({"city": "北京", "days": 2}, ensure_ascii=False)}},
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
RESULTS = [{"role": "tool", "tool_call_id": "call_1", "content": "晴"},
           {"role": "tool", "tool_call_id": "call_2", "content": "12点"}]
ANSWERED = {"role": "assistant", "content": "北京晴，12点。", "reasoning_content": "两个结果都有了。"}
CONVERSATIONS = {"tool results": [*ASKED, CALLED, *RESULTS],  # the model answers the tools' results
                 "next question": [*ASKED, CALLED, *RESULTS, ANSWERED, {"role": "user", "content": "上海呢？"}]}
FLAGS = [None, {"enable_thinking": False}, {"enable_thinking": True, "clear_thinking": False},
         {"clear_thinking": True}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny random model directories by version, their context raised to CONTEXT, made once."""
    made = {}

    def directory(version):
        if version not in made:
            path = tiny_model(version, tmp_path_factory.mktemp(version))
            config = json.loads((path / "config.json").read_text())
            config["max_position_embeddings"] = CONTEXT
            (path / "config.json").write_text(json.dumps(config))
            made[version] = path
        return made[version]

    return directory


@pytest.fixture(scope="module", params=VERSIONS)
def served(request, tiny):
    with serving(tiny(request.param)) as s:
        s.name = request.param
        yield s


def turn_of(service: Service, body: dict):
    return service.chat_turn(parse_call(body, kind="chat", served="tiny", defaults=service.chat_sampling))


def templated(messages: list[dict]) -> list[dict]:
    """`messages` as transformers' template reads them: a call's arguments an object."""
    out = json.loads(json.dumps(messages))
    for message in out:
        for call in message.get("tool_calls", ()):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


# ----------------------------------------------------------------------------------------------
# The prompt


@pytest.mark.parametrize("version", VERSIONS)
def test_the_prompt_is_the_release_template_on_the_whole_conversation(version, tiny):
    """Tools, an assistant's reasoning and calls (arguments as JSON text, one call with none), tool results, a later
    answer with its reasoning: the prompt ids are `apply_chat_template`'s with the request's flags (none: the
    template's default, thinking on); tool_choice "none": no tools block. A JSON answer (tools not offered): thinking
    off, then what the template writes before an answer's content."""
    from transformers import PreTrainedTokenizerFast

    source = loading.resolve_run(tiny(version))
    model, tokenizer = loading.load_run(source)
    service = Service(model, tokenizer, served="tiny", encoding=source.encoding)
    fast = PreTrainedTokenizerFast.from_pretrained(tiny(version))
    assert source.encoding.prompt  # the run has an instruction: the chat does not add it

    def official(messages, tools=TOOLS, **flags):
        return list(fast.apply_chat_template(templated(messages), tools=tools, add_generation_prompt=True,
                                             tokenize=True, return_dict=False, **flags))

    prompts = set()
    for name, messages in CONVERSATIONS.items():
        for flags in FLAGS:
            body = {"messages": messages, "tools": TOOLS, **({"chat_template_kwargs": flags} if flags else {})}
            turn = turn_of(service, body)
            assert turn.prompt == official(messages, **(flags or {})), (name, flags)
            assert turn.thinking == (flags is None or flags.get("enable_thinking") is not False)
            prompts.add(tuple(turn.prompt))
        none = turn_of(service, {"messages": messages, "tools": TOOLS, "tool_choice": "none"})
        assert none.prompt == official(messages, tools=None) and none.tools is None
    # the flags reach the template: thinking off changes each prompt, clear_thinking false GLM-4.7's next question
    assert len(prompts) == 2 * 2 + (version in ("glm4-moe-lite", "glm5"))
    messages = CONVERSATIONS["next question"]
    turn = turn_of(service, {"messages": messages, "tools": TOOLS, "tool_choice": "none",
                             "response_format": {"type": "json_object"}})
    lead = tokenizer.prompt_format.text_answer_lead(tokenizer)
    assert turn.json_answer and turn.grammar
    assert turn.prompt == official(messages, tools=None, enable_thinking=False) + tokenizer.encode_text(lead)


# ----------------------------------------------------------------------------------------------
# The answer, forced


@contextlib.contextmanager
def forced(model, prompt_length: int, ids: list[int]):
    """`model` writes `ids` after a prompt of `prompt_length` tokens: at each step its logit for the next of them is
    raised far above any other (greedy decoding picks it)."""
    def force(module, args, kwargs, output):
        at = kwargs["cache"].get_seq_length() - prompt_length  # the answer's position these logits choose
        if 0 <= at < len(ids):
            output.logits[..., ids[at]] = 1e4
        return output

    handle = model.register_forward_hook(force, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


CALLS = [ToolCall("get_weather", {"city": "北京", "days": 2, "code": "007"}), ToolCall("get_time", {}),
         ToolCall("get_weather", {"city": "上海"})]
WANTED_CALLS = [("get_weather", {"city": "北京", "days": 2, "code": "007"}), ("get_time", {}),
                ("get_weather", {"city": "上海"})]


def answers(form: str) -> list[tuple]:
    """(request flags, the answer text as the model writes it, its stop token, the message wanted: reasoning, content,
    calls, finish_reason) in `form` ("glm45": GLM-4.5's, the model opens its think block; "glm47": the prompt
    does)."""
    think = "\n<think>" if form == "glm45" else ""
    after = "\n" if form == "glm45" else ""
    reasoning = "先查北京的天气，再查时间。"
    return [(None, f"{think}{reasoning}</think>{after}我来查一下。{render_calls(CALLS, form)}", "<|observation|>",
             (reasoning, "我来查一下。", WANTED_CALLS, "tool_calls")),
            (None, f"{think}{reasoning}</think>{render_calls(CALLS[1:2], form)}", "<|observation|>",
             (reasoning, None, WANTED_CALLS[1:2], "tool_calls")),
            ({"enable_thinking": False}, f"{after}北京晴，12点。", "<|user|>", (None, "北京晴，12点。", [], "stop"))]


def streamed_message(stream, kinds: list | None = None, scored: list | None = None) -> tuple:
    """(reasoning deltas, content deltas, tool_calls entries, finish_reason) of a chat stream; `kinds`: the field
    each chunk after the first carries ("reasoning_content", "content", "tool_calls"; "" for none), appended;
    `scored`: the tokens' log probabilities the chunks carry, appended."""
    reasoning, content, calls, finish, first = [], [], [], None, True
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            said = {"reasoning_content": (delta.model_extra or {}).get("reasoning_content"), "content": delta.content,
                    "tool_calls": delta.tool_calls}
            if kinds is not None and not first:
                kinds.append("+".join(k for k, v in said.items() if v))
            first = False
            reasoning += [said["reasoning_content"]] if said["reasoning_content"] else []
            content += [delta.content] if delta.content else []
            calls += [call.model_dump() for call in delta.tool_calls or ()]
            finish = choice.finish_reason or finish
            if scored is not None and choice.logprobs is not None:
                scored += [entry.logprob for entry in choice.logprobs.content or ()]
    return reasoning, content, calls, finish


def test_answers_read_as_vllm_reads_them_whole_and_streamed(served):
    """Reasoning, content and three calls (one with no arguments; "007" stays a string where the schema says string,
    "2" becomes 2 where it says integer); a call alone (content null); thinking off, text alone. Streamed: the
    reasoning in pieces as it comes, then the content, each call whole with its index, no tag's text anywhere; the
    log probabilities of every answer token but the stop id, tags' tokens too, as the whole answer has them."""
    form = served.tokenizer.prompt_format.call_form
    client = served.client()
    messages = [{"role": "user", "content": "北京天气和时间"}]
    for flags, text, stop, (reasoning, content, calls, finish) in answers(form):
        body = {"messages": messages, "tools": TOOLS, **({"chat_template_kwargs": flags} if flags else {})}
        prompt = turn_of(served.service, body)
        ids = served.tokenizer.encode_marked(text) + [served.tokenizer.get_command(stop)]
        assert served.tokenizer.decode(ids[:-1], spaces_between_special_tokens=False) == text
        ask = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=len(ids) + 5, temperature=0,
                   logprobs=True, extra_body={"chat_template_kwargs": flags} if flags else None)
        scored = []
        with forced(served.model, len(prompt.prompt), ids):
            reply = client.chat.completions.create(**ask)
            stream = streamed_message(client.chat.completions.create(**ask, stream=True), scored=scored)
        assert len(reply.choices[0].logprobs.content) == len(scored) == len(ids) - 1
        message = reply.choices[0].message
        assert (message.model_extra["reasoning_content"], message.content, reply.choices[0].finish_reason) == \
               (reasoning, content, finish), (form, text)
        got = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]
        assert got == calls and reply.usage.completion_tokens == len(ids)
        assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls or ())
        assert len({c.id for c in message.tool_calls or ()}) == len(calls)
        pieces, said, entries, stream_finish = stream
        assert "".join(pieces) == (reasoning or "") and "".join(said) == (content or "")
        assert stream_finish == finish
        assert len(pieces) > 1 or reasoning is None  # reasoning streams as it comes, not at the end
        assert [(e["index"], e["function"]["name"], json.loads(e["function"]["arguments"])) for e in entries] == \
               [(i, name, arguments) for i, (name, arguments) in enumerate(calls)]
        assert all(e["id"].startswith("call_") and e["type"] == "function" for e in entries)
        assert not any(tag in piece for piece in pieces + said for tag in TAGS)


def test_tool_choice_none_reads_no_call(served):
    """tool_choice "none": the tools are not offered and a call the model writes anyway stays text of the content,
    whole and streamed (as vLLM runs no tool parser then); the reasoning is still split off."""
    form = served.tokenizer.prompt_format.call_form
    text = ("\n<think>" if form == "glm45" else "") + "想一想</think>" + render_calls(CALLS[1:2], form)
    messages = [{"role": "user", "content": "几点了"}]
    prompt = turn_of(served.service, {"messages": messages, "tools": TOOLS, "tool_choice": "none"}).prompt
    ids = served.tokenizer.encode_marked(text) + [served.tokenizer.get_command("<|observation|>")]
    ask = dict(model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=len(ids), temperature=0)
    client = served.client()
    with forced(served.model, len(prompt), ids):
        reply = client.chat.completions.create(**ask)
        pieces, said, entries, finish = streamed_message(client.chat.completions.create(**ask, stream=True))
    message = reply.choices[0].message
    written = text.partition("</think>")[2].strip()
    assert (message.model_extra["reasoning_content"], message.content, message.tool_calls) == ("想一想", written, None)
    assert reply.choices[0].finish_reason == finish == "stop"
    assert ("".join(pieces), "".join(said), entries) == ("想一想", written, [])


def test_a_random_models_stream_is_well_formed(served):
    """Greedy, unforced, thinking on and off: each chunk carries one field, reasoning deltas before content deltas,
    and they join to the message the same request gets whole (a random model may write tag tokens anywhere: what
    is not a think block's or a read call's tag is text, as vLLM streams it)."""
    client = served.client()
    for flags in (None, {"enable_thinking": False}):
        ask = dict(model="tiny", messages=[{"role": "user", "content": "北京天气"}], max_tokens=12, temperature=0,
                   extra_body={"chat_template_kwargs": flags} if flags else None)
        message = client.chat.completions.create(**ask).choices[0].message
        kinds = []
        pieces, said, entries, finish = streamed_message(client.chat.completions.create(**ask, stream=True), kinds)
        assert ("".join(pieces), "".join(said)) == (message.model_extra["reasoning_content"] or "",
                                                    message.content or "")
        assert finish in ("stop", "length") and entries == []  # no tools: no call is read
        assert kinds[-1] == "" and set(kinds) <= {"reasoning_content", "content", ""}, kinds
        order = [kind for kind in kinds if kind]
        assert order == sorted(order, key=["reasoning_content", "content"].index), order


# ----------------------------------------------------------------------------------------------
# What is refused


BAD = [({"chat_template_kwargs": {"reasoning_effort": "high"}}, "chat_template_kwargs.reasoning_effort"),
       ({"reasoning_effort": "high"}, "reasoning_effort"),  # no reasoning-effort line in these templates
       ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
       ({"chat_template_kwargs": {"clear_thinking": None}}, "chat_template_kwargs.clear_thinking"),
       ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
       ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
       ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
       ({"response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": True}},
        "response_format"),
       ({"messages": [ASKED[1], {"role": "assistant", "content": "好", "reasoning_content": 5}, ASKED[1]]},
        "messages[1].reasoning_content"),
       ({"messages": [ASKED[1], {"role": "observation", "content": "晴"}]}, "messages[1].role"),
       ({"messages": [ASKED[1], {"role": "assistant", "content": "好"}]}, "messages[1].role"),
       ({"messages": [{"role": "system", "content": "", "tools": TOOLS}, ASKED[1]]}, "messages[0].tools"),
       ({"messages": [ASKED[1], CALLED, *RESULTS], "tools": TOOLS[1:]}, "messages[1].tool_calls[0].function.name"),
       ({"messages": [ASKED[1], RESULTS[0]], "tools": TOOLS}, "messages[1].role")]


def test_glm52_prompts_write_the_reasoning_effort_asked(tmp_path):
    """GLM-5.2's template served: `chat_template_kwargs.reasoning_effort` ("high", "max") reaches it, the prompt is
    `apply_chat_template`'s with it (none: Max while thinking, no line with thinking off); another value is a 400."""
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    model, _ = registry.VERSIONS["glm5"].tiny(TEXTS, tmp_path, chat_template_of="glm5.2")
    model.save_pretrained(tmp_path)
    source = loading.resolve_run(tmp_path)
    model, tokenizer = loading.load_run(source)
    service = Service(model, tokenizer, served="tiny", encoding=source.encoding)
    fast = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    messages = CONVERSATIONS["next question"]
    for flags, line in ((None, "Max"), ({"reasoning_effort": "high"}, "High"), ({"reasoning_effort": "max"}, "Max"),
                        ({"enable_thinking": False, "reasoning_effort": "high"}, None)):
        turn = turn_of(service, {"messages": messages, "tools": TOOLS,
                                 **({"chat_template_kwargs": flags} if flags else {})})
        official = fast.apply_chat_template(templated(messages), tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                            return_dict=False, **(flags or {}))
        assert turn.prompt == list(official)
        text = fast.decode(turn.prompt)
        assert (f"Reasoning Effort: {line}" in text if line else "Reasoning Effort" not in text), flags
    with pytest.raises(ApiError) as err:
        turn_of(service, {"messages": ASKED, "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert (err.value.status, err.value.param) == (400, "chat_template_kwargs.reasoning_effort")
    # OpenAI's own top-level parameter asks the same
    asked = {"messages": messages, "tools": TOOLS}
    high = turn_of(service, {**asked, "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert turn_of(service, {**asked, "reasoning_effort": "high"}).prompt == high.prompt
    for body in ({"reasoning_effort": "low"},
                 {"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "max"}}):
        with pytest.raises(ApiError) as err:
            turn_of(service, {"messages": ASKED, **body})
        assert (err.value.status, err.value.param) == (400, "reasoning_effort"), body


@pytest.mark.parametrize("version", VERSIONS)
def test_what_these_versions_cannot_take_is_400_naming_it(version, tiny):
    model, tokenizer = loading.load_run(loading.resolve_run(tiny(version)))
    service = Service(model, tokenizer, served="tiny")
    for fields, param in BAD:
        with pytest.raises(ApiError) as err:
            turn_of(service, {"messages": ASKED, **fields})
        assert (err.value.status, err.value.param) == (400, param), (fields, err.value.body())


def test_bad_chat_template_kwargs_over_http(served):
    client = served.client()
    for kwargs, param in (({"thinking": True}, "chat_template_kwargs.thinking"),
                          ({"enable_thinking": 1}, "chat_template_kwargs.enable_thinking")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=ASKED, max_tokens=2,
                                           extra_body={"chat_template_kwargs": kwargs})
        assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body


def test_other_versions_ignore_reasoning_content_and_template_kwargs(tmp_path):
    """GLM-4-9B's prompt is what it was: an assistant's reasoning_content and chat_template_kwargs change nothing; a
    top-level reasoning_effort, which it has no line for, is a 400."""
    model, tokenizer = loading.load_run(loading.resolve_run(tiny_model("glm4", tmp_path / "glm4")))
    service = Service(model, tokenizer, served="tiny")
    plain = [ASKED[1], {"role": "assistant", "content": "好"}, ASKED[1]]
    reasoned = [ASKED[1], {**plain[1], "reasoning_content": "想一想"}, ASKED[1]]
    assert turn_of(service, {"messages": reasoned, "chat_template_kwargs": {"enable_thinking": True}}).prompt == \
           turn_of(service, {"messages": plain}).prompt
    with pytest.raises(ApiError) as err:  # a reasoning effort it cannot write is said, not dropped
        turn_of(service, {"messages": plain, "reasoning_effort": "high"})
    assert (err.value.status, err.value.param) == (400, "reasoning_effort")
