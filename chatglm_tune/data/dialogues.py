"""Conversations with a system prompt, tools, tool calls and observations, and a loss on each answer: the two
official fine-tuning data formats, read as the official code reads them.

ChatGLM3-6B (its fine-tuning demo's multi-turn data):

    {"tools": [{"name": ..., "description": ..., "parameters": {...}}, ...],          optional
     "conversations": [{"role": "system", "content": ...},                           optional, at most one, first
                       {"role": "user", "content": ...},
                       {"role": "assistant", "content": ..., "loss": false},       loss optional (default true)
                       {"role": "tool", "name": ..., "parameters": {...}, "observation": ...}, ...]}
                                                               (observation optional on the last turn)

  `tools` becomes the first system turn, `TOOL_PROMPT` + the list as JSON (4-space indent, non-ASCII kept). A
  `tool` turn is two: the assistant calling the tool (metadata: its name; content: `tool_call(k=v, ...)` in a
  Python code block, each value a Python literal) with the turn's loss, then an observation turn holding the
  result (a string as it is, anything else as JSON) with none.

GLM-4-9B (its fine-tuning script's data):

    {"messages": [{"role": "system", "content": ..., "tools": [{"type": "function", "function": {...}}, ...]},
                  {"role": "user", "content": ...},
                  {"role": "assistant", "metadata": "get_weather", "content": "{\\"city\\": \\"北京\\"}"},  a call
                  (or content "{\\"name\\": \\"get_weather\\", \\"arguments\\": {...}}", as its README writes one)
                  {"role": "observation", "content": ...},
                  {"role": "assistant", "content": ..., "loss": false}, ...]}

  Each message is rendered alone by the model's chat template (tools by the system message's). As the official
  script does, a tool parameter whose value is null is left out.

In both, system, user and observation turns carry no loss and every other turn carries one unless it says
`"loss": false`; a `"loss": true` on a turn that never carries one is refused rather than ignored. A call names
a declared tool; a GLM-4 call's content is its arguments as a JSON object; an observation follows a call. A
call's turn holds it as a `ToolCall` (name, arguments), what a tool-call exact match compares.
Turns become `Turn`s, the record a `Dialogue`; a record that breaks these rules raises `DialogueError` naming
the field, which `records.py` turns into a `RecordError` naming the file and line.
"""

from __future__ import annotations

import json
import keyword
from dataclasses import dataclass, field, replace

TOOL_PROMPT = "Answer the following questions as best as you can. You have access to the following tools:\n"
SILENT_ROLES = frozenset({"system", "user", "observation"})  # turns that never carry a loss


class DialogueError(ValueError):
    """A conversation record that breaks the format; `field` names where (`conversations[2].name`)."""

    def __init__(self, reason: str, message: str, field: str):
        super().__init__(message)
        self.reason, self.field = reason, field


