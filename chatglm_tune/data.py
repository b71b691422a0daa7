"""Records: read and validate them, encode them as each version's official fine-tuning does, collate batches.

Reading. `read_records` accepts a `.jsonl` file (one object a line; blank lines are ignored) or a
`.json` file holding an array of objects, each in one of four shapes, and turns every one into an
`SPORecord`:

    {"text": ..., "answer": "s_p_o\\ns_p_o"}              answer optional; "" means no triple
    {"instruction": ..., "input": ..., "output": ...}    text = input, output in the answer format;
                                                         the instruction is validated but not kept:
                                                         the prompt is `EncodingOptions.prompt`
    {"text": ..., "spo_list": [{"subject", "predicate", "object"}, ...]}
    {"text": ..., "spo_list": [{"h": {"name"}, "t": {"name"}, "relation"}, ...]}

With `DataColumns` (train.py/infer.py `--prompt-column`, ...), prompt/response objects instead: the
query, its earlier turns and a free-text answer (`parse_columns`).

A record that cannot be used raises `RecordError` naming the file, the line (jsonl, 1-based) or the
array index (json, 0-based), the field and what was expected; with `on_bad_record="skip"` it is
counted in a `BadRecordReport` instead (counts by reason, the first locations of each).

Encoding: the tokenizer's version (`versions`) builds the prompt and the training row as its official
fine-tuning does. ChatGLM-6B (spec section 8, `ptuning/main.py` preprocess_function, with
max_target_length = max_len - max_src_len):

    source = encode(prompt + text)[: max_src_len - 1]        # room for [gMASK]
    answer = encode(answer_text)[: max_len - max_src_len - 2]   # room for <sop> and <eop>
    input_ids = source + [gMASK, <sop>] + answer + [<eop>]     # len <= max_len
    labels    = [-100] * len(source + [gMASK]) + input_ids[len(source) + 1:]

So the context ([gMASK] included) holds at most `max_src_len` tokens and `<sop> answer <eop>` at
most `max_len - max_src_len`; the `[gMASK]` position is trained to predict `<sop>`. Special ids come
from the tokenizer or the model config (`SpecialIds.of`), never from constants here.

Collating. `collate_train` right-pads a batch to its longest row; `collate_prompts` left-pads
inference prompts. Both return the 2D `attention_mask` (1 = token, 0 = pad) and, for ChatGLM-6B, the
official 2D `position_ids` [b, 2, s] from `chatglm_tune.positions`, built for the whole batch at once
(the other versions' models derive positions from the mask).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Literal, Sequence

import torch

from . import versions
from .options import DataColumns, EncodingOptions
from .positions import build_position_ids

IGNORE_INDEX = -100  # label of positions that carry no loss (torch CrossEntropyLoss default)
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
    """Where a record is: a 1-based line of a jsonl file, or a 0-based index of a json array."""

    path: str
    line: int | None = None
    index: int | None = None

    def __str__(self) -> str:
        return self._spelled("{path}[{index}]", "{path}:{line}")

    def describe(self) -> str:
        return self._spelled("{path}, array index {index}", "{path}, line {line}")

    def _spelled(self, in_array: str, in_lines: str) -> str:
        """The format `in_array` (a json array's index) or `in_lines` (a jsonl line), whichever this is."""
        return (in_array if self.index is not None else in_lines).format(path=self.path, index=self.index, line=self.line)


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
    """Read every record of a `.jsonl` or `.json` file (shapes in the module docstring; with active
    `columns`, prompt/response objects: `parse_columns`).

    `on_bad_record="error"` raises the first `RecordError`; `"skip"` leaves bad records out and
    counts them in the returned report. A `.json` file that is not a JSON array raises either way.
    """
    if on_bad_record not in ("error", "skip"):
        raise ValueError(f"on_bad_record must be 'error' or 'skip', got {on_bad_record!r}")
    records, report = [], BadRecordReport()
    for location, raw in _raw_items(Path(path)):
        try:
            records.append(parse_columns(raw, location, columns) if columns.active else parse_record(raw, location))
        except RecordError as err:
            if on_bad_record == "error":
                raise
            report.add(err)
    return records, report


def _raw_items(path: Path) -> Iterator[tuple[Location, object]]:
    """(location, decoded JSON value) for each item of the file; a jsonl line that is not JSON gives `_NotJSON`."""
    if path.suffix == ".json":
        yield from _json_array_items(path)
    elif path.suffix == ".jsonl":
        yield from _jsonl_items(path)
    else:
        raise ValueError(f"{path}: expected a .jsonl or .json file, got suffix {path.suffix!r}")


def _jsonl_items(path: Path) -> Iterator[tuple[Location, object]]:
    with open(path, encoding="utf-8-sig") as f:  # a BOM is tolerated
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            location = Location(str(path), line=number)
            try:
                yield location, json.loads(line)
            except json.JSONDecodeError as err:
                yield location, _NotJSON(f"not valid JSON ({err.msg} at column {err.colno})")


def _json_array_items(path: Path) -> Iterator[tuple[Location, object]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as err:
        raise RecordError(Location(str(path), line=err.lineno), "not_json", f"not valid JSON ({err.msg})") from None
    if not isinstance(data, list):
        raise RecordError(
            Location(str(path), line=1), "not_array",
            f"a .json file must hold an array of records, got {type(data).__name__} (use .jsonl for one object a line)",
        )
    for index, item in enumerate(data):
        yield Location(str(path), index=index), item


@dataclass(frozen=True)
class _NotJSON:
    """A jsonl line that did not decode; parse_record turns it into a RecordError."""

    message: str


def _json_object(raw: object, location: Location) -> dict:
    """`raw` when it is a decoded JSON object; else the RecordError for a line that did not decode
    (`not_json`) or for another JSON value (`not_object`)."""
    if isinstance(raw, _NotJSON):
        raise RecordError(location, "not_json", raw.message)
    if not isinstance(raw, dict):
        raise RecordError(location, "not_object", f"expected a JSON object, got {_type_name(raw)}")
    return raw


def parse_record(raw: object, location: Location) -> SPORecord:
    """One decoded JSON value -> `SPORecord`, or `RecordError` saying what is wrong where."""
    raw = _json_object(raw, location)
    if "spo_list" in raw:
        text = _text_field(raw, "text", location)
        triples = _spo_list(raw["spo_list"], location)
    elif "input" in raw or "instruction" in raw or "output" in raw:
        _string_field(raw, "instruction", location, required=False)
        text = _text_field(raw, "input", location)
        answer = _string_field(raw, "output", location, required=False)
        triples = None if answer is None else parse_answer(answer, location, "output")
    else:
        text = _text_field(raw, "text", location)
        answer = _string_field(raw, "answer", location, required=False)
        triples = None if answer is None else parse_answer(answer, location, "answer")
    return SPORecord(text=text, triples=triples, source=str(location))


def parse_columns(raw: object, location: Location, columns: DataColumns) -> SPORecord:
    """One prompt/response object -> a record of the query, its earlier turns (the history column) and
    the response column as its answer (absent: no gold answer); each version builds its prompt from them."""
    raw = _json_object(raw, location)
    query = _text_field(raw, columns.prompt, location)
    response = _string_field(raw, columns.response, location, required=False) if columns.response else None
    history = None
    if columns.history is not None:
        history = raw.get(columns.history) or []
        if not (isinstance(history, list) and all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t)
                                                  for t in history)):
            raise RecordError(location, "bad_history", "expected a list of [query, response] string pairs",
                              field=columns.history)
    turns = None if history is None else tuple((q, r) for q, r in history)
    return SPORecord(text=query, triples=None, source=str(location), response=response, history=turns)


