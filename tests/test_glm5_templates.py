"""The GLM-5 releases' chat templates as data (`glm5_templates`), rendered by transformers' `apply_chat_template` on a
`PreTrainedTokenizerFast` of a tiny tokenizer.json (the releases' special tokens, nothing else) against GLM-4.7's
template (`moe_templates.GLM4_MOE_LITE_TEMPLATE`), on 50 generated conversations with tools, calls, tool results,
several user turns, reasoning on and off and clear_thinking either way (`test_agent_data.conversations`): each
difference the module docstring claims is there, and nothing else differs where it says the forms are the same."""

from __future__ import annotations

import json
import re

import pytest
from transformers import PreTrainedTokenizerFast

from chatglm_tune.models.glm.glm4_tokenizer import OFFICIAL_SPECIALS
from chatglm_tune.models.glm.glm5_templates import (GLM5_TEMPLATE, GLM51_TEMPLATE, GLM52_EFFORT, GLM52_TEMPLATE,
                                                    GLM53_FLASH_EFFORT, GLM53_FLASH_TEMPLATE)
from chatglm_tune.models.glm.moe_templates import GLM4_MOE_LITE_TEMPLATE, MOE_SPECIALS
from test_agent_data import TOOLS, conversations, flags, template_messages

GLM5_FORMS = {"glm5": GLM5_TEMPLATE, "glm5.1": GLM51_TEMPLATE, "glm5.2": GLM52_TEMPLATE,
              "glm5.3-flash": GLM53_FLASH_TEMPLATE}
UNWRAPPING = ("glm5.1", "glm5.2", "glm5.3-flash")  # the forms that write a tool as its function object
THINKING_FLAGS = ({}, {"enable_thinking": True}, {"enable_thinking": False})
ASKED_EFFORTS = (None, "low", "medium", "high", "max", "xhigh")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A fast tokenizer whose only tokens are the releases' special tokens (and an unknown token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = [*OFFICIAL_SPECIALS, *MOE_SPECIALS]
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, **{t: i + 1 for i, t in enumerate(specials)}}, "[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tiny") / "tokenizer.json"
    backend.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), additional_special_tokens=specials)


def render(tokenizer, template: str, messages: list[dict], tools: list | None = None, prompt: bool = False,
           **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                         add_generation_prompt=prompt, **kwargs)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return [(template_messages(json.loads(json.dumps(r))), r["tools"], flags(r)) for r in conversations("glm47")]


def unwrapped(tool: dict) -> dict:
    """The function object of an OpenAI-style tool, without the keys the GLM-5.1 form leaves out."""
    return {k: v for k, v in tool.get("function", tool).items() if k not in ("defer_loading", "strict")}


def glm47_with_bare_tools(text: str, tools: list[dict]) -> str:
    """GLM-4.7's render with each tool's JSON line (the whole OpenAI-style tool) as its bare function object."""
    for tool in tools:
        text = text.replace(json.dumps(tool, ensure_ascii=False), json.dumps(unwrapped(tool), ensure_ascii=False))
    return text


def reasoning_of(message: dict) -> str:
    """The reasoning of an assistant message: its `reasoning_content`, else what its content holds before `</think>`."""
    content = message.get("content") or ""
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"]
    return content.split("</think>")[0].split("<think>")[-1] if "</think>" in content else ""


def tools_lines(text: str) -> list[str]:
    return text.split("<tools>\n", 1)[1].split("</tools>", 1)[0].splitlines()


# ----- GLM-5: GLM-4.7's template -----

def test_glm5_renders_as_glm47(tokenizer, records):
    for messages, tools, flag in records:
        for prompt in (False, True):
            assert render(tokenizer, GLM5_TEMPLATE, messages, tools, prompt, **flag) == \
                render(tokenizer, GLM4_MOE_LITE_TEMPLATE, messages, tools, prompt, **flag)


# ----- the tools block: the function object itself -----

@pytest.mark.parametrize("form", UNWRAPPING)
def test_tools_line_is_the_bare_function_object(tokenizer, form):
    messages = [{"role": "user", "content": "q"}]
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, *TOOLS[1:]]
    written = tools_lines(render(tokenizer, GLM5_FORMS[form], messages, strict))
    assert [json.loads(line) for line in written] == [unwrapped(t) for t in strict]
    assert written == [json.dumps(unwrapped(t), ensure_ascii=False) for t in strict]
    assert tools_lines(render(tokenizer, GLM4_MOE_LITE_TEMPLATE, messages, strict)) == \
        [json.dumps(t, ensure_ascii=False) for t in strict]  # GLM-4.7 writes the whole wrapper
    bare = [t["function"] for t in strict]
    assert render(tokenizer, GLM5_FORMS[form], messages, bare) == render(tokenizer, GLM5_FORMS[form], messages, strict)


