"""GLM-4.5 / 4.7 answers read back (chatglm_tune/data/xml_calls.py): the reasoning split off, XML tool calls read and
typed by the tools' schemas, calls rendered in both forms and read back, and a streamed answer read to what the whole
answer reads to, over many seeded random splits."""

from __future__ import annotations

import random

import pytest

from chatglm_tune.data.dialogues import ToolCall
from chatglm_tune.data.xml_calls import (CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN, OutputStream, parse_calls,
                                         render_calls, split_reasoning)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"name": "set_options", "parameters": {"type": "object", "properties": {  # bare form
        "options": {"type": "object"}, "tags": {"type": "array"}, "ratio": {"type": "number"},
        "dry_run": {"type": "boolean"}, "note": {"type": "string"}, "limit": {"type": ["integer", "null"]},
        "code": {"type": "string"}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
WEATHER = ToolCall("get_weather", {"city": "北京"})
TIME = ToolCall("get_time", {"city": "东京"})
NO_ARGS = ToolCall("get_time", {})

GLM45_CALLS = ("\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n</tool_call>"
               "\n<tool_call>get_time\n<arg_key>city</arg_key>\n<arg_value>东京</arg_value>\n</tool_call>")
GLM47_CALLS = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value></tool_call>"
               "<tool_call>get_time<arg_key>city</arg_key><arg_value>东京</arg_value></tool_call>")
GLM45_ANSWER = "\n<think>用户想知道天气。</think>\n我来查一下。" + GLM45_CALLS
GLM47_ANSWER = "用户想知道天气。</think>我来查一下。" + GLM47_CALLS


def read(text: str, thinking: bool, tools=TOOLS):
    """What the whole answer reads to: (reasoning or None, content, calls)."""
    reasoning, rest = split_reasoning(text, thinking)
    return (reasoning, *parse_calls(rest, tools))


# The reasoning

@pytest.mark.parametrize("text, thinking, expected", [
    (GLM45_ANSWER, True, ("用户想知道天气。", "我来查一下。" + GLM45_CALLS)),
    (GLM47_ANSWER, True, ("用户想知道天气。", "我来查一下。" + GLM47_CALLS)),
    ("\n<think>\n  多行\n推理 \n</think>\n\n 回答", True, ("多行\n推理", " 回答")),  # only "\n"s go off the rest
    ("<think>again</think>answer", True, ("again", "answer")),  # GLM-4.7 writing the tag the prompt holds
    ("\n<think></think>\nanswer", True, (None, "answer")),  # an empty think block: no reasoning
    ("</think>answer", True, (None, "answer")),
    ("still thinking, cut by max tokens", True, ("still thinking, cut by max tokens", "")),
    ("\n<think>cut <tool_call>x", True, ("cut <tool_call>x", "")),
    ("", True, (None, "")),
    ("plain answer", False, (None, "plain answer")),
    ("\n\nplain answer\n", False, (None, "\n\nplain answer\n")),
    (" \n<think>opened anyway</think>\nanswer", False, ("opened anyway", "answer")),
    ("<think>opened, never closed", False, ("opened, never closed", "")),
    ("a stray </think> in content", False, (None, "a stray </think> in content")),
    ("<thi", False, (None, "<thi")),
])
def test_split_reasoning(text, thinking, expected):
    assert split_reasoning(text, thinking) == expected


# The calls

def test_glm45_form_several_calls():
    assert read(GLM45_ANSWER, True) == ("用户想知道天气。", "我来查一下。", [WEATHER, TIME])


def test_glm47_form_several_calls():
    assert read(GLM47_ANSWER, True) == ("用户想知道天气。", "我来查一下。", [WEATHER, TIME])


@pytest.mark.parametrize("text", ["<tool_call>get_time</tool_call>", "\n<tool_call>get_time\n</tool_call>",
                                  "<tool_call> get_time </tool_call>"])
def test_zero_argument_calls(text):
    assert parse_calls(text, TOOLS) == ("", [NO_ARGS])
    assert parse_calls(text, None) == ("", [NO_ARGS])


def test_calls_only_and_content_between_calls():
    assert parse_calls(GLM47_CALLS, TOOLS) == ("", [WEATHER, TIME])
    text = "before <tool_call>get_time</tool_call> between<tool_call>get_time</tool_call>\n after\n"
    assert parse_calls(text, TOOLS) == ("before  between\n after", [NO_ARGS, NO_ARGS])


def call_with(name: str, key: str, written: str, tools=TOOLS):
    content, calls = parse_calls(f"<tool_call>{name}<arg_key>{key}</arg_key><arg_value>{written}</arg_value>"
                                 "</tool_call>", tools)
    assert content == "" and len(calls) == 1 and calls[0].name == name
    return calls[0].arguments[key]


@pytest.mark.parametrize("key, written, value", [
    ("limit", "100", 100), ("ratio", "0.25", 0.25), ("ratio", "-3e2", -300.0), ("dry_run", "true", True),
    ("dry_run", "false", False), ("limit", "null", None), ("options", '{"a": 1, "b": [true, null]}',
                                                           {"a": 1, "b": [True, None]}),
    ("tags", '["x", "北京", 2]', ["x", "北京", 2]), ("options", "{}", {}),
    ("note", "100", "100"), ("note", "true", "true"), ("note", '{"a": 1}', '{"a": 1}'), ("note", "null", "null"),
    ("note", "  spaced\n", "  spaced\n"),  # a string is kept as written
    ("ratio", " 1.5\n", 1.5), ("options", "\n{\"a\": 1}\n", {"a": 1}),  # anything else is stripped first
    ("dry_run", "True", True), ("limit", "None", None), ("options", "{'a': (1)}", {"a": 1}),  # Python literals
    ("tags", "{1, 2}", "{1, 2}"), ("tags", "(1, 2)", "(1, 2)"),  # a literal that is no JSON data stays text
    ("limit", "many", "many"), ("limit", " many ", "many"),  # neither JSON nor a literal: the stripped text
])
def test_declared_arguments_are_typed_by_the_schema(key, written, value):
    got = call_with("set_options", key, written)
    assert got == value and type(got) is type(value)


def test_a_number_under_string_and_integer_schemas():
    assert call_with("get_weather", "city", "100") == "100"
    assert call_with("get_weather", "days", "100") == 100


@pytest.mark.parametrize("tools", [TOOLS, None, []])
def test_undeclared_arguments_are_json_or_the_stripped_text(tools):
    assert call_with("get_weather", "unknown", "42", tools) == 42
    assert call_with("get_weather", "unknown", '{"a": [1]}', tools) == {"a": [1]}
    assert call_with("get_weather", "unknown", " 北京 ", tools) == "北京"
    assert call_with("get_weather", "unknown", "True", tools) == "True"  # no Python literals where undeclared


def test_a_tool_no_one_declares_is_still_read():
    text = ("\n<tool_call>search_web\n<arg_key>query</arg_key>\n<arg_value>GLM 4.7</arg_value>\n"
            "<arg_key>top_k</arg_key>\n<arg_value>5</arg_value>\n<arg_key>exact</arg_key>\n"
            "<arg_value>false</arg_value>\n</tool_call>")
    assert parse_calls(text, TOOLS) == ("", [ToolCall("search_web", {"query": "GLM 4.7", "top_k": 5,
                                                                     "exact": False})])
    assert call_with("search_web", "query", "2025", TOOLS) == 2025  # untyped: a number that JSON reads


def test_without_tools_values_are_json_parsed():
    assert parse_calls(GLM45_CALLS, None) == ("", [WEATHER, TIME])
    assert call_with("get_weather", "city", "100", None) == 100


def test_whitespace_around_names_keys_and_between_tags():
    text = "<tool_call>  get_weather \n<arg_key> city </arg_key>\n\n  <arg_value> 北京</arg_value>\n</tool_call>"
    assert parse_calls(text, TOOLS) == ("", [ToolCall("get_weather", {"city": " 北京"})])


def test_a_later_key_replaces_an_earlier_one():
    text = "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value>"
    assert parse_calls(text + "</tool_call>", None) == ("", [ToolCall("f", {"a": 2})])


@pytest.mark.parametrize("cut", [
    "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北",
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value>",
    "<tool_call>get_weather",
    "<tool_call>",
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value></tool_",
])
def test_an_unfinished_block_at_the_end_stays_content(cut):
    text = "查一下。" + render_calls([WEATHER], "glm47") + cut
    assert parse_calls(text, TOOLS) == ("查一下。" + cut, [WEATHER])


def test_a_stray_close_tag_is_content():
    assert parse_calls("a </tool_call> b", TOOLS) == ("a </tool_call> b", [])


# Rendering

def test_render_glm45_form():
    calls = [ToolCall("get_weather", {"city": "北京", "days": 3}), NO_ARGS]
    assert render_calls(calls, "glm45") == ("\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京"
                                            "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
                                            "</tool_call>\n<tool_call>get_time\n</tool_call>")


def test_render_glm47_form():
    calls = [ToolCall("set_options", {"options": {"城市": "北京"}, "dry_run": True, "limit": None}), NO_ARGS]
    assert render_calls(calls, "glm47") == ('<tool_call>set_options<arg_key>options</arg_key><arg_value>{"城市": '
                                            '"北京"}</arg_value><arg_key>dry_run</arg_key><arg_value>true'
                                            '</arg_value><arg_key>limit</arg_key><arg_value>null</arg_value>'
                                            '</tool_call><tool_call>get_time</tool_call>')
    assert render_calls([WEATHER, TIME], "glm47") == GLM47_CALLS
    assert render_calls([WEATHER, TIME], "glm45") == GLM45_CALLS


def test_render_refuses_an_unknown_form():
    with pytest.raises(ValueError, match="glm46"):
        render_calls([NO_ARGS], "glm46")


ROUND_TRIP_CALLS = [
    WEATHER, NO_ARGS, ToolCall("get_weather", {"city": "100", "days": 7}),
    ToolCall("set_options", {"options": {"a": [1, 2.5, None], "b": {"c": "d"}}, "tags": [], "ratio": 0.1,
                             "dry_run": False, "note": " 多行\n文本 ", "limit": None,
                             "code": "def f():\n    return 1\n"}),
    ToolCall("set_options", {"note": "", "code": "true", "tags": ["<", ">"], "limit": 3}),
    ToolCall("unknown_tool", {"n": 1, "s": "text", "o": {"k": [True]}}),
]


@pytest.mark.parametrize("form", ["glm45", "glm47"])
def test_render_then_parse_round_trips(form):
    assert parse_calls(render_calls(ROUND_TRIP_CALLS, form), TOOLS) == ("", ROUND_TRIP_CALLS)
    answer = "正文\n" + render_calls(ROUND_TRIP_CALLS, form)
    assert parse_calls(answer, TOOLS) == ("正文", ROUND_TRIP_CALLS)


# The stream

def stream(text: str, thinking: bool, cuts, tools=TOOLS) -> list[tuple]:
    reader = OutputStream(thinking, tools)
    bounds = [0, *sorted(cuts), len(text)]
    events = [event for a, b in zip(bounds, bounds[1:]) for event in reader.feed(text[a:b])]
    return events + reader.finish()


def joined(events: list[tuple]):
    """(reasoning or None, content, calls) that the events join to; checks that no event is empty and that the
    reasoning comes first."""
    kinds = [kind for kind, _ in events]
    assert kinds == sorted(kinds, key=lambda kind: kind != "reasoning")
    assert all(value for _, value in events)
    reasoning = "".join(text for kind, text in events if kind == "reasoning")
    content = "".join(text for kind, text in events if kind == "content")
    return reasoning or None, content, [call for kind, call in events if kind == "call"]


def random_cuts(rng: random.Random, text: str) -> list[int]:
    if not text:
        return []
    return rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 12)))


