"""Records: reading and validating SPO and prompt/response data files.

Reading. `read_records` reads a `.jsonl` or `.json` file in either layout, whatever its suffix: a JSON
array of objects when its first character other than blanks is `[`, else one object a line (JSON lines,
as AdvertiseGen's `train.json`; blank lines are ignored). Text is UTF-8 (a byte-order mark before the
first line is tolerated); a line, or an array item, holding bytes that are not UTF-8 is a bad record
(`not_utf8`). Each object has one of these shapes, and becomes an `SPORecord`:

    {"text": ..., "answer": "s_p_o\\ns_p_o"}              answer optional; "" means no triple
    {"text": ..., "spo_list": [{"subject", "predicate", "object"}, ...]}
    {"text": ..., "spo_list": [{"h": {"name"}, "t": {"name"}, "relation"}, ...]}
    {"instruction": ..., "input": ..., "output": ...}    text = instruction + "\\n" + input (either one
                                                         alone when the other is missing or blank);
                                                         output optional, in the answer format
    {"conversations": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
    {"tools": [...], "conversations": [... system, user, assistant, tool turns, "loss" flags ...]}  (ChatGLM3's)
    {"messages": [... system (+ tools), user, assistant (+ metadata: a call), observation ...]}     (GLM-4's)
    {"tools": [...], "messages": [... assistant (+ reasoning_content, tool_calls), tool ...]}      (OpenAI-style)

The field that selects a shape is `conversations`, else `messages`, else `spo_list`, else one of
`instruction`, `input`, `output`, else `text` or `answer`; a field of another shape beside it, a `system` or
`history` field, or an object with none of these fields is a bad record naming the accepted shapes: nothing
is dropped unread. The text shapes give triples, scored as triples. A conversation gives prompt/response
data, scored as free text, and keeps all its turns (`SPORecord.dialogue`, read by `dialogues.py`: system
prompts, tools, tool calls, observations, a loss flag a turn; OpenAI-style messages with reasoning and tool calls by
`chat_messages.py`). Plain user / assistant turns, alternating from
a user turn, are also read as before: the last user turn the query, the assistant turn after it (none: no
gold answer) the response, the pairs before them the history. The gold answers of one file are all triples
or all free text (`mixed_answers`).
Records of the last two shapes hold their own instruction (`SPORecord.instructed`): when every training
record does, train.py puts no `EncodingOptions.prompt` before them unless `--prompt` gives one.

With `DataColumns` (train.py/infer.py `--prompt-column`, ...), prompt/response objects instead: the
query, its earlier turns and a free-text answer (`parse_columns`).

A record that cannot be used raises `RecordError` naming the file, the line (JSON lines, 1-based) or the
array index (0-based) and the line it starts on, the field and what was expected; with
`on_bad_record="skip"` it is counted in a `BadRecordReport` instead (counts by reason, the first locations
of each). An array that is not valid JSON, and a UTF-16 file, raise either way.

Encoding records into ids and collating them into batches is `batches.py`'s job.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal

from chatglm_tune.data.chat_messages import RECORD_FIELDS, from_openai, is_openai_record
from chatglm_tune.data.dialogues import Dialogue, DialogueError, from_conversations, from_messages
from chatglm_tune.options import DataColumns


TRIPLE_SEP = "_"  # between subject, predicate and object in the answer format
LINE_SEP = "\n"  # between triples in the answer format


# ----------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Triple:
    """One fact `subject --predicate--> object`; written `subject_predicate_object`."""

    subject: str
    predicate: str
    object: str

    def to_text(self) -> str:
        return TRIPLE_SEP.join((self.subject, self.predicate, self.object))


@dataclass(frozen=True)
class SPORecord:
    """A text and its gold triples (`None` when the input has no gold answer, `()` for "no triple"), or,
    for prompt/response data (`DataColumns`), a free-text gold `response` and no triples.

    Gold triples keep their order and duplicates as written; metrics use set semantics.
    `source` says where the record came from (`file:line` or `file[index]`).
    """

    text: str
    triples: tuple[Triple, ...] | None
    source: str = ""
    response: str | None = None
    history: tuple[tuple[str, str], ...] | None = None  # earlier (query, response) turns of prompt/response data
    instructed: bool = False  # the text holds its own instruction (instruction/input/output data, conversations)
    dialogue: Dialogue | None = None  # a conversation record's turns (system, tools, calls, observations, losses)

    @property
    def answer(self) -> str | None:
        if self.response is not None:
            return self.response
        return None if self.triples is None else answer_text(self.triples)


def answer_text(triples: Iterable[Triple]) -> str:
    """The answer format: one `subject_predicate_object` a line, joined by newlines."""
    return LINE_SEP.join(t.to_text() for t in triples)


def answer_lines(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """How answer text is read, gold or generated: each non-blank line, stripped, with its 1-based number
    and its parts split on `_` (each stripped)."""
    for number, line in enumerate(text.split(LINE_SEP), start=1):
        line = line.strip()
        if line:
            yield number, line, [p.strip() for p in line.split(TRIPLE_SEP)]


# ----------------------------------------------------------------------------------------------
# Validation errors and the skip report

BadRecordMode = Literal["error", "skip"]


@dataclass(frozen=True)
class Location:
    """Where a record is: a 1-based line of a file of JSON lines, or the 0-based index of an item of a
    JSON array and the 1-based line the item starts on."""

    path: str
    line: int | None = None
    index: int | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}" if self.index is None else f"{self.path}[{self.index}]"

    def describe(self) -> str:
        if self.index is None:
            return f"{self.path}, line {self.line}"
        return f"{self.path}, array index {self.index}" + ("" if self.line is None else f" (line {self.line})")


class RecordError(ValueError):
    """A record that cannot be used: says where, which field, what is wrong. `reason` is a short key."""

    def __init__(self, location: Location, reason: str, message: str, field: str | None = None):
        self.location, self.reason, self.field, self.detail = location, reason, field, message
        where = location.describe() + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {message}")


@dataclass
class BadRecordReport:
    """What `read_records(..., on_bad_record="skip")` skipped: counts by reason, first examples of each."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    max_examples: int = 5

    def add(self, error: RecordError) -> None:
        self.counts[error.reason] += 1
        shown = self.examples.setdefault(error.reason, [])
        if len(shown) < self.max_examples:
            shown.append(str(error))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        return {"skipped": self.total, "by_reason": dict(self.counts), "examples": self.examples}

    def summary(self) -> str:
        """One line: `skipped N bad records (reason: n, ...)`, or `no bad records`."""
        if not self.total:
            return "no bad records"
        parts = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.counts.items()))
        return f"skipped {self.total} bad record(s) ({parts})"


