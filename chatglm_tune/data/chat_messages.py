"""OpenAI-style chat records: the conversations the agent GLMs (GLM-4.5 / 4.6 / 4.7, GLM-4.7-Flash) are tuned on,
with reasoning, tool calls and tool results, read into a `dialogues.Dialogue` of form "openai":

    {"tools": [{"type": "function", "function": {"name": ..., "description": ..., "parameters": {JSON schema}}}],
     "enable_thinking": true, "clear_thinking": false,                           both optional: the run's otherwise
     "messages": [{"role": "system", "content": ...},
                  {"role": "user", "content": ...},
                  {"role": "assistant", "content": ..., "reasoning_content": ...,
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": {"city": "北京"}}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "{\\"weather\\": \\"晴\\"}"},
                  {"role": "assistant", "content": ..., "loss": false}, ...]}

A call's `arguments` is an object, or its JSON text as OpenAI's API sends it; a bare `{"name", "parameters"}` tool
and a bare `{"name", "arguments"}` call are read too. An assistant's `content` may be null where it calls tools.
The releases' own forms are read as well: reasoning inside `<think>...</think>` at the start of an assistant's
content (split as the releases' chat templates split it), and calls written in content as the model writes them
(`<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`, `xml_calls.parse_calls`).

Refused, naming the field: a call of a tool the record does not declare; arguments whose values do not have the
types the tool's schema gives them, or that lack a required one, or hold one the schema closes out
(`additionalProperties: false`); a `tool` message with no call before it (or more results than calls, or a
`tool_call_id` no call of that turn has); reasoning given twice (`reasoning_content` and `<think>` in content) and
calls given twice; a `"loss"` on a turn that never carries one. Whether a version has reasoning or tools at all is
its prompt format's question (`PromptFormat.check_turn`).

The messages are kept as the chat template renders them (`Dialogue.messages`: arguments as objects, null content
as "", reasoning and calls written in content given apart, as the template writes them), and read into turns:
each assistant message one turn with its `reasoning` and `calls`, each tool message an observation turn.
"""

from __future__ import annotations

import json

from chatglm_tune.data.dialogues import (Dialogue, DialogueError, ToolCall, Turn, checked_dialogue, only_fields,
                                         string_field, turn_list, turn_loss, turn_object)
from chatglm_tune.data.xml_calls import CALL_OPEN, THINK_CLOSE, parse_calls, tool_function

ROLES = ("system", "user", "assistant", "tool")
RECORD_FIELDS = frozenset({"messages", "tools", "enable_thinking", "clear_thinking"})
# What makes a `messages` record OpenAI-style rather than GLM-4's fine-tuning form (which has `observation`
# messages, `metadata` calls and a system message's `tools`).
_MESSAGE_MARKS = frozenset({"tool_calls", "reasoning_content", "tool_call_id"})
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


def is_openai_record(raw: dict) -> bool:
    """Whether a `messages` record is OpenAI-style: a top-level `tools`, `enable_thinking` or `clear_thinking`, a
    `tool` message, or a message with `tool_calls`, `reasoning_content` or `tool_call_id`."""
    messages = raw.get("messages")
    marked = isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.keys() & _MESSAGE_MARKS) for m in messages)
    return marked or bool(raw.keys() & (RECORD_FIELDS - {"messages"}))