WORDS = ["天气", "北京", "the", "call", "x", "1", " ", "  ", "\n", "\n\n", "。", "?", "a b"]


def random_text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(0, words)))


def random_call(rng: random.Random) -> ToolCall:
    return rng.choice([
        WEATHER, TIME, NO_ARGS, ToolCall("get_weather", {"city": random_text(rng, 3).strip() or "x",
                                                         "days": rng.randint(0, 9)}),
        ToolCall("set_options", {"note": random_text(rng, 4), "options": {"k": rng.random()}, "dry_run": True}),
        ToolCall("unknown", {"v": rng.choice([1, "s", None, [1, "2"]])}),
    ])


def random_answer(rng: random.Random) -> tuple[str, bool]:
    """A well-formed answer in either form, thinking or not, with 0-3 calls."""
    form, thinking = rng.choice(["glm45", "glm47"]), rng.random() < 0.6
    calls = render_calls([random_call(rng) for _ in range(rng.randint(0, 3))], form)
    content = random_text(rng, 6)
    if not thinking:
        return content + calls, False
    reasoning = random_text(rng, 8)
    opening = "\n<think>" if form == "glm45" else rng.choice(["", "", "<think>"])
    after = "\n" if form == "glm45" else ""
    return f"{opening}{reasoning}</think>{after}{content}{calls}", True