@pytest.mark.parametrize("form", UNWRAPPING)
def test_a_deferred_tool_is_left_out(tokenizer, form):
    deferred = [TOOLS[0], {**TOOLS[1], "function": {**TOOLS[1]["function"], "defer_loading": True}}, TOOLS[2]]
    written = tools_lines(render(tokenizer, GLM5_FORMS[form], [{"role": "user", "content": "q"}], deferred))
    assert [json.loads(line)["name"] for line in written] == [TOOLS[0]["function"]["name"],
                                                              TOOLS[2]["function"]["name"]]


@pytest.mark.parametrize("form", UNWRAPPING)
def test_a_tool_reference_result_writes_the_referenced_schema(tokenizer, form):
    name = TOOLS[1]["function"]["name"]
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "now", "arguments": {}}}]},
                {"role": "tool", "content": [{"type": "tool_reference", "name": name}]}]
    text = render(tokenizer, GLM5_FORMS[form], messages, TOOLS)
    schema = json.dumps(unwrapped(TOOLS[1]), ensure_ascii=False)
    assert text.endswith(f"<|observation|><tool_response><tools>\n{schema}\n</tools></tool_response>")


# ----- GLM-5.1: GLM-4.7's but for the tools -----

def test_glm51_is_glm47_but_for_the_tools(tokenizer, records):
    for messages, tools, flag in records:
        for prompt in (False, True):
            glm47 = render(tokenizer, GLM4_MOE_LITE_TEMPLATE, messages, tools, prompt, **flag)
            assert render(tokenizer, GLM51_TEMPLATE, messages, tools, prompt, **flag) == \
                glm47_with_bare_tools(glm47, tools)
            assert render(tokenizer, GLM51_TEMPLATE, messages, None, prompt, **flag) == \
                render(tokenizer, GLM4_MOE_LITE_TEMPLATE, messages, None, prompt, **flag)


@pytest.mark.parametrize("form", ["glm5", "glm5.1"])
def test_generation_prompt_and_switches_are_glm47s(tokenizer, form):
    user = {"role": "user", "content": "q"}
    for history in ([user], [{"role": "system", "content": "s"}, user,
                             {"role": "assistant", "content": "a", "reasoning_content": "r"}, user]):
        for flag in THINKING_FLAGS:
            assert render(tokenizer, GLM5_FORMS[form], history, None, True, **flag) == \
                render(tokenizer, GLM4_MOE_LITE_TEMPLATE, history, None, True, **flag)


# ----- GLM-5.2: GLM-5.1's, an effort line and <think></think> -----

def without_effort_line(text: str, line: str) -> str:
    assert text.startswith("[gMASK]<sop>" + line)
    return "[gMASK]<sop>" + text[len("[gMASK]<sop>" + line):]


def test_glm52_is_glm51_with_an_effort_line_and_its_empty_think(tokenizer, records):
    for messages, tools, flag in records:
        for prompt in (False, True):
            glm51 = render(tokenizer, GLM51_TEMPLATE, messages, tools, prompt, **flag)
            glm52 = render(tokenizer, GLM52_TEMPLATE, messages, tools, prompt, **flag)
            line = GLM52_EFFORT.line() if flag["enable_thinking"] else ""
            assert without_effort_line(glm52, line) == glm51.replace("<|assistant|></think>",
                                                                     "<|assistant|><think></think>")


def test_glm52_effort_line_names_the_effort_asked_or_max(tokenizer):
    messages = [{"role": "user", "content": "q"}]
    for asked in ASKED_EFFORTS:
        for flag in THINKING_FLAGS:
            kwargs = {**flag, **({"reasoning_effort": asked} if asked is not None else {})}
            text = render(tokenizer, GLM52_TEMPLATE, messages, TOOLS, True, **kwargs)
            thinking = flag.get("enable_thinking", True)
            line = GLM52_EFFORT.line(asked) if thinking else ""
            assert without_effort_line(text, line) == without_effort_line(
                render(tokenizer, GLM52_TEMPLATE, messages, TOOLS, True, **flag), GLM52_EFFORT.line() if thinking
                else "")
            assert ("Reasoning Effort: High" in text) == (thinking and asked == "high")
            assert text.endswith("<|assistant|><think>" if thinking else "<|assistant|><think></think>")
    assert GLM52_EFFORT.line() == GLM52_EFFORT.line("max") != GLM52_EFFORT.line("high")


