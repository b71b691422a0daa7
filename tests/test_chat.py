"""The official `model.chat` / `model.stream_chat` of every version (chatglm_tune.decoding.chat).

- ChatGLM3 / GLM-4 take and return history as role messages (system, user, assistant, observation; the query's
  role is `role=`), build the official prompt (ChatGLM3's `build_chat_input`, GLM-4's chat template), and
  post-process an answer into text or a tool call as the official `process_response`; (query, response)
  pairs are converted. ChatGLM-6B / ChatGLM2 keep their pairs and refuse role messages.
- `stream_chat` yields the growing answer from one KV-cached step a token, never a half character, and ends
  with what `chat` returns for the same seed.
- Defaults are the official ones of each version.
Tiny random models of each version (`Version.tiny`) are built once for the module.
"""

import json
from pathlib import Path

import pytest
import torch

import chatglm_tune.decoding.chat as chat_module
from chatglm_tune.decoding.chat import chat, chat_defaults, stream_chat
from chatglm_tune.decoding.generation import generate
from chatglm_tune.models import registry
from chatglm_tune.models.glm.config import FORMATS
from chatglm_tune.models.glm.versions import load_glm_tokenizer
from chatglm_tune.options import SamplingOptions

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT.parent / "shared" / "assets"
GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "tokenizer-glm.json").read_text(encoding="utf-8"))
TEXTS = [json.loads(line)["text"]
         for line in (ROOT / "data" / "spo_dev.jsonl").read_text(encoding="utf-8").splitlines()[:40]]
