"""GLM-4.5 / 4.6 / 4.7 / GLM-4.7-Flash answers read back: the reasoning, the content and the XML tool calls, from a
whole answer or from its deltas as they are generated.

These models answer after one of four generation prompts: `<|assistant|>` (GLM-4.5's form, thinking on; the model
opens its think block itself with "\\n<think>"), `<|assistant|>\\n<think></think>` (GLM-4.5's form, thinking off),
`<|assistant|><think>` (GLM-4.7's form, thinking on: the answer starts inside the think block) and
`<|assistant|></think>` (GLM-4.7's form, thinking off). Decoded with its special tokens as their text, an answer is

    GLM-4.5:  \\n<think>reasoning</think>\\ncontent\\n<tool_call>get_weather\\n<arg_key>city</arg_key>\\n
              <arg_value>北京</arg_value>\\n</tool_call>\\n<tool_call>...</tool_call>
    GLM-4.7:  reasoning</think>content<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value>
              </tool_call><tool_call>...</tool_call>

(one line each; thinking off, no reasoning part), ending at a stop token that is not in the text. A call with no
arguments is `<tool_call>get_time</tool_call>` (GLM-4.7) or `\\n<tool_call>get_time\\n</tool_call>` (GLM-4.5). The
chat templates write a string argument as it is and any other value as JSON.

`split_reasoning` cuts the reasoning off an answer, `parse_calls` reads the calls out of the rest, `render_calls`
writes calls as the model writes them (for tests and data), and `OutputStream` does what the first two do on an
answer that arrives in pieces. What they do follows vLLM's `glm45` / `glm47` tool parsers and reasoning parsers, with
these facts and choices:

- Reasoning. The text before the first `</think>`, less leading whitespace and one leading `<think>`, stripped; None
  where that is empty (as vLLM's glm45 parser gives None for `<think></think>`). Where no `</think>` came and the
  prompt left the model thinking, the whole answer is reasoning still unfinished (an answer cut by max tokens):
  that is what vLLM's glm47 parser (DeepSeek-R1's rule) returns whole and streamed, and what its glm45 parser
  streams; its older glm45 parser returned such an answer whole as content, which a stream that has already sent
  the reasoning cannot take back. Thinking off, there is a think block only where the answer opens with
  `<think>` (after whitespace), as vLLM's glm45 parser switches on a `<think>` it sees; a `</think>` anywhere else
  is text of the content.
- Calls. A block runs from `<tool_call>` to the next `</tool_call>`. Its name is the text before the first "\\n" or
  `<arg_key>` (the whole block where neither comes), stripped; then `<arg_key>k</arg_key>`, whitespace,
  `<arg_value>v</arg_value>` pairs, the key stripped, a later key replacing an earlier one. A `<tool_call>` with no
  `</tool_call>` after it (an answer cut by max tokens) is not a call: it stays in the content, text and all. The
  content is the text outside the blocks, joined and stripped (what vLLM streams as content; its whole-answer
  content is the text before the first block).
- Typing, as vLLM's parsers do save one point. An argument whose schema type (the tool's
  `parameters.properties[key].type`) is "string" is the value exactly as written between the tags, whitespace
  kept. Any other value is stripped, then read as JSON; where that fails, an argument the schema declares is read
  as a Python literal (`True`, `None`, `{'a': 1}`), kept only where the result is JSON data (no tuples or sets);
  where that fails too, the stripped text is the value. An argument no schema declares (an unknown key, a tool no
  one declares, no tools given) is JSON or the stripped text: vLLM tries a Python literal there too. Schema types
  are compared exactly, so `["string", "null"]` is not "string". A tool is `{"type": "function", "function":
  {...}}` or bare `{"name", "parameters"}`; the first tool of a name counts.
- A value that holds `</arg_value>` or `</tool_call>` cannot be written in this format; `render_calls` does not
  escape it and such a call does not read back.
"""

from __future__ import annotations

import ast
import json
import re

from chatglm_tune.data.dialogues import ToolCall

THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE = "<think>", "</think>", "<tool_call>", "</tool_call>"
_ARG_KEY_OPEN = "<arg_key>"

_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_UNDECLARED = object()  # the schema of an argument no tool declares


# The reasoning

def _drop_think_open(text: str) -> str | None:
    """`text` less leading whitespace and its `<think>` where it opens with one, else None."""
    opened = text.lstrip()
    return opened[len(THINK_OPEN):] if opened.startswith(THINK_OPEN) else None


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning or None, the rest) of a generated answer. `thinking`: whether the prompt left the model thinking
    (GLM-4.7's ended with `<think>`, GLM-4.5's with `<|assistant|>`).

    Where `</think>` appears, the text before it (less leading whitespace and a leading `<think>`), stripped, is
    the reasoning and the text after it, less leading "\\n", the rest. Where it does not, a thinking answer is all
    reasoning (unfinished) and the rest is "" (vLLM's glm47 rule; see the module's docstring). Thinking off, an
    answer that does not open with `<think>` is all rest (the reasoning None), whatever `</think>` it holds."""
    inside = _drop_think_open(text)
    if inside is None and not thinking:
        return None, text
    before, closed, after = (text if inside is None else inside).partition(THINK_CLOSE)
    return before.strip() or None, after.lstrip("\n") if closed else ""


# The calls

def tool_function(tool: dict) -> dict:
    """An OpenAI tool's function (`{"type": "function", "function": {...}}`), or the tool itself in the bare form."""
    return tool["function"] if isinstance(tool.get("function"), dict) else tool


