"""The official `model.chat` / `model.stream_chat` of every version, on `generation.generate` and
`generation.generate_steps`.

`chat` / `stream_chat` (and `Chat`, their methods on the model classes) take from the tokenizer's prompt
format (`tokenizer.prompt_format`, a `batches.PromptFormat`) the version's prompt, sampling defaults and
`max_length` (ChatGLM-6B top_p 0.7, temperature 0.95, 2048 tokens; ChatGLM2/3 and GLM-4 0.8, 0.8, 8192),
and its post-processing (`PromptFormat.chat_response`):
- ChatGLM-6B and ChatGLM2 (`chat_in_pairs`): history is (query, response) pairs, returned as
  `history + [(query, response)]`; ChatGLM-6B makes punctuation full-width next to CJK, ChatGLM2 strips;
- ChatGLM3 and GLM-4: history is role messages (`ROLES`, pairs converted), the query a message of `role`,
  the prompt the format's `chat_ids`, the answer split where the model wrote `<|assistant|>` and each part
  an assistant message `{"role", "metadata", "content"}`; a response is text or a tool call dict.
`stream_chat` yields (response so far, history) from `generate_steps`, holding back text that ends in a
character cut between its bytes; its last item equals `chat`'s result for the same seed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from chatglm_tune.data.batches import PromptFormat
from chatglm_tune.data.records import SPORecord
from chatglm_tune.decoding.generation import generate, generate_steps
from chatglm_tune.options import EncodingOptions, SamplingOptions

ROLES = ("system", "user", "assistant", "observation")  # ChatGLM3 / GLM-4 message roles


def chat_defaults(prompt_format: PromptFormat) -> tuple[SamplingOptions, int]:
    """(sampling, max_length) of the official chat() of a version (its prompt format)."""
    return prompt_format.chat_sampling, prompt_format.chat_max_length


@dataclass(frozen=True)
class Turn:
    """One chat turn, set up: its prompt, its answer budget, and how answer ids become (response, history)."""

    format: PromptFormat
    tokenizer: object
    query: str
    # ChatGLM-6B / ChatGLM2: the (query, response) pairs before; ChatGLM3 / GLM-4: the messages, query last
    history: list
    prompt: list[int]
    budget: int  # new tokens at most: max_length - prompt
    sampling: SamplingOptions
    stop: list[int]

    def texts(self, new_ids: Sequence[int]) -> list[str]:
        """The answer's decoded text without the stop id that ended it; ChatGLM3 / GLM-4: one text per
        `<|assistant|>`-separated segment (the empty ones left out)."""
        ids = list(new_ids)
        if ids and ids[-1] in self.stop:
            ids.pop()
        if self.format.chat_in_pairs:
            return [self.tokenizer.decode(ids)]
        assistant = self.tokenizer.get_command("<|assistant|>")
        segments: list[list[int]] = [[]]
        for i in ids:
            if i == assistant:
                segments.append([])
            else:
                segments[-1].append(i)
        return [self.tokenizer.decode(segment) for segment in segments if segment] or [""]

    def result(self, texts: list[str]) -> tuple:
        """(response, history): ChatGLM-6B / ChatGLM2 history + [(query, response)]; ChatGLM3 / GLM-4 the
        messages, the answer's added."""
        return self.format.chat_response(texts, self.query, self.history)