def chat_prompt(query: str, history: Sequence[tuple[str, str]] | None) -> str:
    """ChatGLM-6B's multi-turn prompt: the query alone when `history` is None, else `[Round i]\n问：q\n答：r\n`
    for each earlier turn, then `[Round n]\n问：{query}\n答：`. The official `ptuning/main.py` builds the
    rounds whenever there is a history column (even an empty one); the official `chat()` only for a
    non-empty history (spec section 7)."""
    if history is None:
        return query
    rounds = "".join(f"[Round {i}]\n问：{q}\n答：{r}\n" for i, (q, r) in enumerate(history))
    return rounds + f"[Round {len(history)}]\n问：{query}\n答："


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
        raise RecordError(location, "not_list", f"expected a list of triples, got {_type_name(spo_list)}", field="spo_list")
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
        raise RecordError(location, "missing_field", "missing (expected an object with a 'name')", field=f"{where}.{key}")
    value = item[key]
    if not isinstance(value, dict):
        raise RecordError(location, "not_object", f"expected an object with a 'name', got {_type_name(value)}", field=f"{where}.{key}")
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


# ----------------------------------------------------------------------------------------------
# Encoding


@dataclass(frozen=True)
class SpecialIds:
    """The special token ids the collators need, read from a tokenizer or a model config. The GLM ids
    (`gmask`, `<sop>`, `[MASK]`) are ChatGLM-6B's, from which its 2D positions are built; they are None
    for ChatGLM2/3 and GLM-4, whose models derive positions from the attention mask."""

    pad_token_id: int
    eos_token_id: int | list[int] | None = None
    gmask_token_id: int | None = None
    bos_token_id: int | None = None  # <sop>
    mask_token_id: int | None = None

    @classmethod
    def of(cls, source) -> "SpecialIds":
        """The ids of a tokenizer or a model config (both name them alike)."""
        return cls(**{name: getattr(source, name, None) for name in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class EncodedExample:
    """One training row: `input_ids` and `labels` of equal length (<= max_len), and truncation flags."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    source_truncated: bool
    answer_truncated: bool
    source: str = ""


def prompt_ids(record: SPORecord, tokenizer, options: EncodingOptions = EncodingOptions()) -> list[int]:
    """Inference input of a record: its prompt in the format of the tokenizer's version (`versions`)."""
    return versions.of_tokenizer(tokenizer).prompt_ids(tokenizer, record, options)[0]


def encode_record(record: SPORecord, tokenizer, options: EncodingOptions = EncodingOptions()) -> EncodedExample:
    """Training row of a record with a gold answer, as the version's official fine-tuning builds it."""
    return versions.of_tokenizer(tokenizer).training_row(tokenizer, record, options)


def training_example(prompt: list[int], answer: list[int], labelled_prompt_tokens: int, *, prompt_truncated: bool = False,
                     answer_truncated: bool = False, origin: str = "") -> EncodedExample:
    """The row `prompt + answer` of already truncated ids, labelled on the answer and on the last
    `labelled_prompt_tokens` of the prompt (ChatGLM-6B: `<sop>`, which `[gMASK]` is trained to predict)."""
    input_ids = prompt + answer
    context = len(prompt) - labelled_prompt_tokens
    labels = [IGNORE_INDEX] * context + input_ids[context:]
    return EncodedExample(tuple(input_ids), tuple(labels), prompt_truncated, answer_truncated, origin)


class EncodedDataset(torch.utils.data.Dataset):
    """Encoded training rows of a list of records; counts the truncations for the run's report."""

    def __init__(self, examples: Sequence[EncodedExample]):
        self.examples = list(examples)

    @classmethod
    def from_records(
        cls, records: Iterable[SPORecord], tokenizer, options: EncodingOptions = EncodingOptions()
    ) -> "EncodedDataset":
        return cls([encode_record(r, tokenizer, options) for r in records])

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> EncodedExample:
        return self.examples[i]

    def truncation_counts(self) -> dict[str, int]:
        """`{"examples", "source_truncated", "answer_truncated"}` counts."""
        return {
            "examples": len(self.examples),
            "source_truncated": sum(e.source_truncated for e in self.examples),
            "answer_truncated": sum(e.answer_truncated for e in self.examples),
        }


# ----------------------------------------------------------------------------------------------
# Collating


def collate_train(batch: Sequence[EncodedExample], special: SpecialIds) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row. Returns `input_ids`, `labels` (pads -100), `attention_mask` [b, s]
    (1 = token) and `position_ids` [b, 2, s]; pad positions are 0."""
    lengths = torch.tensor([len(e.input_ids) for e in batch])
    input_ids = _pad_rows([e.input_ids for e in batch], special.pad_token_id, lengths, left=False)
    labels = _pad_rows([e.labels for e in batch], IGNORE_INDEX, lengths, left=False)
    attention_mask = _token_mask(lengths, input_ids.shape[1], left=False)
    return _with_positions({"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}, special)


def collate_prompts(prompts: Sequence[Sequence[int]], special: SpecialIds) -> dict[str, torch.Tensor]:
    """Left-pad inference prompts (each ending `[gMASK] <sop>`) to the longest. Returns `input_ids`,
    `attention_mask` [b, s] (1 = token, 0 = left pad) and `position_ids` [b, 2, s], each row's
    positions equal to those of the prompt alone."""
    lengths = torch.tensor([len(p) for p in prompts])
    input_ids = _pad_rows(prompts, special.pad_token_id, lengths, left=True)
    attention_mask = _token_mask(lengths, input_ids.shape[1], left=True)
    return _with_positions({"input_ids": input_ids, "attention_mask": attention_mask}, special)


def _pad_rows(rows: Sequence[Sequence[int]], value: int, lengths: torch.Tensor, *, left: bool) -> torch.Tensor:
    """[b, max(lengths)] long tensor of the rows, padded with `value` on the left or the right."""
    if len(rows) == 0:
        raise ValueError("cannot collate an empty batch")
    out = torch.full((len(rows), int(lengths.max())), value, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row)
        if n:
            target = out[i, out.shape[1] - n :] if left else out[i, :n]
            target.copy_(torch.as_tensor(row, dtype=torch.long))
    return out


def _token_mask(lengths: torch.Tensor, s: int, *, left: bool) -> torch.Tensor:
    """[b, s] long, 1 where a row has a token."""
    j = torch.arange(s)[None, :]
    keep = j >= (s - lengths)[:, None] if left else j < lengths[:, None]
    return keep.long()


def _with_positions(batch: dict, special: SpecialIds) -> dict:
    """`batch` with ChatGLM-6B's 2D `position_ids` [b, 2, s] when its ids have them (other versions'
    models derive positions from the attention mask)."""
    if special.gmask_token_id is None:
        return batch
    batch["position_ids"] = build_position_ids(
        batch["input_ids"], bos_token_id=special.bos_token_id, gmask_token_id=special.gmask_token_id,
        mask_token_id=special.mask_token_id, pad_mask=batch["attention_mask"],
    )
    return batch