RARE = "龘"  # not in the corpus: its UTF-8 bytes are several tokens in the byte-level / byte-fallback tokenizers
ALL = ("chatglm", "chatglm2", "chatglm3", "glm4")
GLM = ("chatglm3", "glm4")
TOOLS = [{"name": "get_weather", "description": "天气",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{version: (random tiny model in eval mode, its tokenizer)}."""
    built = {}
    for name in ALL:
        torch.manual_seed(0)
        model, tokenizer = registry.VERSIONS[name].tiny(TEXTS + ["你好，世界。Hello!"], tmp_path_factory.mktemp(name))
        built[name] = model.eval(), tokenizer
    assert RARE not in "".join(TEXTS)
    return built


def history_of_every_role():
    return [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "水泵漏油"},
            {"role": "assistant", "metadata": "", "content": "水泵_故障_漏油"}]


class GenerateSpy:
    """Stands in for `generate` in the chat module: records its calls and answers `answer` ids (or runs the real
    one)."""

    def __init__(self, answer=None):
        self.calls, self.answer = [], answer

    def __call__(self, model, input_ids, attention_mask=None, **kwargs):
        self.calls.append({"input_ids": input_ids[0].tolist(), **kwargs})
        return [list(self.answer)] if self.answer is not None else generate(model, input_ids, attention_mask, **kwargs)


def spy_on_generate(monkeypatch, answer=None) -> GenerateSpy:
    spy = GenerateSpy(answer)
    monkeypatch.setattr(chat_module, "generate", spy)
    return spy


# ----------------------------------------------------------------------------------------------
# ChatGLM3 / GLM-4: role messages


@pytest.mark.parametrize("version", GLM)
def test_glm_chat_returns_role_message_history(tiny, version):
    model, tokenizer = tiny[version]
    response, history = model.chat(tokenizer, "水泵漏油", history=[], max_length=48, seed=0)
    assert isinstance(response, str) and all(isinstance(m, dict) for m in history)
    assert history[0] == {"role": "user", "content": "水泵漏油"}
    assert [m["role"] for m in history] == ["user"] + ["assistant"] * (len(history) - 1) and len(history) >= 2
    assert set(history[-1]) == {"role", "metadata", "content"}
    # the returned history goes back in, with a system message first and a tool result as the query
    passed = [{"role": "system", "content": "你是助手。"}, *history]
    before = json.dumps(passed, ensure_ascii=False)
    response2, history2 = model.chat(tokenizer, '{"温度": 20}', passed, role="observation", max_length=200, seed=1)
    assert json.dumps(passed, ensure_ascii=False) == before  # the caller's history is left as it is
    assert history2[: len(passed) + 1] == [*passed, {"role": "observation", "content": '{"温度": 20}'}]
    assert history2[-1]["role"] == "assistant"


@pytest.mark.parametrize("version", GLM)
def test_glm_chat_builds_the_official_prompt(tiny, version, monkeypatch):
    model, tokenizer = tiny[version]
    history, query = history_of_every_role(), '{"温度": 20}'
    if version == "chatglm3":
        official = tokenizer.build_chat_input(query, history, role="observation")["input_ids"][0].tolist()
    else:
        official = tokenizer.apply_chat_template([*history, {"role": "observation", "content": query}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
    command = tokenizer.get_command
    specials = [i for i in official if i in tokenizer.special_token_ids]
    assert specials == [command("[gMASK]"), command("sop" if version == "chatglm3" else "<sop>"), command("<|system|>"),
                        command("<|user|>"), command("<|assistant|>"), command("<|observation|>"),
                        command("<|assistant|>")]
    spy = spy_on_generate(monkeypatch)
    response, new_history = model.chat(tokenizer, query, history, role="observation",
                                       max_length=len(official) + 24, seed=2)
    (call,) = spy.calls
    assert call["input_ids"] == official
    assert call["eos_token_id"] == tokenizer.stop_token_ids and call["max_new_tokens"] == 24
    assert new_history[:4] == [*history, {"role": "observation", "content": query}]


@pytest.mark.parametrize("version", GLM)
def test_glm_prompts_equal_the_official_ones_on_the_real_tokenizers(version):
    directory = ASSETS / version
    if not (directory / "tokenizer.model").exists():
        pytest.skip(f"{directory} is absent (the real tokenizers live in shared/ beside the checkout)")
    tokenizer = load_glm_tokenizer(directory, version=version)
    checked = 0
    for golden in GOLDEN[version]["chats"]:
        if version == "chatglm3":
            messages = [*golden["history"], {"role": golden["role"], "content": golden["query"]}]
        else:
            messages = golden["messages"]
            if "<|" in json.dumps(messages):
                continue  # GLM-4's official template makes typed "<|user|>" special; chat keeps text as data
        assert registry.VERSIONS[version].format.chat_ids(tokenizer, messages) == golden["input_ids"]
        checked += any(m["role"] == "observation" for m in messages) and "tools" in messages[0]
    assert checked == 1  # a system message with tools, an assistant tool call and an observation


@pytest.mark.parametrize("version", GLM)
def test_glm_chat_converts_pair_history(tiny, version, monkeypatch):
    model, tokenizer = tiny[version]
    spy = spy_on_generate(monkeypatch)
    response, history = model.chat(tokenizer, "你好", [("早", "早上好")], max_length=64, seed=3)
    as_messages = [{"role": "user", "content": "早"}, {"role": "assistant", "metadata": "", "content": "早上好"}]
    assert model.chat(tokenizer, "你好", as_messages, max_length=64, seed=3) == (response, history)
    assert spy.calls[0]["input_ids"] == spy.calls[1]["input_ids"]
    assert history[:3] == [*as_messages, {"role": "user", "content": "你好"}]
    with pytest.raises(ValueError, match=r"history\[0\]"):
        model.chat(tokenizer, "你好", [("only one",)])
    with pytest.raises(ValueError, match="role must be one of"):
        model.chat(tokenizer, "你好", role="tool")


def test_glm_defaults_are_the_official_ones(tiny, monkeypatch):
    official = SamplingOptions(do_sample=True, top_p=0.8, temperature=0.8, top_k=50)
    formats = {name: version.format for name, version in registry.VERSIONS.items()}
    assert (chat_defaults(formats["chatglm2"]) == chat_defaults(formats["chatglm3"]) == chat_defaults(formats["glm4"])
            == (official, 8192))
    assert chat_defaults(formats["chatglm"]) == (SamplingOptions(do_sample=True, top_p=0.7, temperature=0.95,
                                                                 top_k=50), 2048)
    for version in ALL:
        model, tokenizer = tiny[version]
        stop = formats[version].stop_ids(tokenizer)
        spy = spy_on_generate(monkeypatch, answer=stop)
        model.chat(tokenizer, "你好")
        sampling, max_length = chat_defaults(formats[version])
        assert spy.calls[0]["sampling"] == sampling
        assert spy.calls[0]["max_new_tokens"] == max_length - len(spy.calls[0]["input_ids"])
        model.chat(tokenizer, "你好", top_p=0.5, top_k=0, do_sample=False)
        expected = SamplingOptions(do_sample=False, top_p=0.5, temperature=sampling.temperature, top_k=None)
        assert spy.calls[1]["sampling"] == expected
    with pytest.raises(ValueError, match="num_beams"):
        model.chat(tokenizer, "你好", num_beams=2)


# ----------------------------------------------------------------------------------------------
# process_response of ChatGLM3 / GLM-4: text, tool calls


def process_chat_response(texts, history, version):
    """ChatGLM3's / GLM-4's post-processing of an answer (its format's `chat_response`)."""
    return FORMATS[version].chat_response(texts, "", history)


def test_process_chat_response_text_and_tool_calls():
    asked = [{"role": "user", "content": "北京天气"}]
    with_tools = [{"role": "system", "content": "可用工具", "tools": TOOLS}, *asked]
    # plain text: the first (empty) line is the metadata; the training-time placeholder only in the response
    response, history = process_chat_response(["\n 今天是[[训练时间]] "], asked, "chatglm3")
    assert response == "今天是2023年"
    assert history == [*asked, {"role": "assistant", "metadata": "", "content": "今天是[[训练时间]]"}]
    assert process_chat_response(["\n[[训练时间]]"], asked, "glm4")[0] == "2024年"
    assert process_chat_response(["没有换行"], asked, "glm4")[0] == "没有换行"
    # ChatGLM3's tool call: a python block calling tool_call, its arguments read as literals
    call = "get_weather\n```python\ntool_call(city='北京', days=2, units=[\"C\"])\n```"
    response, history = process_chat_response([call], with_tools, "chatglm3")
    assert response == {"name": "get_weather", "parameters": {"city": "北京", "days": 2, "units": ["C"]}}
    assert history[-1] == {"role": "assistant", "metadata": "get_weather",
                           "content": "```python\ntool_call(city='北京', days=2, units=[\"C\"])\n```"}
    # GLM-4's: JSON
    response, history = process_chat_response(['get_weather\n{"city": "北京"}'], with_tools, "glm4")
    assert response == {"name": "get_weather", "parameters": {"city": "北京"}}
    assert history[-1] == {"role": "assistant", "metadata": "get_weather", "content": '{"city": "北京"}'}
    # nothing is evaluated: a call that is not literals stays content; so does a call still streaming
    evil = "get_weather\n```python\ntool_call(city=__import__('os').getcwd())\n```"
    assert process_chat_response([evil], with_tools, "chatglm3")[0] == {"name": "get_weather",
                                                                        "content": evil.split("\n", 1)[1]}
    assert process_chat_response(["get_weather\n```python\ntool_ca"], with_tools, "chatglm3")[0] == {
        "name": "get_weather", "content": "```python\ntool_ca"}
    assert process_chat_response(['get_weather\n{"ci'], with_tools, "glm4")[0] == {"name": "get_weather",
                                                                                   "content": '{"ci'}
    # ChatGLM3's first line is metadata, tools or not; GLM-4-9B's names a tool only where the tools declare it
    assert process_chat_response(["note\nbody"], asked, "chatglm3")[0] == {"name": "note", "content": "body"}
    assert process_chat_response(["note\nbody"], asked, "glm4")[0] == "note\nbody"
    assert process_chat_response(['note\n{"city": "北京"}'], with_tools, "glm4")[0] == 'note\n{"city": "北京"}'
    # two segments (the model wrote <|assistant|> between them): two assistant messages, the last one answers
    response, history = process_chat_response(["\n我查一下。", 'get_weather\n{"city": "北京"}'], with_tools, "glm4")
    assert response == {"name": "get_weather", "parameters": {"city": "北京"}}
    assert [m["metadata"] for m in history[2:]] == ["", "get_weather"] and history[:2] == with_tools


SPO_ANSWER = "水泵_故障_漏油\n风扇_状态_低速\n水温_状态_高"  # one triple a line


@pytest.mark.parametrize("version", ["glm4", "glm4-0414", "glm-edge"])
def test_a_multi_line_answer_is_all_content(version):
    """An SPO answer is one triple a line: none of its lines is taken for a tool's name. GLM-4-9B's and GLM-4-0414's
    first line names a tool only where the system message declares it; GLM-Edge writes no call (its chat template
    has no tool form), so its answer is the whole text, tools or not."""
    asked = [{"role": "user", "content": "故障现象：发动机水温高。"}]
    with_tools = [{"role": "system", "content": "可用工具", "tools": TOOLS}, *asked]
    for history in (asked, with_tools):
        response, new_history = process_chat_response([SPO_ANSWER + "\n"], history, version)
        assert response == SPO_ANSWER
        assert new_history == [*history, {"role": "assistant", "metadata": "", "content": SPO_ANSWER}]
    call = 'get_weather\n{"city": "北京"}'
    expected = call if version == "glm-edge" else {"name": "get_weather", "parameters": {"city": "北京"}}
    assert process_chat_response([call], with_tools, version)[0] == expected


def test_glm4_0414_chat_returns_every_line_of_its_answer(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, tokenizer = registry.VERSIONS["glm4-0414"].tiny(TEXTS, tmp_path)
    answer = tokenizer.encode_text(SPO_ANSWER) + tokenizer.prompt_format.stop_ids(tokenizer)[:1]
    spy_on_generate(monkeypatch, answer=answer)
    response, history = model.eval().chat(tokenizer, "故障现象：发动机水温高。")
    assert response == SPO_ANSWER and history[-1]["content"] == SPO_ANSWER


def test_chatglm3_chat_returns_a_tool_call(tiny, monkeypatch):
    model, tokenizer = tiny["chatglm3"]
    command = tokenizer.get_command
    answer = (tokenizer.encode_text("先查天气。") + [command("<|assistant|>")] + tokenizer.encode_text("get_weather\n")
              + tokenizer.encode_text("```python\ntool_call(city='北京')\n```")
              + [command("<|observation|>")])
    spy_on_generate(monkeypatch, answer=answer)
    system = {"role": "system", "content": "可用工具", "tools": TOOLS}
    response, history = model.chat(tokenizer, "北京天气", [system])
    assert response == {"name": "get_weather", "parameters": {"city": "北京"}}
    assert [(m["role"], m.get("metadata")) for m in history] == [
        ("system", None), ("user", None), ("assistant", ""), ("assistant", "get_weather")]
    assert history[2]["content"] == "先查天气。" and history[0] == system and history[0] is not system


# ----------------------------------------------------------------------------------------------
# ChatGLM-6B / ChatGLM2: (query, response) pairs


@pytest.mark.parametrize("version", ["chatglm", "chatglm2"])
def test_pair_versions_keep_pairs_and_refuse_role_messages(tiny, version):
    model, tokenizer = tiny[version]
    response, history = model.chat(tokenizer, "你好", [["早", "早上好"]], max_length=64, seed=4)
    assert history == [("早", "早上好"), ("你好", response)]
    with pytest.raises(ValueError, match=r"pairs.*history\[0\] is a role message"):
        model.chat(tokenizer, "你好", [{"role": "user", "content": "早"}, {"role": "assistant", "content": "早上好"}])
    with pytest.raises(ValueError, match="no roles"):
        model.chat(tokenizer, "你好", role="observation")
    with pytest.raises(ValueError, match=r"pairs.*role message"):
        next(model.stream_chat(tokenizer, "你好", [{"role": "user", "content": "早"}]))


def test_chatglm2_post_processing(tiny, monkeypatch):
    model, tokenizer = tiny["chatglm2"]
    spy_on_generate(monkeypatch, answer=tokenizer.encode_text("  训练于[[训练时间]] ") + [tokenizer.eos_token_id])
    assert model.chat(tokenizer, "你好")[0] == "训练于2023年"


# ----------------------------------------------------------------------------------------------
# stream_chat


def same_segment_text_pairs(yields):
    """Consecutive (earlier, later) text responses of one assistant message."""
    for (a, ha), (b, hb) in zip(yields, yields[1:]):
        if isinstance(a, str) and isinstance(b, str) and len(ha) == len(hb):
            yield a, b


@pytest.mark.parametrize("version", ALL)
def test_stream_chat_grows_to_what_chat_returns(tiny, version):
    model, tokenizer = tiny[version]
    history = [("早", "早上好")]
    kwargs = dict(max_length=80, seed=5)
    final = model.chat(tokenizer, "水泵漏油", history, **kwargs)
    yields = list(model.stream_chat(tokenizer, "水泵漏油", history, **kwargs))
    assert len(yields) >= 2 and yields[-1] == final
    assert all(a != b for a, b in zip(yields, yields[1:]))
    full_width = str.maketrans("，！：；？", ",!:;?")  # ChatGLM-6B makes punctuation next to CJK full-width
    pairs = list(same_segment_text_pairs(yields))
    assert pairs and all(b.translate(full_width).startswith(a.translate(full_width)) for a, b in pairs)
    for response, new_history in yields:
        if version in ("chatglm", "chatglm2"):
            assert new_history == [("早", "早上好"), ("水泵漏油", response)]
        else:
            assert new_history[:3] == [{"role": "user", "content": "早"},
                                       {"role": "assistant", "metadata": "", "content": "早上好"},
                                       {"role": "user", "content": "水泵漏油"}]
            assert all(m["role"] == "assistant" for m in new_history[3:]) and len(new_history) >= 4
    # the module functions with explicit sampling agree too
    sampling = SamplingOptions(do_sample=True, top_p=0.9, temperature=0.7, top_k=20)
    streamed = list(stream_chat(model, tokenizer, "你好", max_length=40, sampling=sampling, seed=6))
    assert streamed[-1] == chat(model, tokenizer, "你好", max_length=40, sampling=sampling, seed=6)


@pytest.mark.parametrize("version", ["chatglm", "glm4"])
def test_chat_on_a_static_cache_answers_the_same(tiny, version, monkeypatch):
    """chat() / stream_chat() with `compiled` (each step run uncompiled here: tests/test_static_decoding.py
    compiles)."""
    from chatglm_tune.decoding import static_decoding

    steps = []
    monkeypatch.setattr(static_decoding, "compiled_step",
                        lambda model: lambda *a: steps.append(1) or static_decoding.forward_step(model, *a))
    model, tokenizer = tiny[version]
    kwargs = dict(max_length=60, seed=5)
    plain = model.chat(tokenizer, "水泵漏油", **kwargs)
    assert model.chat(tokenizer, "水泵漏油", compiled=True, **kwargs) == plain and steps
    assert list(model.stream_chat(tokenizer, "水泵漏油", compiled=True, **kwargs))[-1] == plain


@pytest.mark.parametrize("version", ALL)
def test_stream_chat_runs_one_cached_step_a_token(tiny, version):
    model, tokenizer = tiny[version]
    lengths = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: lengths.append(
        (args[0] if args else kwargs["input_ids"]).shape[-1]), with_kwargs=True)
    try:
        stream = model.stream_chat(tokenizer, "你好", max_length=60, seed=7)
        first = next(stream)
        assert len(lengths) >= 1 and lengths[0] > 1 and set(lengths[1:]) <= {1}  # the prompt once, then a token a step
        steps_so_far = len(lengths)
        rest = list(stream)
    finally:
        handle.remove()
    assert set(lengths[1:]) <= {1} and len(lengths) <= 60 - lengths[0]
    assert len(lengths) > steps_so_far or not rest  # later yields came from later steps, not a new generation
    assert model.training is False and first


@pytest.mark.parametrize("version", GLM)
def test_stream_chat_holds_back_half_characters(tiny, version, monkeypatch):
    model, tokenizer = tiny[version]
    text = f"\n{RARE}好{RARE}"
    ids = (tokenizer.encode_text("\n") + tokenizer.encode_text(text[1:]) if version == "chatglm3"
           else tokenizer.encode_text(text))
    ids += [tokenizer.get_command("<|user|>")]
    assert len(ids) > len(text) + 1  # the rare character takes several tokens

    def scripted_steps(model, input_ids, attention_mask=None, **kwargs):
        for token in ids:
            yield [0], [token]

    monkeypatch.setattr(chat_module, "generate_steps", scripted_steps)
    yields = list(model.stream_chat(tokenizer, "你好"))
    responses = [r for r, _ in yields]
    assert responses == [RARE, f"{RARE}好", f"{RARE}好{RARE}"]
    assert yields[-1][1][-1] == {"role": "assistant", "metadata": "", "content": f"{RARE}好{RARE}"}


def test_stream_chat_refuses_what_it_does_not_implement(tiny):
    model, tokenizer = tiny["chatglm3"]
    with pytest.raises(ValueError, match="past_key_values"):
        model.stream_chat(tokenizer, "你好", return_past_key_values=True)
    with pytest.raises(ValueError, match="logits_processor"):
        model.stream_chat(tokenizer, "你好", logits_processor=[])
    with pytest.raises(ValueError, match="no room left"):
        model.stream_chat(tokenizer, "你好" * 40, max_length=20)