def prepare_turn(tokenizer, query: str, history, role: str, max_length: int | None,
                 sampling: SamplingOptions | None) -> Turn:
    """One turn of `chat` set up (its prompt, budget, sampling and stop ids), arguments checked (ValueError)."""
    prompt_format = tokenizer.prompt_format
    name = prompt_format.title
    default_sampling, default_length = chat_defaults(prompt_format)
    sampling = default_sampling if sampling is None else sampling
    max_length = default_length if max_length is None else max_length
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    if not (isinstance(max_length, int) and max_length >= 2):
        raise ValueError(f"max_length must be an integer >= 2 (prompt and answer tokens), got {max_length!r}")
    if prompt_format.chat_in_pairs:
        if role != "user":
            raise ValueError(f"{name}'s chat has no roles (a query is the user's), got role={role!r}")
        turn_history = _pairs(history or (), name)
        record = SPORecord(query, None, history=tuple(turn_history) or None)
        encoding = EncodingOptions(prompt="", max_src_len=max_length, max_len=max_length + 2)
        prompt = prompt_format.prompt_ids(tokenizer, record, encoding)[0]
    else:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        turn_history = [*_messages(history or ()), {"role": role, "content": query}]
        prompt = prompt_format.chat_ids(tokenizer, turn_history)
    budget = max_length - len(prompt)
    if budget < 1:
        raise ValueError(f"the prompt has {len(prompt)} tokens, no room left under max_length={max_length}")
    return Turn(prompt_format, tokenizer, query, turn_history, prompt, budget, sampling,
                prompt_format.stop_ids(tokenizer))


def _pairs(history, name: str) -> list[tuple[str, str]]:
    """ChatGLM-6B / ChatGLM2 history as (query, response) tuples; a role message is a ValueError."""
    pairs = []
    for i, item in enumerate(history):
        if isinstance(item, Mapping):
            raise ValueError(f"{name}'s chat history is (query, response) pairs, as its official chat(); history[{i}] "
                             "is a role message (the ChatGLM3 / GLM-4 form)")
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise ValueError(f"history[{i}] must be a (query, response) pair of strings, got {item!r:.100}")
        pairs.append((item[0], item[1]))
    return pairs


def _messages(history) -> list[dict]:
    """ChatGLM3 / GLM-4 history as role messages (copies): messages are checked, (query, response) pairs become
    a user and an assistant message."""
    messages = []
    for i, item in enumerate(history):
        if isinstance(item, Mapping):
            if item.get("role") not in ROLES or not isinstance(item.get("content"), str):
                raise ValueError(f"history[{i}] must have a role in {ROLES} and a str content, got {dict(item)!r:.100}")
            messages.append(copy.deepcopy(dict(item)))
        elif isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, str) for x in item):
            messages += [{"role": "user", "content": item[0]},
                         {"role": "assistant", "metadata": "", "content": item[1]}]
        else:
            raise ValueError(f"history[{i}] must be a {{'role', 'content'}} message or a (query, response) pair, "
                             f"got {item!r:.100}")
    return messages


def chat(
    model,
    tokenizer,
    query: str,
    history: Sequence = (),
    *,
    role: str = "user",
    max_length: int | None = None,
    sampling: SamplingOptions | None = None,
    seed: int | None = None,
    compiled: bool = False,
) -> tuple:
    """The official `model.chat(tokenizer, query, history)` of the tokenizer's version: (response, history).

    ChatGLM-6B / ChatGLM2: history is (query, response) pairs (a role message is a ValueError), the answer
    `history + [(query, response)]`, `role` only "user". ChatGLM3 / GLM-4: history is role messages
    (`ROLES`; pairs are converted), the query is a message of `role` ("observation" for a tool's result),
    the answer `history + [query message, assistant message(s)]` (a response is text, or a tool call dict). The
    caller's history is not changed. `max_length` counts prompt and answer tokens; it and `sampling` default to the
    version's official values (`chat_defaults`). `compiled`: the steps after the prompt compiled on a static cache
    (`generate`'s), the same answer.
    """
    turn = prepare_turn(tokenizer, query, history, role, max_length, sampling)
    new_ids = generate(model, torch.tensor([turn.prompt]), max_new_tokens=turn.budget, sampling=turn.sampling,
                       seed=seed, eos_token_id=turn.stop, vocab_limit=len(tokenizer), compiled=compiled)[0]
    return turn.result(turn.texts(new_ids))