def _schemas(tools: list | None) -> dict[str, dict]:
    """Each declared tool's name -> its parameters' `properties` (the first tool of a name counts)."""
    out: dict[str, dict] = {}
    for tool in tools or ():
        function = tool_function(tool)
        parameters = function.get("parameters") or {}
        out.setdefault(function.get("name"), parameters.get("properties") or {})
    return out


def _is_json_data(value) -> bool:
    """Whether `value` is made of JSON's types only (dict with string keys, list, str, int, float, bool, None)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_data(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_is_json_data(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


def _python_literal(text: str):
    """`text` read as a Python literal that is JSON data, else `text`."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    return value if _is_json_data(value) else text


def _typed(value: str, schema) -> object:
    """An argument's value as written, typed by its property schema (`_UNDECLARED` where no tool declares it)."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return value
    value = value.strip()
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value if schema is _UNDECLARED else _python_literal(value)


def _read_call(block: str, schemas: dict[str, dict]) -> ToolCall:
    """The call a block's text (between `<tool_call>` and `</tool_call>`) writes."""
    ends = [i for i in (block.find("\n"), block.find(_ARG_KEY_OPEN)) if i >= 0]
    cut = min(ends) if ends else len(block)
    name = block[:cut].strip()
    properties = schemas.get(name, {})
    arguments = {}
    for key, value in _ARGUMENT.findall(block, cut):
        key = key.strip()
        arguments[key] = _typed(value, properties.get(key, _UNDECLARED))
    return ToolCall(name, arguments)