# ----------------------------------------------------------------------------------------------
# Reading


def read_records(
    path: str | Path, *, on_bad_record: BadRecordMode = "error", columns: DataColumns = DataColumns()
) -> tuple[list[SPORecord], BadRecordReport]:
    """Read every record of a `.jsonl` or `.json` file, a JSON array or JSON lines whatever the suffix
    (layouts and shapes in the module docstring; with active `columns`, prompt/response objects:
    `parse_columns`).

    `on_bad_record="error"` raises the first `RecordError`; `"skip"` leaves bad records out and
    counts them in the returned report. An array that is not valid JSON, or a UTF-16 file, raises either way.
    """
    if on_bad_record not in ("error", "skip"):
        raise ValueError(f"on_bad_record must be 'error' or 'skip', got {on_bad_record!r}")
    records, report, first_answered = [], BadRecordReport(), None
    for location, raw in _raw_items(Path(path)):
        try:
            record = parse_columns(raw, location, columns) if columns.active else parse_record(raw, location)
            first_answered = _same_answer_kind(record, first_answered, location)
            records.append(record)
        except RecordError as err:
            if on_bad_record == "error":
                raise
            report.add(err)
    return records, report


def _same_answer_kind(record: SPORecord, first: SPORecord | None, location: Location) -> SPORecord | None:
    """The first record with a gold answer so far. `RecordError` when `record`'s gold answer is of the other
    kind (triples, or a free-text response): `metrics.score_answers` scores one file's answers one way."""
    if record.answer is None:
        return first
    if first is None or (record.response is None) == (first.response is None):
        return first or record
    kinds = {True: "triples", False: "a free-text response (conversations)"}
    raise RecordError(location, "mixed_answers", f"its gold answer is {kinds[record.response is None]}, that of "
                      f"{first.source} {kinds[first.response is None]}: one file holds one kind of answer")


_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_JSON_SPACE = " \t\r\n"
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # what the "surrogateescape" decoding makes of a byte that is not UTF-8