def stream_chat(
    model,
    tokenizer,
    query: str,
    history: Sequence = (),
    *,
    role: str = "user",
    max_length: int | None = None,
    sampling: SamplingOptions | None = None,
    seed: int | None = None,
    compiled: bool = False,
) -> Iterator[tuple]:
    """The official `model.stream_chat`: yields (response so far, history as `chat` would return it) while
    the answer grows, one KV-cached step a token (`generate_steps`), the last one `chat`'s result (same
    arguments, same seed). A step whose text ends in U+FFFD (a character whose bytes have not all come)
    or whose response is still empty yields nothing, and neither does one that changes nothing; the
    final answer is always yielded. Arguments are checked here, before the first step. `compiled`: as `chat`'s."""
    turn = prepare_turn(tokenizer, query, history, role, max_length, sampling)
    return _stream(model, turn, seed, compiled)


def _stream(model, turn: Turn, seed: int | None, compiled: bool) -> Iterator[tuple]:
    ids: list[int] = []
    last = None
    for _, tokens in generate_steps(model, torch.tensor([turn.prompt]), max_new_tokens=turn.budget,
                                    sampling=turn.sampling, seed=seed, eos_token_id=turn.stop,
                                    vocab_limit=len(turn.tokenizer), compiled=compiled):
        ids.append(tokens[0])
        texts = turn.texts(ids)
        if texts[-1].endswith("\ufffd"):
            continue
        current = turn.result(texts)
        if current[0] != "" and current != last:
            last = current
            yield current
    final = turn.result(turn.texts(ids))
    if final != last:
        yield final


class Chat:
    """`model.chat` and `model.stream_chat` on the model classes, with the official arguments of the model's
    version (see `chat`): sampling arguments left as None take the version's official default; `top_k` 0
    turns top-k off; `seed` makes sampling reproducible. Beam search, logits processors and continuing from
    a returned cache are not implemented (a ValueError names the argument)."""

    def chat(self, tokenizer, query: str, history=None, role: str = "user", *, max_length: int | None = None,
             num_beams: int = 1, do_sample: bool | None = None, top_p: float | None = None,
             temperature: float | None = None, top_k: int | None = None, logits_processor=None, seed: int | None = None,
             compiled: bool = False):
        """(response, history): see `chat`."""
        sampling = _chat_sampling(tokenizer, do_sample, top_p, temperature, top_k,
                                  num_beams=num_beams, logits_processor=logits_processor)
        return chat(self, tokenizer, query, history or [], role=role, max_length=max_length, sampling=sampling,
                    seed=seed, compiled=compiled)

    def stream_chat(self, tokenizer, query: str, history=None, role: str = "user", past_key_values=None, *,
                    max_length: int | None = None, do_sample: bool | None = None, top_p: float | None = None,
                    temperature: float | None = None, top_k: int | None = None, logits_processor=None,
                    return_past_key_values: bool = False, seed: int | None = None, compiled: bool = False):
        """Yields (response so far, history): see `stream_chat`."""
        if past_key_values is not None or return_past_key_values:
            raise ValueError("past_key_values / return_past_key_values are not supported: pass the history, the "
                             "prompt is built from it")
        sampling = _chat_sampling(tokenizer, do_sample, top_p, temperature, top_k, logits_processor=logits_processor)
        return stream_chat(self, tokenizer, query, history or [], role=role, max_length=max_length, sampling=sampling,
                           seed=seed, compiled=compiled)


def _chat_sampling(tokenizer, do_sample, top_p, temperature, top_k, *, num_beams: int = 1,
                   logits_processor=None) -> SamplingOptions:
    """The sampling of a `Chat` call: the version's official default where an argument is None."""
    if num_beams != 1:
        raise ValueError(f"num_beams must be 1 (beam search is not implemented), got {num_beams!r}")
    if logits_processor is not None:
        raise ValueError("logits_processor is not supported (the samplers are generation.next_tokens)")
    default, _ = chat_defaults(tokenizer.prompt_format)
    return SamplingOptions(
        do_sample=default.do_sample if do_sample is None else do_sample,
        top_p=default.top_p if top_p is None else top_p,
        temperature=default.temperature if temperature is None else temperature,
        top_k=default.top_k if top_k is None else (top_k or None),
    )
