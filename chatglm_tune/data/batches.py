"""Encoding records into ids, as each version's official fine-tuning does, and collating batches.

Encoding. A tokenizer carries its version's prompt format (`tokenizer.prompt_format`, a `PromptFormat`
that the model family declares beside the tokenizer class); `prompt_ids` and `encode_record` ask it.
Record text is always encoded as data: a `<|user|>` typed in a record never becomes a control token.
The formats, with `|` where the labels start:

    ChatGLM-6B   prompt + text [gMASK] <sop> | answer <eop>                           (ptuning/main.py)
    ChatGLM2-6B  [gMASK] sop prompt "[Round 1]\\n\\n问：{text}\\n\\n答：" | answer </s>     (ptuning/main.py)
    ChatGLM3-6B  [gMASK] sop <|user|> \\n prompt + text <|assistant|> | \\n answer </s>   (finetune_demo)
    GLM-4-9B     [gMASK] <sop> <|user|> \\n prompt + text <|assistant|> | \\n answer <|user|> (finetune.py)

ChatGLM-6B also trains on `<sop>`, the last prompt token, which `[gMASK]` predicts (its
`labelled_prompt_tokens` is 1). Its budget, as `ptuning/main.py`'s preprocess_function with
max_target_length = max_len - max_src_len:

    source = encode(prompt + text)[: max_src_len - 1]        # room for [gMASK]
    answer = encode(answer_text)[: max_len - max_src_len - 2]   # room for <sop> and <eop>
    input_ids = source + [gMASK, <sop>] + answer + [<eop>]     # len <= max_len

Collating. `collate_train` right-pads a batch to its longest row; `collate_prompts` left-pads inference
prompts. Both return `input_ids` and the 2D `attention_mask` (1 = token, 0 = pad), from which every
model derives its positions (ChatGLM-6B its 2D GLM positions from the ids and the mask, the others
cumsum(mask) - 1). The pad id comes from the tokenizer or the model config (`SpecialIds.of`).
`pack` and `collate_packed` put several training rows into one (`--packing`): `segment_ids` in place of the
mask tell the model which tokens are one example's, and each model keeps examples apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from chatglm_tune.data.dialogues import ToolCall, Turn
from chatglm_tune.data.records import SPORecord
from chatglm_tune.options import EncodingOptions, SamplingOptions

IGNORE_INDEX = -100  # label of positions that carry no loss (torch CrossEntropyLoss default)


# ----------------------------------------------------------------------------------------------
# Encoding


@dataclass(frozen=True)
class SpecialIds:
    """Special token ids, read alike from a tokenizer or a model config: the collators pad with
    `pad_token_id`. The GLM ids (`gmask`, `<sop>`, `[MASK]`) are ChatGLM-6B's (None for ChatGLM2/3 and
    GLM-4), which its tokenizer and config must agree on."""

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
    """One training row: `input_ids` and `labels` of equal length (<= max_len), and truncation flags (a
    conversation's row is cut whole at max_len: `row_truncated`)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    source_truncated: bool
    answer_truncated: bool
    source: str = ""
    row_truncated: bool = False


class PromptFormat:
    """How one version's records and chats become ids, and answer ids text again: the interface each model
    family implements once per version (ChatGLM-6B's in `models/chatglm6b/format.py`, ChatGLM2/3 and GLM-4's
    in `models/glm/formats.py`), attached to the version's tokenizer class as `prompt_format`."""

    name: str  # the version's name ("chatglm", "chatglm2", "chatglm3", "glm4")
    title: str  # the version as a reader knows it ("ChatGLM3-6B")
    labelled_prompt_tokens: int = 0  # trailing prompt tokens that are trained on (ChatGLM-6B: <sop>)
    chat_sampling: SamplingOptions  # the official chat()'s sampling defaults
    chat_max_length: int  # ... and its max_length (prompt and answer tokens)
    chat_in_pairs: bool = False  # chat history as (query, response) pairs, else as role messages
    tool_calls: bool = False  # its chat writes tool calls that chat() reads (ChatGLM3, GLM-4-9B)
    tool_arguments_form: str | None = None  # how a call's arguments are written: "json" (GLM-4), "python" (ChatGLM3)
    declared_calls_only: bool = False  # a call's first line must name a declared tool (GLM-4), else any (ChatGLM3)
    has_thinking: bool = False  # its chat template takes enable_thinking / clear_thinking (the agent GLMs)
    effort = None  # the reasoning-effort line its chat template writes (GLM-5.2, GLM-5.3-Flash): its `values`, or None
    stream_lookahead: int = 0  # characters a stream holds back: the post-processing of the last ones may change
    # The chat as engines outside the toolkit write it (export.py): a Jinja chat template (GGUF metadata, a
    # transformers tokenizer_config.json), ollama's Go template (INSTRUCTION marks where a run's instruction
    # goes before the last user message), and the texts of the stop ids. Empty: the version has none.
    jinja_template: str = ""
    ollama_template: str = ""
    stop_texts: tuple[str, ...] = ()

    def effort_problem(self, effort) -> str | None:
        """Why `effort` cannot be the template's `reasoning_effort` (a template without the line, or an effort it does
        not write), None where it can (or none is asked)."""
        if effort is None:
            return None
        if self.effort is None:
            return f"{self.title}'s chat template writes no reasoning-effort line (GLM-5.2's and GLM-5.3-Flash's do)"
        if effort not in self.effort.values:
            return f"{self.title}'s chat template takes {', '.join(self.effort.values)}, not {effort!r:.80}"
        return None

    def prompt_ids(self, tokenizer, record: SPORecord, options: EncodingOptions) -> tuple[list[int], bool]:
        """(the prompt of a record, whether its text was cut to fit `options`)."""
        raise NotImplementedError

    def answer_ids(self, tokenizer, answer: str, options: EncodingOptions) -> tuple[list[int], bool]:
        """(the ids a gold answer is trained as, its end id included; whether it was cut to fit)."""
        raise NotImplementedError

    def stop_ids(self, tokenizer) -> list[int]:
        """The ids that end a reply."""
        raise NotImplementedError

    def chat_template(self, tokenizer) -> str:
        """The Jinja chat template whose text, tokenized with special tokens parsed, gives `chat_ids`."""
        return self.jinja_template

    def chat_ids(self, tokenizer, messages: list[dict]) -> list[int]:
        """The official chat() prompt of role messages, the last one the query (role-message formats only)."""
        raise ValueError(f"{self.title} chats in (query, response) pairs, not role messages")

    def chat_response(self, texts: list[str], query: str, history: list) -> tuple:
        """(response, history) of the official chat(): `texts` the decoded answer (role-message formats: one
        text per `<|assistant|>`-separated segment), `history` the turn's (pairs before the query, or the
        messages with the query last)."""
        raise NotImplementedError

    def tool_call_message(self, name: str, arguments: dict) -> dict:
        """A tool call (OpenAI's: a name, the arguments as a dict) as the assistant message of the history that
        the version's chat writes for it (formats with `tool_calls`); ValueError where it has no such form."""
        raise ValueError(f"{self.title} has no tool calls here")

    def read_call(self, answer: str) -> ToolCall | None:
        """The tool call a decoded answer writes, None for a text answer (always, where the chat has no tool calls)."""
        return None

    def read_calls(self, answer: str, tools: list | None = None) -> tuple[ToolCall, ...]:
        """Every tool call a decoded answer writes, in order (`read_call`'s one, where the version writes one a
        turn); `tools`: the conversation's, whose schemas type the arguments where the version writes them as text."""
        call = self.read_call(answer)
        return () if call is None else (call,)

    def text_answer_lead(self, tokenizer) -> str:
        """The text a chat's text answer begins with, before its content, where no tools are offered (ChatGLM3 and
        GLM-4: the empty metadata line's "\n")."""
        return ""

    def tool_call_lead(self, tokenizer, name: str) -> list[int]:
        """The ids an answer calling tool `name` begins with (what the prompt ends with to ask for that call)."""
        raise ValueError(f"{self.title} has no tool calls here")

    def training_row(self, tokenizer, record: SPORecord, options: EncodingOptions) -> EncodedExample:
        """The `EncodedExample` of a record with a gold answer (a conversation: its history as context)."""
        self.check_pairs(record)
        if record.answer is None:
            raise ValueError(f"{record.source or 'record'}: has no gold answer, cannot build a training example")
        prompt, prompt_cut = self.prompt_ids(tokenizer, record, options)
        answer, answer_cut = self.answer_ids(tokenizer, record.answer, options)
        return training_example(prompt, answer, self.labelled_prompt_tokens, prompt_truncated=prompt_cut,
                                answer_truncated=answer_cut, origin=record.source)

    def check_pairs(self, record: SPORecord) -> None:
        """ValueError for a conversation that (query, response) pairs cannot hold (a system prompt, tools, calls,
        observations, loss flags) where this version reads pairs only."""
        if record.dialogue is not None and record.history is None and self.chat_in_pairs:
            raise ValueError(f"{record.source or 'record'}: {self.title} has no system, tool or observation turns "
                             "and no reasoning (its chat is (query, response) pairs): such conversations train "
                             "ChatGLM3-6B, GLM-4 and later (reasoning: GLM-4.5 and later)")

    def check_turn(self, turn: Turn) -> None:
        """ValueError for a conversation turn (`dialogues.Turn`) the version has no form for, saying why: reasoning and
        OpenAI-style calls (`tool_calls`) where the version has none (here: every version but the agent GLMs); a
        role-message version without a tool form also refuses a system turn's tools, a call, an observation."""
        if turn.reasoning:
            raise ValueError(f"{self.title} has no reasoning (no <think> in its chat): reasoning_content trains "
                             "GLM-4.5 / 4.6 / 4.7 and GLM-4.7-Flash")
        if turn.calls:
            raise ValueError(f"{self.title} does not write OpenAI-style tool_calls: they train GLM-4.5 / 4.6 / 4.7 "
                             "and GLM-4.7-Flash; ChatGLM3-6B and GLM-4 take their own fine-tuning forms "
                             "(data/make_tools.py)")

    def check_dialogue(self, dialogue, options: EncodingOptions) -> None:
        """ValueError for a conversation (`dialogues.Dialogue`) whose flags or form the version cannot render as the
        record asks, naming the field; here every conversation passes (the agent GLMs check theirs)."""

    def decode_answer(self, tokenizer, new_ids: list[int]) -> str:
        """The text of generated ids, without the stop id that ended them."""
        if new_ids and new_ids[-1] in self.stop_ids(tokenizer):
            new_ids = new_ids[:-1]
        return tokenizer.decode(new_ids).strip()


def prompt_ids(record: SPORecord, tokenizer, options: EncodingOptions = EncodingOptions()) -> list[int]:
    """Inference input of a record: its prompt in the tokenizer's prompt format."""
    return tokenizer.prompt_format.prompt_ids(tokenizer, record, options)[0]


def encode_record(record: SPORecord, tokenizer, options: EncodingOptions = EncodingOptions()) -> EncodedExample:
    """Training row of a record with a gold answer, as the version's official fine-tuning builds it."""
    return tokenizer.prompt_format.training_row(tokenizer, record, options)


def training_example(prompt: list[int], answer: list[int], labelled_prompt_tokens: int, *,
                     prompt_truncated: bool = False, answer_truncated: bool = False,
                     origin: str = "") -> EncodedExample:
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
        """`{"examples", "source_truncated", "answer_truncated", "row_truncated"}` counts."""
        return {
            "examples": len(self.examples),
            "source_truncated": sum(e.source_truncated for e in self.examples),
            "answer_truncated": sum(e.answer_truncated for e in self.examples),
            "row_truncated": sum(e.row_truncated for e in self.examples),
        }


# ----------------------------------------------------------------------------------------------
# Collating


def collate_train(batch: Sequence[EncodedExample], special: SpecialIds) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row. Returns `input_ids`, `labels` (pads -100) and `attention_mask` [b, s]
    (1 = token)."""
    lengths = torch.tensor([len(e.input_ids) for e in batch])
    input_ids = _pad_rows([e.input_ids for e in batch], special.pad_token_id, lengths, left=False)
    labels = _pad_rows([e.labels for e in batch], IGNORE_INDEX, lengths, left=False)
    attention_mask = _token_mask(lengths, input_ids.shape[1], left=False)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def collate_prompts(prompts: Sequence[Sequence[int]], special: SpecialIds) -> dict[str, torch.Tensor]:
    """Left-pad inference prompts to the longest. Returns `input_ids` and `attention_mask` [b, s] (1 = token,
    0 = left pad), from which the model gives each row the positions of its prompt alone."""
    lengths = torch.tensor([len(p) for p in prompts])
    input_ids = _pad_rows(prompts, special.pad_token_id, lengths, left=True)
    attention_mask = _token_mask(lengths, input_ids.shape[1], left=True)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def pack(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """The indices of rows of `lengths` grouped into packed rows of at most `max_len` tokens: first fit, longest
    first (a row longer than `max_len` alone); every index once, each group in the order it was filled."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = next((r for r, left in enumerate(room) if lengths[i] <= left), None)
        if fits is None:
            rows.append([i])
            room.append(max_len - lengths[i])
        else:
            rows[fits].append(i)
            room[fits] -= lengths[i]
    return rows


def collate_packed(rows: Sequence[Sequence[EncodedExample]], special: SpecialIds) -> dict[str, torch.Tensor]:
    """Packed training rows: each row's examples one after another, right-padded to the longest row. Returns
    `input_ids`, `labels` (pads -100) and `segment_ids` [b, s]: 1, 2, ... for the examples of a row, 0 on pads. A
    model given `segment_ids` lets no token see another example's, and starts each example's positions afresh
    (`segment_positions`, `segment_visibility`), so an example's loss is what it is alone."""
    joined = [[t for e in row for t in e.input_ids] for row in rows]
    lengths = torch.tensor([len(ids) for ids in joined])
    input_ids = _pad_rows(joined, special.pad_token_id, lengths, left=False)
    # an example's first label is never a target (the loss shifts it away in a row of its own): here it would be
    # the previous example's last token's, so it goes
    labels = _pad_rows([[t for e in row for t in (IGNORE_INDEX, *e.labels[1:])] for row in rows], IGNORE_INDEX, lengths,
                       left=False)
    segments = [[k + 1 for k, e in enumerate(row) for _ in e.input_ids] for row in rows]
    return {"input_ids": input_ids, "labels": labels, "segment_ids": _pad_rows(segments, 0, lengths, left=False)}


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] each token's position within its own example (0, 1, ...; 0 on pads) of packed rows' `segment_ids`."""
    j = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, j, 0).cummax(dim=1).values  # where each token's example starts
    return (j - first) * (segment_ids > 0)


def segment_visibility(segment_ids: torch.Tensor) -> torch.Tensor:
    """[b, s, s] bool: query i may see key j of the same example (pads see no one); the causal or other pattern
    within an example is the model's to add."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return same & (segment_ids > 0)[:, None, :]


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