def answers(count: int, seed: int) -> list[tuple[str, bool]]:
    rng = random.Random(seed)
    fixed = [(GLM45_ANSWER, True), (GLM47_ANSWER, True), (GLM45_CALLS, False), (GLM47_CALLS, False),
             ("\n<think></think>\n" + GLM45_CALLS, True), ("</think>" + GLM47_CALLS, True), ("", True), ("", False),
             ("just content\n", False), ("  \n", False), (" \n<think> r </think>\n c ", False)]
    return fixed + [random_answer(rng) for _ in range(count)]


@pytest.mark.parametrize("text, thinking", answers(60, seed=1))
def test_stream_reads_what_the_whole_answer_reads(text, thinking):
    rng = random.Random(text)
    whole = read(text, thinking)
    for _ in range(25):
        assert joined(stream(text, thinking, random_cuts(rng, text))) == whole
    assert joined(stream(text, thinking, range(1, len(text)))) == whole  # a character at a time
    for end in range(len(text) + 1):  # every answer cut short (by max tokens), read in two pieces
        cut_text = text[:end]
        assert joined(stream(cut_text, thinking, random_cuts(rng, cut_text)[:1])) == read(cut_text, thinking)


TAG_SOUP = [THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
            "<", "</", "<t", "<tool_", "</th", ">", "f", "k", "1", "北", " ", "\n", "\n\n"]