@dataclass(frozen=True)
class ToolCall:
    """A call of a tool: its name and its arguments (a JSON object)."""

    name: str
    arguments: dict = field(hash=False)

    def to_json(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class Turn:
    """One block of the conversation as the model sees it."""

    role: str  # system, user, assistant, observation
    content: str
    metadata: str = ""  # an assistant turn that calls a tool in the model's own form: the tool's name
    loss: bool = False
    tools: tuple | None = None  # a GLM-4 system turn's tool list, rendered by the chat template
    call: ToolCall | None = None  # an assistant turn that calls a tool: which, with what (the first, of several)
    where: str = field(default="", compare=False)  # the record's field it was read from (`messages[0].tools`)
    reasoning: str | None = None  # an assistant turn's reasoning (an OpenAI-style record's `reasoning_content`)
    calls: tuple[ToolCall, ...] = ()  # every call of an assistant turn, in order (`call` is the first)

    @property
    def all_calls(self) -> tuple[ToolCall, ...]:
        """The turn's calls: `calls`, or the one `call` of the official forms."""
        return self.calls or ((self.call,) if self.call is not None else ())


@dataclass(frozen=True)
class Dialogue:
    """A whole conversation; `form`: "conversations" (ChatGLM3's data), "messages" (GLM-4's) or "openai"
    (OpenAI-style messages, `chat_messages.py`: then `messages` holds them as a chat template renders them, `tools`
    the record's tools, and `enable_thinking` / `clear_thinking` the record's own, None where it sets none)."""

    turns: tuple[Turn, ...]
    form: str
    messages: tuple = field(default=(), compare=False)
    tools: tuple | None = field(default=None, compare=False)
    enable_thinking: bool | None = None
    clear_thinking: bool | None = None

    @property
    def answer_at(self) -> int | None:
        """The index of the last assistant turn when the conversation ends with it (the gold answer), else None."""
        last = len(self.turns) - 1
        return last if self.turns and self.turns[last].role == "assistant" else None

    @property
    def context(self) -> tuple[Turn, ...]:
        """The turns before the gold answer (all of them where there is none): what a model answers."""
        return self.turns if self.answer_at is None else self.turns[: self.answer_at]

    @property
    def answer(self) -> Turn | None:
        return None if self.answer_at is None else self.turns[self.answer_at]

    @property
    def query(self) -> str:
        """The last user turn's text ("" where there is none)."""
        return next((t.content for t in reversed(self.context) if t.role == "user"), "")

    def texts(self) -> list[str]:
        """Every text the conversation shows a model: each turn's metadata and content, reasoning, calls (name and
        arguments as JSON) and tools (as JSON): what a tokenizer trained for it must hold."""
        out = [turn.metadata + turn.content for turn in self.turns]
        out += [json.dumps(list(turn.tools), ensure_ascii=False, indent=4) for turn in self.turns if turn.tools]
        out += [turn.reasoning for turn in self.turns if turn.reasoning]
        out += [call.name + json.dumps(call.arguments, ensure_ascii=False)
                for turn in self.turns for call in turn.calls]
        return out + ([json.dumps(list(self.tools), ensure_ascii=False)] if self.tools else [])

    def loss_on_last(self) -> "Dialogue":
        """The same turns with a loss on the gold answer only (earlier answers are context)."""
        return replace(self, turns=tuple(replace(t, loss=i == self.answer_at) for i, t in enumerate(self.turns)))


def tool_call_code(parameters: dict) -> str:
    """ChatGLM3's call as its model writes it: `tool_call(k=v, ...)` in a Python code block, values as literals;
    ValueError for a name that cannot be a keyword argument."""
    for key in parameters:
        if not (isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)):
            raise ValueError(f"ChatGLM3-6B writes a tool call's arguments as Python keyword arguments: {key!r} cannot "
                             "be one")
    return "```python\ntool_call(" + ", ".join(f"{k}={v!r}" for k, v in parameters.items()) + ")\n```"


# ----------------------------------------------------------------------------------------------
# ChatGLM3's conversations


def from_conversations(raw: dict) -> Dialogue:
    """A ChatGLM3 record: `conversations` (and optional `tools`)."""
    tools = raw.get("tools")
    names = _declared(tools, "tools", lambda tool: tool.get("name")) if tools is not None else None
    value = turn_list(raw["conversations"], "conversations")
    turns = [Turn("system", TOOL_PROMPT + json.dumps(tools, indent=4, ensure_ascii=False),
                  where="tools")] if tools is not None else []
    for i, item in enumerate(value):
        where = f"conversations[{i}]"
        turn = turn_object(item, where)
        role = string_field(turn, "role", where)
        if role == "tool":
            turns += _tool_turns(turn, where, names, last=i == len(value) - 1)
            continue
        only_fields(turn, {"role", "content", "loss"}, where)
        if role == "system" and i > 0:
            raise DialogueError("system_turn", "a system turn comes first, once (before any user turn)",
                                f"{where}.role")
        if role not in ("system", "user", "assistant"):
            raise DialogueError("bad_role", f"expected system, user, assistant or tool, got {role!r}", f"{where}.role")
        turns.append(Turn(role, string_field(turn, "content", where), loss=turn_loss(turn, role, where), where=where))
    return checked_dialogue(Dialogue(tuple(turns), "conversations"))