def parse_calls(text: str, tools: list | None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of the text after the reasoning: every `<tool_call>...</tool_call>` block read as a call
    (its arguments typed by `tools`' schemas), the content the text outside the blocks, joined and stripped. A
    block without its `</tool_call>` (an answer cut by max tokens) is left in the content, not read as a call."""
    schemas = _schemas(tools)
    outside, calls, at = [], [], 0
    while (start := text.find(CALL_OPEN, at)) >= 0:
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
        if end < 0:
            break
        outside.append(text[at:start])
        calls.append(_read_call(text[start + len(CALL_OPEN):end], schemas))
        at = end + len(CALL_CLOSE)
    outside.append(text[at:])
    return "".join(outside).strip(), calls


def _written(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _render_glm45(call: ToolCall) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_written(v)}</arg_value>\n"
                    for k, v in call.arguments.items())
    return f"\n{CALL_OPEN}{call.name}\n{pairs}{CALL_CLOSE}"


def _render_glm47(call: ToolCall) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key><arg_value>{_written(v)}</arg_value>" for k, v in call.arguments.items())
    return f"{CALL_OPEN}{call.name}{pairs}{CALL_CLOSE}"


_RENDERERS = {"glm45": _render_glm45, "glm47": _render_glm47}


def render_calls(calls, form: str) -> str:
    """`calls` (ToolCalls) written as the model writes them: form "glm45" (GLM-4.5 / 4.6, each call
    "\\n<tool_call>name\\n" then "<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n" per argument, then
    "</tool_call>") or "glm47" (GLM-4.7 / 4.7-Flash, the same with no newlines). A string value is written as it
    is, any other as `json.dumps(v, ensure_ascii=False)`. `parse_calls` reads the text back given tools whose
    schemas type the values."""
    if form not in _RENDERERS:
        raise ValueError(f"unknown call form {form!r}: expected one of {sorted(_RENDERERS)}")
    return "".join(_RENDERERS[form](call) for call in calls)


# The stream

def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (0 where none)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class _Stripped:
    """Text sent on in pieces so that the pieces join to the whole stripped: whitespace before the first other
    character is dropped, whitespace after the last is held until more text follows it (and dropped at the end)."""

    def __init__(self):
        self.started, self.held = False, ""

    def add(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        joined = self.held + text
        sent = joined.rstrip()
        self.held = joined[len(sent):]
        return sent


_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


class OutputStream:
    """Incremental reader of a streamed answer: `feed(delta)` and, at the end, `finish()` return events,
    ("reasoning", text), ("content", text) and ("call", ToolCall).

    Reasoning deltas come as they arrive until `</think>` (from the start where `thinking`, else only where the
    answer opens with `<think>`), content deltas after; each call comes whole when its `</tool_call>` arrives.
    Held back: a tail that could still begin the next tag (`<think>` at the start, `</think>`, `<tool_call>`), the
    text of a call block until it closes, and whitespace that the stripped reasoning or content may not end with
    (in GLM-4.5's form content is followed by "\\n<tool_call>"). No tag's text is sent, save that of a block left
    unclosed at the end, which `finish()` sends as content as `parse_calls` does. The reasoning events join to
    `split_reasoning`'s reasoning (or "" for None), the content events to `parse_calls`' content, and the calls are
    its calls. `calls` False: no call is read, the text after the reasoning is all content (`<tool_call>` blocks
    and all), its events joining to that text stripped."""

    def __init__(self, thinking: bool, tools: list | None, calls: bool = True):
        self._schemas = _schemas(tools)
        self._calls = calls
        self._mode = _REASONING if thinking else _OPENING
        self._opened = False  # in reasoning: whether a leading `<think>` has been looked for
        self._buffer = ""  # received, not yet sent on
        self._in_call = False  # the buffer starts with a `<tool_call>` not yet closed
        self._searched = 0  # in a call: how far the buffer has been searched for `</tool_call>`
        self._reasoning, self._content = _Stripped(), _Stripped()
        self._finished = False

    def feed(self, delta: str) -> list[tuple]:
        if self._finished:
            raise RuntimeError("OutputStream.feed after finish()")
        self._buffer += delta
        events: list[tuple] = []
        self._advance(events)
        return events

    def finish(self) -> list[tuple]:
        """The events for what is still held: an opening that never became `<think>` is content, a reasoning
        never closed stays reasoning, a call block never closed becomes content."""
        if self._finished:
            return []
        self._finished = True
        events: list[tuple] = []
        if self._mode == _OPENING:
            self._mode = _CONTENT
            self._advance(events)
        rest, self._buffer = self._buffer, ""
        self._send(events, self._mode, rest)
        return events

    def _advance(self, events: list) -> None:
        """Read the buffer as far as it can be read."""
        if self._mode == _OPENING:
            self._read_opening()
        if self._mode == _REASONING:
            self._read_reasoning(events)
        if self._mode == _CONTENT:
            self._read_content(events)

    def _send(self, events: list, kind: str, text: str) -> None:
        sent = (self._reasoning if kind == _REASONING else self._content).add(text)
        if sent:
            events.append((kind, sent))

    def _at_think_open(self) -> bool | None:
        """Whether the buffer opens with `<think>` (after whitespace); None while it cannot tell yet. Where it does,
        the whitespace and the tag leave the buffer."""
        opened = self._buffer.lstrip()
        if len(opened) < len(THINK_OPEN) and THINK_OPEN.startswith(opened):
            return None
        if opened.startswith(THINK_OPEN):
            self._buffer = opened[len(THINK_OPEN):]
            return True
        return False

    def _read_opening(self) -> None:
        """Thinking off: a think block only where the answer opens with `<think>`, else content from the start."""
        found = self._at_think_open()
        if found is not None:
            self._mode, self._opened = (_REASONING, True) if found else (_CONTENT, False)

    def _read_reasoning(self, events: list) -> None:
        if not self._opened:
            if self._at_think_open() is None:
                return
            self._opened = True
        reasoning, closed, after = self._buffer.partition(THINK_CLOSE)
        if closed:
            self._send(events, _REASONING, reasoning)
            self._buffer, self._mode = after, _CONTENT
            return
        keep = _partial_tag(reasoning, THINK_CLOSE)
        self._send(events, _REASONING, reasoning[:len(reasoning) - keep])
        self._buffer = reasoning[len(reasoning) - keep:]

    def _read_content(self, events: list) -> None:
        if not self._calls:
            self._send(events, _CONTENT, self._buffer)
            self._buffer = ""
            return
        while self._close_call(events) if self._in_call else self._open_call(events):
            pass

    def _open_call(self, events: list) -> bool:
        """Send the content before the next `<tool_call>` (all but a tail that could begin one where none came);
        whether a block opened."""
        start = self._buffer.find(CALL_OPEN)
        if start < 0:
            keep = _partial_tag(self._buffer, CALL_OPEN)
            self._send(events, _CONTENT, self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._send(events, _CONTENT, self._buffer[:start])
        self._buffer, self._in_call, self._searched = self._buffer[start:], True, len(CALL_OPEN)
        return True

    def _close_call(self, events: list) -> bool:
        """Read the call block at the buffer's start where its `</tool_call>` has come; whether it had."""
        end = self._buffer.find(CALL_CLOSE, self._searched)
        if end < 0:
            self._searched = max(len(CALL_OPEN), len(self._buffer) - len(CALL_CLOSE) + 1)
            return False
        events.append(("call", _read_call(self._buffer[len(CALL_OPEN):end], self._schemas)))
        self._buffer, self._in_call = self._buffer[end + len(CALL_CLOSE):], False
        return True