@pytest.mark.parametrize("seed", range(8))
def test_stream_reads_what_the_whole_reads_on_any_text(seed):
    rng = random.Random(seed)
    for _ in range(150):
        text = "".join(rng.choice(TAG_SOUP) for _ in range(rng.randint(0, 30)))
        thinking = rng.random() < 0.5
        for tools in (TOOLS, None):
            assert joined(stream(text, thinking, random_cuts(rng, text), tools)) == read(text, thinking, tools)


@pytest.mark.parametrize("seed", range(2))
def test_a_stream_that_reads_no_calls_sends_the_text_after_the_reasoning(seed):
    """`calls` False (a served chat whose tool_choice is "none"): no call is read; the content events join to the
    text after the reasoning, stripped, its tags' text and all."""
    rng = random.Random(seed)
    for _ in range(150):
        text = "".join(rng.choice(TAG_SOUP) for _ in range(rng.randint(0, 30)))
        thinking = rng.random() < 0.5
        reader = OutputStream(thinking, TOOLS, calls=False)
        bounds = [0, *sorted(random_cuts(rng, text)), len(text)]
        events = [event for a, b in zip(bounds, bounds[1:]) for event in reader.feed(text[a:b])] + reader.finish()
        reasoning, rest = split_reasoning(text, thinking)
        assert joined(events) == (reasoning, rest.strip(), []), text


@pytest.mark.parametrize("text, thinking", answers(30, seed=2))
def test_stream_never_sends_the_text_of_a_tag(text, thinking):
    rng = random.Random(text)
    for _ in range(10):
        for kind, value in stream(text, thinking, random_cuts(rng, text)):
            if kind != "call":
                assert "<" not in value and ">" not in value, (kind, value)


def test_stream_events_as_they_come():
    reader = OutputStream(thinking=True, tools=TOOLS)
    assert reader.feed("\n<thi") == []
    assert reader.feed("nk>想一") == [("reasoning", "想一")]
    assert reader.feed("想 \n</th") == [("reasoning", "想")]  # the whitespace waits: the reasoning may end here
    assert reader.feed("ink>\n好") == [("content", "好")]
    assert reader.feed("的\n<tool") == [("content", "的")]
    assert reader.feed("_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n") == []
    assert reader.feed("</tool_call>\n<tool_call>get_time\n</tool_call>") == [("call", WEATHER), ("call", NO_ARGS)]
    assert reader.feed("\n后") == [("content", "\n\n\n后")]  # content goes on: the held whitespace comes with it
    assert reader.feed("<tool_call>get_time") == []
    assert reader.finish() == [("content", "<tool_call>get_time")]  # unclosed: content, as parse_calls reads it
    assert reader.finish() == []
    with pytest.raises(RuntimeError):
        reader.feed("more")


def test_stream_thinking_off():
    reader = OutputStream(thinking=False, tools=None)
    assert reader.feed("答") == [("content", "答")]
    assert reader.feed("案 </think> x<") == [("content", "案 </think> x")]
    assert reader.finish() == [("content", "<")]
    reader = OutputStream(thinking=False, tools=None)
    assert reader.feed("\n<think>") == []
    assert reader.feed("r</think>c") == [("reasoning", "r"), ("content", "c")]