def _tool_turns(turn: dict, where: str, names: set | None, last: bool) -> list[Turn]:
    """A ChatGLM3 `tool` turn: the assistant's call, then the observation; the last turn may hold no observation:
    the call is then the gold answer (what a dev record asks the model to call)."""
    only_fields(turn, {"role", "name", "parameters", "observation", "loss"}, where)
    name = string_field(turn, "name", where)
    if names is None or name not in names:
        declared = "no tools are declared (a top-level tools list)" if names is None else f"declared: {sorted(names)}"
        raise DialogueError("undeclared_tool", f"calls {name!r}, which is not a declared tool ({declared})",
                            f"{where}.name")
    parameters = turn.get("parameters")
    if not isinstance(parameters, dict):
        raise DialogueError("bad_arguments", "expected the call's arguments as a JSON object", f"{where}.parameters")
    try:
        code = tool_call_code(parameters)
    except ValueError as err:
        raise DialogueError("bad_arguments", str(err), f"{where}.parameters") from None
    call = Turn("assistant", code, metadata=name, loss=turn_loss(turn, "assistant", where),
                call=ToolCall(name, parameters),
                where=f"{where}.name")
    if "observation" not in turn:
        if last:
            return [call]
        raise DialogueError("missing_field", "a tool turn before the last holds the tool's result",
                            f"{where}.observation")
    result = turn["observation"]
    result = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    return [call, Turn("observation", result, where=f"{where}.observation")]


# ----------------------------------------------------------------------------------------------
# GLM-4's messages


def from_messages(raw: dict) -> Dialogue:
    """A GLM-4 record: `messages`."""
    value = turn_list(raw["messages"], "messages")
    turns, names = [], set()
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        message = turn_object(item, where)
        role = string_field(message, "role", where)
        if role not in ("system", "user", "assistant", "observation"):
            raise DialogueError("bad_role", f"expected system, user, assistant or observation, got {role!r}",
                                f"{where}.role")
        only_fields(message, {"role", "content", "loss"} | ({"tools"} if role == "system" else set())
              | ({"metadata"} if role == "assistant" else set()), where)
        tools = None
        if "tools" in message:
            tools = tuple(_without_null_parameters(message["tools"], f"{where}.tools"))
            names |= _declared(list(tools), f"{where}.tools", lambda tool: _object_field(tool.get("function"), "name"))
        content = string_field(message, "content", where)
        metadata = string_field(message, "metadata", where) if "metadata" in message else ""
        call = _call(metadata, content, names, where) if role == "assistant" else None
        if role == "observation" and not (turns and turns[-1].call):
            raise DialogueError("observation_without_call", "an observation follows an assistant message that calls a "
                                "tool (its metadata names the tool, or its content is {\"name\", \"arguments\"})",
                                f"{where}.role")
        field_of = next((f"{where}.{key}" for key, used in (("tools", tools is not None), ("metadata", metadata),
                                                               ("role", role == "observation"), ("content", call))
                         if used), where)
        turns.append(Turn(role, content, metadata, turn_loss(message, role, where), tools, call, where=field_of))
    return checked_dialogue(Dialogue(tuple(turns), "messages"))