def _raw_items(path: Path) -> Iterator[tuple[Location, object]]:
    """(location, decoded JSON value) for each item of the file, a JSON array when its first character
    other than blanks is `[`, else JSON lines; an item that is not UTF-8 or not JSON gives `_Unreadable`."""
    if path.suffix not in (".json", ".jsonl"):
        raise ValueError(f"{path}: expected a .jsonl or .json file, got suffix {path.suffix!r}")
    yield from (_json_array_items if _first_byte(path) == b"[" else _jsonl_items)(path)


def _first_byte(path: Path) -> bytes:
    """The file's first byte other than JSON whitespace (b"" when none), after a UTF-8 byte-order mark.
    A UTF-16 byte-order mark raises `RecordError`."""
    with open(path, "rb") as f:
        chunk = f.read(4)
        if chunk.startswith(_UTF16_BOMS):
            raise RecordError(Location(str(path), line=1), "not_utf8", "the file is UTF-16 (it starts with a UTF-16 "
                              "byte-order mark): save it as UTF-8")
        chunk = chunk.removeprefix(_UTF8_BOM)
        while chunk:
            rest = chunk.lstrip(_JSON_SPACE.encode())
            if rest:
                return rest[:1]
            chunk = f.read(1 << 16)
    return b""


def _jsonl_items(path: Path) -> Iterator[tuple[Location, object]]:
    """One JSON value a line, each line decoded from UTF-8 on its own (a byte-order mark before line 1 is
    tolerated); blank lines are skipped."""
    with open(path, "rb") as f:
        for number, data in enumerate(f, start=1):
            location = Location(str(path), line=number)
            data = data.removeprefix(_UTF8_BOM) if number == 1 else data
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as err:
                yield location, _Unreadable("not_utf8", f"not UTF-8 (byte 0x{data[err.start]:02x} at byte "
                                                        f"{err.start + 1} of the line)")
                continue
            if line.strip():
                yield location, _json_line(line)