def from_openai(raw: dict) -> Dialogue:
    """The Dialogue of an OpenAI-style record (module docstring), or `DialogueError` naming the field."""
    tools = _tools(raw["tools"]) if "tools" in raw else None
    flags = {key: _flag(raw, key) for key in ("enable_thinking", "clear_thinking")}
    turns, rendered, pending = [], [], _Pending()
    for i, item in enumerate(turn_list(raw["messages"], "messages")):
        where = f"messages[{i}]"
        message = turn_object(item, where)
        role = string_field(message, "role", where)
        if role not in ROLES:
            raise DialogueError("bad_role", f"expected {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        if role == "assistant":
            turn, shown = _assistant(message, where, tools)
            if turn.reasoning is not None and flags["enable_thinking"] is False:
                raise DialogueError("reasoning_without_thinking", "the record sets enable_thinking false: its "
                                    "conversation is rendered with thinking off, where no turn reasons",
                                    f"{where}.reasoning_content")
            pending.called(message, turn)
        elif role == "tool":
            turn, shown = _tool(message, where, pending)
        else:
            only_fields(message, {"role", "content"}, where)
            turn = Turn(role, string_field(message, "content", where), where=where)
            shown = {"role": role, "content": turn.content}
            pending.clear()
        turns.append(turn)
        rendered.append(shown)
    return checked_dialogue(Dialogue(tuple(turns), "openai", messages=tuple(rendered),
                             tools=None if tools is None else tuple(tools), **flags))


def tool_names(tools) -> set[str]:
    """The names of OpenAI-style tools (`{"type": "function", "function": {...}}` or bare `{"name", ...}`)."""
    return {tool_function(tool).get("name") for tool in tools or ()}


def _tools(value: object) -> list:
    if not isinstance(value, list):
        raise DialogueError("not_list", f"expected a list of tools, got {type(value).__name__}", "tools")
    for i, tool in enumerate(value):
        function = tool_function(tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise DialogueError("bad_tool", "a tool is {\"type\": \"function\", \"function\": {\"name\": ..., "
                                "\"parameters\": {...}}} (or the function alone)", f"tools[{i}]")
        if not isinstance(function.get("parameters", {}), dict):
            raise DialogueError("bad_tool", "a tool's parameters are a JSON schema object",
                                f"tools[{i}].function.parameters")
    return value


def _flag(raw: dict, key: str) -> bool | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise DialogueError("bad_flag", f"expected true or false, got {value!r}", key)
    return value


def _assistant(message: dict, where: str, tools: list | None) -> tuple[Turn, dict]:
    """An assistant message: its turn (content without reasoning and XML calls) and the message as rendered."""
    only_fields(message, {"role", "content", "reasoning_content", "tool_calls", "loss"}, where)
    content = message.get("content")
    if content is None and "tool_calls" in message:
        content = ""
    elif not isinstance(content, str):
        content = string_field(message, "content", where)  # raises: missing, or not a string
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise DialogueError("not_string", f"expected a string, got {type(reasoning).__name__}",
                            f"{where}.reasoning_content")
    text = content
    if THINK_CLOSE in content:  # the release's own form: as the templates split it
        if reasoning is not None:
            raise DialogueError("reasoning_twice", "reasoning is given twice: in reasoning_content and inside "
                                "<think>...</think> in content", f"{where}.content")
        reasoning = content.split(THINK_CLOSE)[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        text = content.split(THINK_CLOSE)[-1].lstrip("\n")
    calls, shown_calls = _calls(message, where, tools)
    if CALL_OPEN in text:
        text, written = parse_calls(text, tools)
        if written and calls:
            raise DialogueError("calls_twice", "calls are given twice: in tool_calls and written in content",
                                f"{where}.content")
        calls = tuple(_checked_call(call, tools, f"{where}.content") for call in written) or calls
        shown_calls = shown_calls or [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                      for c in calls]
    # As rendered: reasoning and calls written in content given to the template apart (it splits `<think>` alike,
    # and writes the calls as it writes tool_calls), so their tags are the template's own special tokens.
    shown = {"role": "assistant", "content": text,
             **({"reasoning_content": reasoning} if reasoning is not None else {}),
             **({"tool_calls": shown_calls} if shown_calls else {})}
    field_of = f"{where}.reasoning_content" if reasoning else f"{where}.tool_calls" if calls else where
    turn = Turn("assistant", text, loss=turn_loss(message, "assistant", where), call=calls[0] if calls else None,
                where=field_of, reasoning=reasoning if reasoning else None, calls=calls)
    return turn, shown


def _calls(message: dict, where: str, tools: list | None) -> tuple[tuple[ToolCall, ...], list[dict]]:
    """(the calls of `tool_calls`, each checked against the tools; as the template reads them)."""
    value = message.get("tool_calls")
    if value is None:
        return (), []
    if not isinstance(value, list):
        raise DialogueError("not_list", f"expected a list of calls, got {type(value).__name__}", f"{where}.tool_calls")
    calls, shown = [], []
    for j, item in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(item, dict):
            raise DialogueError("not_object", f"expected a call object, got {type(item).__name__}", at)
        function = item.get("function", item)
        at = f"{at}.function" if "function" in item else at
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise DialogueError("bad_call", "a call is {\"type\": \"function\", \"function\": {\"name\": ..., "
                                "\"arguments\": {...}}}", at)
        arguments = _arguments(function.get("arguments"), f"{at}.arguments")
        calls.append(_checked_call(ToolCall(function["name"], arguments), tools, at))
        shown.append({"type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return tuple(calls), shown


def _arguments(value: object, where: str) -> dict:
    """A call's arguments: an object, or its JSON text (OpenAI's API sends text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise DialogueError("bad_arguments", f"the arguments' JSON text does not parse: {err}", where) from None
    if value is None:
        raise DialogueError("bad_arguments", "a call's arguments are an object ({} for none): the releases' "
                            "templates cannot write null arguments", where)
    if not isinstance(value, dict):
        raise DialogueError("bad_arguments", f"a call's arguments are a JSON object, got {type(value).__name__}", where)
    return value


def _checked_call(call: ToolCall, tools: list | None, where: str) -> ToolCall:
    """`call` where it names a declared tool and its arguments fit that tool's schema; else DialogueError."""
    named = [tool_function(tool) for tool in tools or () if tool_function(tool).get("name") == call.name]
    if not named:
        declared = f"declared: {sorted(tool_names(tools))}" if tools else "the record declares no tools"
        raise DialogueError("undeclared_tool", f"calls {call.name!r}, which is not a declared tool ({declared})",
                            f"{where}.name" if where.endswith("function") else where)
    schema = named[0].get("parameters") or {}
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    at = f"{where}.arguments" if where.endswith("function") else where
    for key in schema.get("required", ()) if isinstance(schema.get("required"), list) else ():
        if key not in call.arguments:
            raise DialogueError("bad_arguments", f"{call.name} requires argument {key!r}", at)
    for key, value in call.arguments.items():
        if key not in properties:
            if schema.get("additionalProperties") is False:
                raise DialogueError("bad_arguments", f"{call.name} takes no argument {key!r} (its parameters: "
                                    f"{', '.join(properties) or 'none'})", f"{at}.{key}")
            continue
        if not _fits(value, properties[key]):
            raise DialogueError("bad_arguments", f"{call.name}'s {key!r} is {properties[key].get('type')} in its "
                                f"schema, got {json.dumps(value, ensure_ascii=False)}", f"{at}.{key}")
    return call


def _fits(value: object, schema: object) -> bool:
    """Whether `value` has a type the property's schema `type` (a name or a list of them) allows; no `type`: any."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for kind in kinds:
        allowed = _JSON_TYPES.get(kind)
        if allowed is None:
            return True  # a type name JSON schema does not have: not this check's to refuse
        if isinstance(value, bool) and bool not in allowed:
            continue
        if isinstance(value, allowed):
            return True
    return False


def _tool(message: dict, where: str, pending: "_Pending") -> tuple[Turn, dict]:
    """A tool result: an observation turn after the call it answers."""
    only_fields(message, {"role", "content", "tool_call_id", "name"}, where)
    content = string_field(message, "content", where)
    pending.answer(message.get("tool_call_id"), where)
    return Turn("observation", content, where=f"{where}.role"), {"role": "tool", "content": content}


class _Pending:
    """The calls of the last assistant turn that tool messages may still answer."""

    def __init__(self):
        self.ids: list = []
        self.left = 0

    def called(self, message: dict, turn: Turn) -> None:
        calls = message.get("tool_calls") or ()
        self.ids = [call.get("id") for call in calls if isinstance(call, dict)]
        self.left = len(turn.calls)

    def clear(self) -> None:
        self.ids, self.left = [], 0

    def answer(self, call_id: object, where: str) -> None:
        if self.left == 0:
            raise DialogueError("tool_without_call", "a tool message answers a call: it follows an assistant message "
                                "with tool_calls (one result a call)", f"{where}.role")
        if call_id is not None and call_id not in self.ids:
            raise DialogueError("unknown_call_id", f"no call of the assistant message before has id {call_id!r} "
                                f"(its ids: {[i for i in self.ids if i is not None]})", f"{where}.tool_call_id")
        self.left -= 1