def json_call(text: str) -> ToolCall | None:
    """A call written as JSON `{"name": ..., "arguments": {...}}` (GLM-4's fine-tuning README's form), else None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(value, dict) and value.keys() == {"name", "arguments"} and isinstance(value["name"], str) \
            and isinstance(value["arguments"], dict):
        return ToolCall(value["name"], value["arguments"])
    return None


def _call(metadata: str, content: str, names: set, where: str) -> ToolCall | None:
    """The call of a GLM-4 assistant message: metadata naming the tool with the arguments as JSON content (the
    model's own form), or content `{"name", "arguments"}`; None for an answer in text."""
    if not metadata:
        call = json_call(content)
        if call is not None and call.name not in names:
            raise _undeclared(call.name, names, f"{where}.content")
        return call
    if metadata not in names:
        raise _undeclared(metadata, names, f"{where}.metadata")
    try:
        arguments = json.loads(content)
    except json.JSONDecodeError as err:
        raise DialogueError("bad_arguments", f"a call's content is its arguments as JSON: {err}",
                            f"{where}.content") from None
    if not isinstance(arguments, dict):
        raise DialogueError("bad_arguments", "a call's arguments are a JSON object", f"{where}.content")
    return ToolCall(metadata, arguments)


def _object_field(value: object, key: str) -> object:
    """`value[key]` where `value` is an object holding it, else None (a tool definition of any shape is read)."""
    return value.get(key) if isinstance(value, dict) else None


def _undeclared(name: str, names: set, where: str) -> DialogueError:
    declared = f"declared: {sorted(names)}"
    return DialogueError("undeclared_tool", f"calls {name!r}, which no system message declares ({declared})", where)


def _without_null_parameters(tools: object, where: str) -> list:
    """The tools with every parameter property whose value is null left out (as the official script does)."""
    if not isinstance(tools, list):
        raise DialogueError("not_list", "expected a list of tools", where)
    out = []
    for tool in tools:
        properties = _object_field(_object_field(_object_field(tool, "function"), "parameters"), "properties")
        if isinstance(properties, dict):
            function = tool["function"]
            parameters = {**function["parameters"],
                          "properties": {k: v for k, v in properties.items() if v is not None}}
            tool = {**tool, "function": {**function, "parameters": parameters}}
        out.append(tool)
    return out


# ----------------------------------------------------------------------------------------------
# what both read


def turn_list(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise DialogueError("not_list", f"expected a list of turns, got {type(value).__name__}", where)
    if not value:
        raise DialogueError("empty_text", "no turns", where)
    return value


def _declared(tools: object, where: str, name_of) -> set:
    if not isinstance(tools, list):
        raise DialogueError("not_list", f"expected a list of tool definitions, got {type(tools).__name__}", where)
    names = set()
    for i, tool in enumerate(tools):
        name = name_of(tool) if isinstance(tool, dict) else None
        if not isinstance(name, str) or not name:
            raise DialogueError("bad_tool", "a tool definition names its tool", f"{where}[{i}]")
        names.add(name)
    return names


def turn_loss(turn: dict, role: str, where: str) -> bool:
    loss = turn.get("loss", role not in SILENT_ROLES)
    if not isinstance(loss, bool):
        raise DialogueError("bad_loss", f"expected true or false, got {loss!r}", f"{where}.loss")
    if loss and role in SILENT_ROLES:
        raise DialogueError("bad_loss", f"a {role} turn is never trained on (only the model's own turns are)",
                            f"{where}.loss")
    return loss


def checked_dialogue(dialogue: Dialogue) -> Dialogue:
    if not any(t.role == "user" for t in dialogue.turns):
        raise DialogueError("empty_text", "a conversation holds a user turn", dialogue.form)
    return dialogue


def turn_object(item: object, where: str) -> dict:
    if not isinstance(item, dict):
        raise DialogueError("not_object", f"expected a turn object, got {type(item).__name__}", where)
    return item


def string_field(turn: dict, key: str, where: str) -> str:
    value = turn.get(key)
    if not isinstance(value, str):
        if key not in turn:
            raise DialogueError("missing_field", "missing: expected a string", f"{where}.{key}")
        raise DialogueError("not_string", f"expected a string, got {type(value).__name__}", f"{where}.{key}")
    return value


def only_fields(turn: dict, fields: set, where: str) -> None:
    stray = sorted(turn.keys() - fields)
    if stray:
        raise DialogueError("unread_field", f"not read: this turn holds {', '.join(sorted(fields))}",
                            f"{where}.{stray[0]}")