def test_glm52_generation_prompt_thinking_is_glm47s(tokenizer):
    messages = [{"role": "user", "content": "q"}]
    for flag in ({}, {"enable_thinking": True}):
        assert render(tokenizer, GLM52_TEMPLATE, messages, None, True, **flag).rpartition("<|assistant|>")[2] == \
            render(tokenizer, GLM4_MOE_LITE_TEMPLATE, messages, None, True, **flag).rpartition("<|assistant|>")[2]


# ----- GLM-5.3-Flash: its own -----

def test_glm53_flash_effort_line_is_always_written(tokenizer):
    messages = [{"role": "user", "content": "q"}]
    for asked in ASKED_EFFORTS:
        for flag in THINKING_FLAGS:
            kwargs = {**flag, **({"reasoning_effort": asked} if asked is not None else {})}
            text = render(tokenizer, GLM53_FLASH_TEMPLATE, messages, None, True, **kwargs)
            assert text == "[gMASK]<sop>" + GLM53_FLASH_EFFORT.line(asked) + "<|user|>q<|assistant|><think>"
    assert len({GLM53_FLASH_EFFORT.line(e) for e in ASKED_EFFORTS}) == 3


def test_glm53_flash_keeps_earlier_reasoning_unless_cleared(tokenizer, records):
    earlier = 0
    for messages, tools, _ in records:
        kept = render(tokenizer, GLM53_FLASH_TEMPLATE, messages, tools)
        assert kept == render(tokenizer, GLM53_FLASH_TEMPLATE, messages, tools, clear_thinking=False)
        cleared = render(tokenizer, GLM53_FLASH_TEMPLATE, messages, tools, clear_thinking=True)
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        reasons = [reasoning_of(m) for m in messages[:last_user] if m["role"] == "assistant" and reasoning_of(m)]
        earlier += bool(reasons)
        for reasoning in reasons:
            assert f"<think>{reasoning}</think>" in kept
        assert (kept != cleared) == bool(reasons)
    assert earlier  # the conversations hold some


def test_glm53_flash_writes_reasoning_unstripped_and_tools_as_glm52(tokenizer, records):
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": " r\n"}]
    assert "<|assistant|><think> r\n</think>a" in render(tokenizer, GLM53_FLASH_TEMPLATE, turns)
    assert "<|assistant|><think>r</think>a" in render(tokenizer, GLM52_TEMPLATE, turns)
    for _, tools, _ in records[:3]:
        user = [{"role": "user", "content": "q"}]
        glm52 = render(tokenizer, GLM52_TEMPLATE, user, tools)
        assert render(tokenizer, GLM53_FLASH_TEMPLATE, user, tools) == glm52  # both: Max, then the tools block


def test_glm53_flash_orders_results_by_their_calls(tokenizer):
    calls = [{"id": i, "type": "function", "function": {"name": "now", "arguments": {}}} for i in ("a", "b")]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "B"},
                {"role": "tool", "tool_call_id": "a", "content": "A"}]
    text = render(tokenizer, GLM53_FLASH_TEMPLATE, messages, TOOLS)
    assert text.endswith("<|observation|><tool_response>A</tool_response><tool_response>B</tool_response>")
    as_given = [{k: v for k, v in m.items() if k != "tool_call_id"} for m in messages]
    assert render(tokenizer, GLM53_FLASH_TEMPLATE, as_given, TOOLS).endswith(
        "<|observation|><tool_response>B</tool_response><tool_response>A</tool_response>")
    assert render(tokenizer, GLM52_TEMPLATE, messages, TOOLS).endswith(
        "<|observation|><tool_response>B</tool_response><tool_response>A</tool_response>")


# ----- special tokens -----

TAG = re.compile(r"<\|[a-z_]+\|>|</?[a-z_]+>|\[gMASK\]|/nothink")


@pytest.mark.parametrize("form", sorted(GLM5_FORMS))
def test_no_special_token_beyond_glm45s(form):
    """Every tag a template writes is one of GLM-4.5's special tokens, or text GLM-4.7's writes as text too."""
    specials = {*OFFICIAL_SPECIALS, *MOE_SPECIALS}
    glm47_text_tags = set(TAG.findall(GLM4_MOE_LITE_TEMPLATE)) - specials
    assert set(TAG.findall(GLM5_FORMS[form])) - specials <= glm47_text_tags