def _json_line(line: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        return _Unreadable("not_json", f"not valid JSON ({err.msg} at column {err.colno}); a file holds one JSON "
                                       "array, or one JSON object a line")


def _json_array_items(path: Path) -> Iterator[tuple[Location, object]]:
    """Each item of a file holding one JSON array, located by its index and the line it starts on. An item
    with bytes that are not UTF-8 gives `_Unreadable`; JSON that does not parse raises `RecordError`."""
    text = path.read_bytes().removeprefix(_UTF8_BOM).decode("utf-8", errors="surrogateescape")
    lines, decoder = _LineCounter(text), json.JSONDecoder()
    pos, index = _skip_space(text, text.index("[") + 1), 0
    closed = text.startswith("]", pos)
    while not closed:
        location = Location(str(path), line=lines.at(pos), index=index)
        item, end = _array_item(decoder, text, pos, location, lines)
        yield location, item
        pos, index = _skip_space(text, end), index + 1
        closed = text.startswith("]", pos)
        if not closed and not text.startswith(",", pos):
            raise RecordError(Location(str(path), line=lines.at(pos)), "not_json",
                              f"not valid JSON (expected ',' or ']' after array item {index - 1})")
        pos = pos if closed else _skip_space(text, pos + 1)
    if _skip_space(text, pos + 1) < len(text):
        raise RecordError(Location(str(path), line=lines.at(pos)), "not_json", "more content after the JSON array "
                          "that ends on this line: a file holds one JSON array, or one JSON object a line")


def _array_item(decoder: json.JSONDecoder, text: str, pos: int, location: Location,
                lines: "_LineCounter") -> tuple[object, int]:
    """The JSON value at `pos` (an `_Unreadable` when it holds bytes that are not UTF-8) and where it ends."""
    try:
        item, end = decoder.raw_decode(text, pos)
    except json.JSONDecodeError as err:
        raise RecordError(Location(location.path, line=err.lineno), "not_json",
                          f"not valid JSON ({err.msg} at column {err.colno})") from None
    bad = _NOT_UTF8.search(text, pos, end)
    if bad:
        item = _Unreadable("not_utf8",
                           f"not UTF-8 (byte 0x{ord(bad.group()) - 0xDC00:02x} on line {lines.at(bad.start())})")
    return item, end


def _skip_space(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace (`len(text)` when none)."""
    while pos < len(text) and text[pos] in _JSON_SPACE:
        pos += 1
    return pos


class _LineCounter:
    """The 1-based line of positions of a text, asked in increasing order (each newline is counted once)."""

    def __init__(self, text: str):
        self.text, self.pos, self.line = text, 0, 1

    def at(self, pos: int) -> int:
        self.line += self.text.count("\n", self.pos, pos)
        self.pos = pos
        return self.line


@dataclass(frozen=True)
class _Unreadable:
    """An item that did not decode (`reason` "not_utf8" or "not_json"); `_json_object` makes it a RecordError."""

    reason: str
    message: str


def _json_object(raw: object, location: Location) -> dict:
    """`raw` when it is a decoded JSON object; else the RecordError for an item that did not decode
    (`not_utf8`, `not_json`) or for another JSON value (`not_object`)."""
    if isinstance(raw, _Unreadable):
        raise RecordError(location, raw.reason, raw.message)
    if not isinstance(raw, dict):
        raise RecordError(location, "not_object", f"expected a JSON object, got {_type_name(raw)}")
    return raw


def parse_record(raw: object, location: Location) -> SPORecord:
    """One decoded JSON value in one of the shapes of the module docstring -> `SPORecord`, or
    `RecordError` saying what is wrong where."""
    raw = _json_object(raw, location)
    return _shape_of(raw, location).parse(raw, location)


def _text_answer(raw: dict, location: Location) -> SPORecord:
    answer = _string_field(raw, "answer", location, required=False)
    triples = None if answer is None else parse_answer(answer, location, "answer")
    return SPORecord(text=_text_field(raw, "text", location), triples=triples, source=str(location))


def _text_spo_list(raw: dict, location: Location) -> SPORecord:
    text = _text_field(raw, "text", location)
    return SPORecord(text=text, triples=_spo_list(raw["spo_list"], location), source=str(location))


def _instruction_input_output(raw: dict, location: Location) -> SPORecord:
    """The text is `instruction`, a newline and `input` (either alone when the other is missing or blank);
    `output`, optional, is the answer in the answer format."""
    parts = [_string_field(raw, key, location, required=False) for key in ("instruction", "input")]
    text = "\n".join(part for part in parts if part is not None and part.strip())
    if not text:
        raise RecordError(location, "empty_text", "the instruction and the input are both missing or blank",
                          field="instruction")
    output = _string_field(raw, "output", location, required=False)
    triples = None if output is None else parse_answer(output, location, "output")
    return SPORecord(text=text, triples=triples, source=str(location), instructed=True)


def _conversation(raw: dict, location: Location) -> SPORecord:
    """The last user turn is the query, the assistant turn after it (if any) the free-text response, the
    user/assistant pairs before it the history; the whole conversation is the record's `dialogue` too. One with
    tools, a system or tool turn or a loss flag is a dialogue only (`dialogues.from_conversations`)."""
    if not _plain_turns(raw):
        return _dialogue_record(raw, location, from_conversations)
    turns = _chat_turns(raw["conversations"], location)
    response = turns.pop()[1] if turns[-1][0] == "assistant" else None
    query = turns.pop()[1]
    if not query.strip():
        raise RecordError(location, "empty_text", "the last user turn is empty",
                          field=f"conversations[{len(turns)}].content")
    history = tuple((turns[i][1], turns[i + 1][1]) for i in range(0, len(turns), 2))
    return SPORecord(text=query, triples=None, source=str(location), response=response, history=history,
                     instructed=True, dialogue=from_conversations(raw))


def _plain_turns(raw: dict) -> bool:
    """Whether a conversations record holds user / assistant turns of a role and a content only, and no tools."""
    turns = raw["conversations"]
    return "tools" not in raw and isinstance(turns, list) and all(
        isinstance(t, dict) and t.keys() <= {"role", "content"} and t.get("role") in ("user", "assistant")
        for t in turns)


def _dialogue_record(raw: dict, location: Location, parse: Callable[[dict], Dialogue]) -> SPORecord:
    """A record of a conversation read by `parse` (`dialogues`); its errors named with the file and line. Its
    response is the gold answer as the model writes it (a call: the tool's name, a newline, the arguments)."""
    try:
        dialogue = parse(raw)
    except DialogueError as err:
        raise RecordError(location, err.reason, str(err), field=err.field) from None
    answer = dialogue.answer
    written = None if answer is None else f"{answer.metadata}\n{answer.content}" if answer.metadata else answer.content
    return SPORecord(text=dialogue.query, triples=None, source=str(location), instructed=True, dialogue=dialogue,
                     response=written)


def _messages(raw: dict, location: Location) -> SPORecord:
    """GLM-4's fine-tuning messages, or OpenAI-style ones (`chat_messages.is_openai_record`)."""
    return _dialogue_record(raw, location, from_openai if is_openai_record(raw) else from_messages)


def _chat_turns(value: object, location: Location) -> list[tuple[str, str]]:
    """(role, content) of each turn of a conversation: objects of a string `role` and `content` (no other
    field), alternating user, assistant from a user turn."""
    if not isinstance(value, list):
        raise RecordError(location, "not_list", f"expected a list of turns, got {_type_name(value)}",
                          field="conversations")
    if not value:
        raise RecordError(location, "empty_text", "no turns", field="conversations")
    turns = []
    for i, turn in enumerate(value):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(location, "not_object", f"expected a turn object, got {_type_name(turn)}", field=where)
        role, content = (_string_field(turn, key, location, prefix=where) for key in ("role", "content"))
        _check_role(role, "user" if i % 2 == 0 else "assistant", location, where)
        stray = sorted(turn.keys() - {"role", "content"})
        if stray:
            raise RecordError(location, "unread_field", "not read: a turn holds a role and a content only",
                              field=f"{where}.{stray[0]}")
        turns.append((role, content))
    return turns


def _check_role(role: str, expected: str, location: Location, where: str) -> None:
    if role == "system":
        raise RecordError(location, "system_turn", "a system turn cannot be kept: a record holds a query, its earlier "
                          "turns and a response, no system prompt (put its text in --prompt or in the first user turn)",
                          field=f"{where}.role")
    if role != expected:
        raise RecordError(location, "bad_role", f"expected {expected!r} (turns alternate user, assistant, from a user "
                          f"turn), got {role!r}", field=f"{where}.role")


@dataclass(frozen=True)
class _Shape:
    """A record shape: the fields that select it (the first shape of `_SHAPES` with one of them present),
    the fields it reads, and its parser."""

    name: str
    marks: frozenset[str]
    reads: frozenset[str]
    parse: Callable[[dict, Location], SPORecord]


_SHAPES = (
    _Shape("conversations", frozenset({"conversations"}), frozenset({"conversations", "tools"}), _conversation),
    _Shape("messages", frozenset({"messages"}), RECORD_FIELDS, _messages),
    _Shape("text + spo_list", frozenset({"spo_list"}), frozenset({"text", "spo_list"}), _text_spo_list),
    _Shape("instruction + input + output", frozenset({"instruction", "input", "output"}),
           frozenset({"instruction", "input", "output"}), _instruction_input_output),
    _Shape("text + answer", frozenset({"text", "answer"}), frozenset({"text", "answer"}), _text_answer),
)
_SHAPE_FIELDS = frozenset().union(*(shape.reads for shape in _SHAPES))
_UNREAD = {  # fields of data shapes users bring that no shape here reads: refused rather than dropped
    "system": "a record holds no system prompt (put it in --prompt, the instruction or the first user turn)",
    "history": "earlier turns are read from a conversations record, or with --prompt-column and --history-column",
}


def _shape_of(raw: dict, location: Location) -> _Shape:
    """The shape of a JSON object; `RecordError` when it has none, or a field that its shape does not read
    but another shape, or a known data shape, does."""
    shape = next((s for s in _SHAPES if s.marks & raw.keys()), None)
    if shape is None:
        found = ", ".join(map(repr, sorted(raw))) or "none"
        raise RecordError(location, "unknown_shape", f"matches none of the accepted shapes (fields: {found}): "
                          f"{'; '.join(s.name for s in _SHAPES)}; other prompt/response fields need --prompt-column "
                          "and --response-column")
    other = sorted((raw.keys() & _SHAPE_FIELDS) - shape.reads)
    if other:
        raise RecordError(location, "mixed_shape", f"not read by the {shape.name} shape of this record (it reads "
                          f"{', '.join(map(repr, sorted(shape.reads)))}): one shape a record", field=other[0])
    unread = sorted(raw.keys() & _UNREAD.keys())
    if unread:
        raise RecordError(location, "unread_field", f"not read: {_UNREAD[unread[0]]}", field=unread[0])
    return shape


def parse_columns(raw: object, location: Location, columns: DataColumns) -> SPORecord:
    """One prompt/response object -> a record of the query, its earlier turns (the history column) and
    the response column as its answer (absent: no gold answer); each version builds its prompt from them."""
    raw = _json_object(raw, location)
    query = _text_field(raw, columns.prompt, location)
    response = _string_field(raw, columns.response, location, required=False) if columns.response else None
    history = None
    if columns.history is not None:
        history = raw.get(columns.history) or []
        if not (isinstance(history, list)
                and all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in history)):
            raise RecordError(location, "bad_history", "expected a list of [query, response] string pairs",
                              field=columns.history)
    turns = None if history is None else tuple((q, r) for q, r in history)
    return SPORecord(text=query, triples=None, source=str(location), response=response, history=turns)


def parse_answer(answer: str, location: Location, field_name: str = "answer") -> tuple[Triple, ...]:
    """Gold answer text -> triples; blank lines are ignored, every other line must be `s_p_o`."""
    triples = []
    for number, line, parts in answer_lines(answer):
        where = f"{field_name} line {number}"
        if len(parts) != 3:
            raise RecordError(
                location, "bad_triple",
                f"{line!r} splits on '_' into {len(parts)} part(s), expected subject_predicate_object "
                "(subjects and objects cannot contain '_')",
                field=where,
            )
        triples.append(_checked_triple(*parts, location=location, where=where))
    return tuple(triples)


def _spo_list(spo_list: object, location: Location) -> tuple[Triple, ...]:
    if not isinstance(spo_list, list):
        raise RecordError(location, "not_list", f"expected a list of triples, got {_type_name(spo_list)}",
                          field="spo_list")
    triples = []
    for i, item in enumerate(spo_list):
        where = f"spo_list[{i}]"
        if not isinstance(item, dict):
            raise RecordError(location, "not_object", f"expected an object, got {_type_name(item)}", field=where)
        if "h" in item or "t" in item or "relation" in item:
            subject = _string_field(_name_holder(item, "h", location, where), "name", location, prefix=f"{where}.h")
            obj = _string_field(_name_holder(item, "t", location, where), "name", location, prefix=f"{where}.t")
            predicate = _string_field(item, "relation", location, prefix=where)
        else:
            subject = _string_field(item, "subject", location, prefix=where)
            predicate = _string_field(item, "predicate", location, prefix=where)
            obj = _string_field(item, "object", location, prefix=where)
        triples.append(_checked_triple(subject.strip(), predicate.strip(), obj.strip(), location=location, where=where))
    return tuple(triples)


def _name_holder(item: dict, key: str, location: Location, where: str) -> dict:
    if key not in item:
        raise RecordError(location, "missing_field", "missing (expected an object with a 'name')",
                          field=f"{where}.{key}")
    value = item[key]
    if not isinstance(value, dict):
        raise RecordError(location, "not_object", f"expected an object with a 'name', got {_type_name(value)}",
                          field=f"{where}.{key}")
    return value


def _checked_triple(subject: str, predicate: str, obj: str, *, location: Location, where: str) -> Triple:
    """A Triple whose parts are non-empty, one line each, and free of '_' (the answer format's separator)."""
    for role, value in (("subject", subject), ("predicate", predicate), ("object", obj)):
        if not value:
            raise RecordError(location, "empty_triple_part", f"the {role} is empty", field=where)
        if TRIPLE_SEP in value:
            raise RecordError(
                location, "underscore_in_name",
                f"the {role} {value!r} contains '_', which the answer format subject_predicate_object cannot represent",
                field=where,
            )
        if LINE_SEP in value:
            raise RecordError(location, "newline_in_name", f"the {role} {value!r} contains a newline", field=where)
    return Triple(subject, predicate, obj)


def _string_field(raw: dict, key: str, location: Location, *, required: bool = True, prefix: str = "") -> str | None:
    name = f"{prefix}.{key}" if prefix else key
    if key not in raw:
        if required:
            raise RecordError(location, "missing_field", "missing (expected a string)", field=name)
        return None
    value = raw[key]
    if not isinstance(value, str):
        raise RecordError(location, "not_string", f"expected a string, got {_type_name(value)}", field=name)
    return value


def _text_field(raw: dict, key: str, location: Location) -> str:
    text = _string_field(raw, key, location)
    if not text.strip():
        raise RecordError(location, "empty_text", "the text is empty", field=key)
    return text


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__
