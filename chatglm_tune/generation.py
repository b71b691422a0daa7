"""Decoding for every version: small pure samplers, batched KV-cache generation (spec section 7), chat.

Samplers (pure functions on a `[b, V]` float score tensor, applied in this order by `next_tokens`):
1. `guard_invalid_scores`: a row holding any NaN or +-inf (an fp16 overflow, a broken checkpoint) is
   replaced by a row that can only pick `fallback_id` (the `<eop>` id in `generate`), so a numerically
   broken row stops instead of emitting garbage. The official `InvalidScoreLogitsProcessor` instead
   zeroes the *whole batch* and forces id 5 (`▁`) whenever one value is invalid; ours touches only the
   broken rows and never invents text.
2. `limit_vocab`: ids >= `vocab_limit` get -inf. ChatGLM-6B's embedding has 130528 rows but its
   tokenizer 130344 pieces; ids in between cannot be decoded (the tokenizer raises on them).
3. greedy (`argmax`) when `do_sample=False` or `temperature == 0`; otherwise temperature, then top-k
   (ties with the k-th score kept, as transformers' TopKLogitsWarper), then top-p, then a draw. This is
   the order of transformers 4.27's warpers, which the official `chat()` uses.

Top-p (`top_p_filter`) follows the reference `sample_top_p`: sort descending, cumulative sum, drop the
tokens whose cumulative mass *before* them already reaches `p`, renormalise, draw with
`torch.multinomial` from the sorted probabilities. So it keeps exactly the smallest prefix of the sorted
distribution whose mass reaches `p` (the reference drops only when the mass before exceeds `p`, which
keeps one token too many on an exact tie). `top_p == 1` keeps everything (no rounding of the
cumulative sum can then drop a tail token).

Randomness: one `torch.Generator` per row, seeded `seed + i` for row i (or from a list of per-row seeds),
so a row's sample never depends on the other rows of its batch, on their length or on when they finish
(`infer.py` seeds each record by its index, which keeps sampled runs resumable).

`generate` returns the new ids of each row. A row that stops on `eos_token_id` ends *with* that id (as
transformers' and the official generate do, so the caller can tell a finished answer from a cut one; it
decodes to ""). Decoding: left-padded prompts (2D mask, 1 = token, 0 = left pad), the official 2D
positions for new tokens (the last prompt position with its block position + 1 per step, i.e.
`[mask_pos, n]` for the n-th token from `<sop>` on), a transformers `DynamicCache` filled once by the
prompt (its first `pre_seq_len` entries are the P-tuning prefix, put there by the model) and one token a
step after. Finished rows leave the batch and the cache (`batch_select_indices`), so they cost nothing.
`generate_steps` is the same loop one step at a time (a generator of each step's new tokens, which
`generate` consumes; a stream runs no step it is not asked for). `generate_recompute` is the reference
script's loop (no cache: the whole sequence and all its logits every step) kept for tests and benchmarks.

`chat` / `stream_chat` (and `Chat`, their methods on the model classes) are the official `model.chat` /
`model.stream_chat` of the tokenizer's version, with its prompt, sampling defaults and `max_length`
(`chat_defaults`: ChatGLM-6B top_p 0.7, temperature 0.95, 2048 tokens; ChatGLM2/3 and GLM-4 0.8, 0.8,
8192), and its post-processing:
- ChatGLM-6B and ChatGLM2: history is (query, response) pairs, returned as `history + [(query, response)]`;
  ChatGLM-6B's `process_response` (punctuation made full-width next to CJK), ChatGLM2 strips;
- ChatGLM3 and GLM-4: history is role messages (`ROLES`, pairs converted), the query a message of `role`,
  the prompt its tokenizer's (`versions.GLMFamilyVersion.chat_ids`), the answer split where the model
  wrote `<|assistant|>` and each part an assistant message `{"role", "metadata", "content"}`; a response
  is text or a tool call dict (`process_chat_response`).
`stream_chat` yields (response so far, history) from `generate_steps`, holding back text that ends in a
character cut between its bytes; its last item equals `chat`'s result for the same seed.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from .options import (CHAT_MAX_LENGTH, CHAT_SAMPLING, DEFAULT_SAMPLING, GLM_CHAT_MAX_LENGTH, GLM_CHAT_SAMPLING,
                      EncodingOptions, SamplingOptions)
from . import versions
from .data import SPORecord


# ----------------------------------------------------------------------------------------------
# Samplers: pure functions of [b, V] scores


def guard_invalid_scores(scores: torch.Tensor, fallback_id: int) -> torch.Tensor:
    """[b, V] -> [b, V]: rows with any NaN/+-inf become 0 at `fallback_id` and -inf elsewhere."""
    bad = ~torch.isfinite(scores).all(dim=-1)  # [b]
    if not bool(bad.any()):
        return scores
    warnings.warn(f"{int(bad.sum())} row(s) of scores held NaN/inf; they emit token {fallback_id} instead", RuntimeWarning)
    forced = torch.full_like(scores[0], float("-inf"))
    forced[fallback_id] = 0.0
    return torch.where(bad[:, None], forced, scores)


def limit_vocab(scores: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """[b, V] -> [b, V] with ids >= `vocab_limit` at -inf (None = keep all)."""
    if vocab_limit is None or vocab_limit >= scores.shape[-1]:
        return scores
    out = scores.clone()
    out[:, vocab_limit:] = float("-inf")
    return out


def top_k_filter(scores: torch.Tensor, k: int | None) -> torch.Tensor:
    """[b, V] -> [b, V]: scores below the k-th largest of their row become -inf (ties kept)."""
    if k is None or k >= scores.shape[-1]:
        return scores
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]  # [b, 1]
    return scores.masked_fill(scores < kth, float("-inf"))


def top_p_filter(probs: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [b, V] -> (sorted, renormalised probabilities [b, V], their token ids [b, V]).

    Keeps the smallest prefix of each row, sorted descending, whose mass reaches `p`; the rest are 0.
    """
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
    if p < 1.0:
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)  # [b, V]
        sorted_probs = sorted_probs.masked_fill(mass_before >= p, 0.0)
    return sorted_probs / sorted_probs.sum(dim=-1, keepdim=True), sorted_ids


def draw(sorted_probs: torch.Tensor, sorted_ids: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row [b], drawn from each row's (sorted) distribution with that row's generator."""
    picks = [torch.multinomial(row, 1, generator=g) for row, g in zip(sorted_probs, generators, strict=True)]
    return sorted_ids.gather(-1, torch.stack(picks)).squeeze(-1)


def next_tokens(
    scores: torch.Tensor,
    options: SamplingOptions,
    generators: Sequence[torch.Generator | None],
    *,
    fallback_id: int,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """The next token of each row, [b] long, from the last-position scores [b, V] (see module docstring)."""
    scores = limit_vocab(guard_invalid_scores(scores.float(), fallback_id), vocab_limit)
    if options.greedy:
        return scores.argmax(dim=-1)
    scores = top_k_filter(scores / options.temperature, options.top_k)
    return draw(*top_p_filter(torch.softmax(scores, dim=-1), options.top_p), generators)


def row_generators(seed: int | Sequence[int] | None, batch_size: int, device) -> list[torch.Generator | None]:
    """One generator a row: seeded `seed + i`, or by `seed[i]`; all None (torch's global RNG) without a seed."""
    if seed is None:
        return [None] * batch_size
    seeds = [seed + i for i in range(batch_size)] if isinstance(seed, int) else list(seed)
    if len(seeds) != batch_size:
        raise ValueError(f"got {len(seeds)} seeds for a batch of {batch_size} rows")
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


# ----------------------------------------------------------------------------------------------
# Batched decoding


class _UseConfigEos:
    """Marker: `eos_token_id` defaults to the model config's (ChatGLM-6B's `<eop>`); None means never stop early."""

    def __repr__(self) -> str:
        return "<config eos_token_id>"


CONFIG_EOS = _UseConfigEos()


@dataclass(frozen=True)
class _Decoding:
    """What `generate` and `generate_recompute` set up alike from their arguments."""

    input_ids: torch.Tensor  # [b, s] on the model's device
    mask: torch.Tensor | None  # [b, s] pad mask, None when nothing is padded
    stop: torch.Tensor | None  # the ids that stop a row, None = never
    fallback: int  # the id a row of NaN/inf scores is forced to
    generators: list  # one per row


def _setup(model, input_ids, attention_mask, max_new_tokens, sampling, eos_token_id, seed, vocab_limit) -> _Decoding:
    if not isinstance(sampling, SamplingOptions):
        raise TypeError(f"sampling must be a SamplingOptions, got {type(sampling).__name__}")
    eos = model.config.eos_token_id if isinstance(eos_token_id, _UseConfigEos) else eos_token_id
    stop_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    fallback = (stop_ids or _as_list(model.config.eos_token_id))[0]
    device = next(model.parameters()).device
    ids, mask = _checked_prompt(input_ids, attention_mask, max_new_tokens, vocab_limit, device)
    generators = row_generators(seed, ids.shape[0], device) if max_new_tokens else []
    stop = torch.tensor(stop_ids, device=device) if stop_ids else None
    return _Decoding(ids, mask, stop, fallback, generators)


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    sampling: SamplingOptions = DEFAULT_SAMPLING,
    eos_token_id: int | Sequence[int] | None | _UseConfigEos = CONFIG_EOS,
    seed: int | Sequence[int] | None = None,
    vocab_limit: int | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """New token ids of each row (each ends with `eos_token_id` when it stopped on it), KV-cached.

    input_ids: [b, s] prompts containing `[gMASK] <sop>`, left-padded. attention_mask: [b, s], 1 = token,
    0 = left pad (None = no padding). The model runs in eval mode for the call. `seed`: see
    `row_generators`. `vocab_limit`: the tokenizer's vocabulary size; larger ids are never produced.
    `use_cache=False` decodes the reference script's way (`generate_recompute`), with the same result.
    """
    d = _setup(model, input_ids, attention_mask, max_new_tokens, sampling, eos_token_id, seed, vocab_limit)
    with _eval_mode(model):
        decode = _decode_cached if use_cache else _decode_recompute
        return decode(model, d, max_new_tokens, sampling, vocab_limit)


def generate_recompute(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **options) -> list[list[int]]:
    """`generate` the reference script's way: no cache, the whole batch runs the whole sequence (and the
    head over every position) each step until every row has stopped. Same arguments, same result."""
    return generate(model, input_ids, attention_mask, use_cache=False, **options)


@torch.inference_mode()  # on a generator: entered while a step runs, left at each yield
def generate_steps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    sampling: SamplingOptions = DEFAULT_SAMPLING,
    eos_token_id: int | Sequence[int] | None | _UseConfigEos = CONFIG_EOS,
    seed: int | Sequence[int] | None = None,
    vocab_limit: int | None = None,
) -> Iterator[tuple[list[int], list[int]]]:
    """`generate` one KV-cached step at a time: yields, each step, (the prompt index of every row still
    decoding, the new token of each). The tokens are `generate`'s with the same arguments. A step runs when
    the next item is asked for, so a consumer that stops early runs no more; the model stays in eval mode
    until the iteration ends or the generator is closed (inference mode holds only while a step runs)."""
    d = _setup(model, input_ids, attention_mask, max_new_tokens, sampling, eos_token_id, seed, vocab_limit)
    with _eval_mode(model):
        yield from _cached_steps(model, d, max_new_tokens, sampling, vocab_limit)


def _decode_cached(model, d: _Decoding, max_new_tokens: int, sampling: SamplingOptions, vocab_limit) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in range(d.input_ids.shape[0])]
    for rows, tokens in _cached_steps(model, d, max_new_tokens, sampling, vocab_limit):
        for row, token in zip(rows, tokens):
            results[row].append(token)
    return results


def _cached_steps(model, d: _Decoding, max_new_tokens: int, sampling: SamplingOptions,
                  vocab_limit) -> Iterator[tuple[list[int], list[int]]]:
    """The KV-cached decoding loop: yields (live rows, their new tokens) after each sampling step, before the
    stop check and the next forward (so a consumer that stops at a stop id runs no forward past it)."""
    input_ids, mask, stop, generators = d.input_ids, d.mask, d.stop, d.generators
    b = input_ids.shape[0]
    if max_new_tokens == 0:
        return
    positions = versions.of_config(model.config).positions(model.config, input_ids, mask)  # ChatGLM-6B: [b, 2, s]
    step = torch.tensor([0, 1], device=input_ids.device)[None, :, None]  # block position + 1 per new token
    cache = DynamicCache()
    out = model(input_ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
    live = list(range(b))  # batch row -> index of the prompt it decodes
    next_pos = None if positions is None else positions[:, :, -1:] + step  # [b, 2, 1]
    for n in range(max_new_tokens):
        tokens = next_tokens(out.logits[:, -1], sampling, generators, fallback_id=d.fallback, vocab_limit=vocab_limit)
        yield live, tokens.tolist()
        if n == max_new_tokens - 1:
            break
        stopped = torch.isin(tokens, stop) if stop is not None else None
        if stopped is not None and bool(stopped.any()):
            keep = (~stopped).nonzero().flatten()  # [live']
            if keep.numel() == 0:
                break
            cache.batch_select_indices(keep)
            live = [live[i] for i in keep.tolist()]
            generators = [generators[i] for i in keep.tolist()]
            tokens = tokens[keep]
            next_pos = None if next_pos is None else next_pos[keep]
            mask = None if mask is None or bool(mask[keep].all()) else mask[keep]
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)  # [live, cached + 1]
        out = model(tokens[:, None], position_ids=next_pos, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
        next_pos = None if next_pos is None else next_pos + step


def _decode_recompute(model, d: _Decoding, max_new_tokens: int, sampling: SamplingOptions, vocab_limit) -> list[list[int]]:
    seq, mask = d.input_ids, d.mask
    b = seq.shape[0]
    results: list[list[int]] = [[] for _ in range(b)]
    running = [True] * b
    for _ in range(max_new_tokens):
        positions = versions.of_config(model.config).positions(model.config, seq, mask)
        logits = model(seq, position_ids=positions, attention_mask=mask, use_cache=False).logits  # [b, s, V]
        tokens = next_tokens(logits[:, -1], sampling, d.generators, fallback_id=d.fallback, vocab_limit=vocab_limit)
        for row, token in enumerate(tokens.tolist()):
            if running[row]:
                results[row].append(token)
                running[row] = d.stop is None or token not in d.stop.tolist()
        if not any(running):
            break
        seq = torch.cat([seq, tokens[:, None]], dim=1)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
    return results


def _checked_prompt(input_ids, attention_mask, max_new_tokens, vocab_limit, device):
    """Validated (ids [b, s], pad mask [b, s] or None when nothing is padded) on `device`."""
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if vocab_limit is not None and not (isinstance(vocab_limit, int) and vocab_limit >= 1):
        raise ValueError(f"vocab_limit must be None or an integer >= 1, got {vocab_limit!r}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1, got {list(input_ids.shape)}")
    input_ids = input_ids.to(device)
    if attention_mask is None:
        return input_ids, None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must be the 2D pad mask [batch, seq] = {list(input_ids.shape)} (1 = token, 0 = left pad), "
            f"got {list(attention_mask.shape)}"
        )
    mask = attention_mask.to(device).long()
    if not bool(mask[:, -1].all()) or bool((mask.diff(dim=1) < 0).any()):
        raise ValueError("prompts must be left-padded: each attention_mask row is 0s then 1s, ending with a 1")
    return input_ids, (None if bool(mask.all()) else mask)


def _as_list(ids) -> list[int]:
    return [ids] if isinstance(ids, int) else list(ids)


@contextlib.contextmanager
def _eval_mode(model):
    """Eval mode (no prefix dropout) for the duration, then the caller's mode back."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------------------------
# The official chat() and stream_chat()

ROLES = ("system", "user", "assistant", "observation")  # ChatGLM3 / GLM-4 message roles
PAIR_VERSIONS = ("chatglm", "chatglm2")  # their chat history is (query, response) pairs
# What the official post-processing writes for the `[[训练时间]]` placeholder.
_TRAINING_TIME = {"chatglm": "2023年", "chatglm2": "2023年", "chatglm3": "2023年", "glm4": "2024年"}
_PUNCTUATION = ((",", "，"), ("!", "！"), (":", "："), (";", "；"), (r"\?", "？"))
_CJK = r"[\u4e00-\u9fff]"


def chat_defaults(version: str) -> tuple[SamplingOptions, int]:
    """(sampling, max_length) of the official chat() of a version: ChatGLM-6B's, or ChatGLM2/3 and GLM-4's."""
    return (CHAT_SAMPLING, CHAT_MAX_LENGTH) if version == "chatglm" else (GLM_CHAT_SAMPLING, GLM_CHAT_MAX_LENGTH)


def process_response(response: str) -> str:
    """ChatGLM-6B's official post-processing: strip, `[[训练时间]]` -> `2023年`, ASCII `, ! : ; ?` next to a
    CJK character made full-width."""
    response = response.strip().replace("[[训练时间]]", _TRAINING_TIME["chatglm"])
    for ascii_mark, full_width in _PUNCTUATION:
        response = re.sub(rf"({_CJK}){ascii_mark}", rf"\g<1>{full_width}", response)
        response = re.sub(rf"{ascii_mark}({_CJK})", rf"{full_width}\g<1>", response)
    return response


def process_chat_response(segments: Sequence[str], history: Sequence[dict], version: str) -> tuple[str | dict, list[dict]]:
    """ChatGLM3 / GLM-4's official post-processing of an answer: (response, history + its assistant messages).

    `segments`: the decoded answer split where the model wrote `<|assistant|>` (one text for a plain answer).
    `history`: the messages so far, the query last; it is not changed. Each segment becomes
    `{"role": "assistant", "metadata": its first line, "content": the rest}` (a segment of one line is all
    content). The response is the last segment's:
    - no metadata: the content stripped, with `[[训练时间]]` written as the training year (in the response
      only, as officially);
    - metadata (a tool name) and a first message that is a system message with `tools`: the tool call
      `{"name": metadata stripped, "parameters": ...}`, from ChatGLM3's code block holding `tool_call(k=v, ...)`
      (its arguments read as Python literals; the official code evaluates the block, this runs nothing) or
      GLM-4's JSON; content that does not parse (a call still being streamed) gives `{"name", "content"}`;
    - metadata without tools: `{"name": metadata stripped, "content": content}`.
    """
    history = list(history)
    tools = bool(history) and history[0].get("role") == "system" and "tools" in history[0]
    response: str | dict = ""
    for text in segments:
        metadata, content = text.split("\n", 1) if "\n" in text else ("", text)
        if not metadata.strip():
            content = content.strip()
            history.append({"role": "assistant", "metadata": metadata, "content": content})
            response = content.replace("[[训练时间]]", _TRAINING_TIME[version])
            continue
        history.append({"role": "assistant", "metadata": metadata, "content": content})
        parameters = _tool_parameters(content, version) if tools else None
        response = {"name": metadata.strip(), **({"content": content} if parameters is None else {"parameters": parameters})}
    return response, history


def _tool_parameters(content: str, version: str):
    """The parameters of a tool call (GLM-4: JSON; ChatGLM3: `tool_call(...)`'s keyword literals), or None."""
    if version == "glm4":
        try:
            return json.loads(content)
        except json.JSONDecodeError:
            return None
    lines = content.strip().split("\n")
    if lines[0].startswith("```"):
        lines = lines[1:]
    if lines and lines[-1].strip() == "```":
        lines = lines[:-1]
    try:
        call = ast.parse("\n".join(lines).strip(), mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "tool_call"
                and not call.args and all(k.arg is not None for k in call.keywords)):
            return None
        return {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


@dataclass(frozen=True)
class _Turn:
    """One chat turn, set up: its prompt, its answer budget, and how answer ids become (response, history)."""

    version: str
    tokenizer: object
    query: str
    history: list  # ChatGLM-6B / ChatGLM2: the (query, response) pairs before; ChatGLM3 / GLM-4: the messages, query last
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
        if self.version in PAIR_VERSIONS:
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
        """(response, history): ChatGLM-6B / ChatGLM2 history + [(query, response)]; ChatGLM3 / GLM-4
        `process_chat_response`."""
        if self.version == "chatglm":
            response = process_response(texts[0])
        elif self.version == "chatglm2":  # the official post-processing: strip, the training year
            response = texts[0].strip().replace("[[训练时间]]", _TRAINING_TIME["chatglm2"])
        else:
            return process_chat_response(texts, self.history, self.version)
        return response, [*self.history, (self.query, response)]


def _turn(tokenizer, query: str, history, role: str, max_length: int | None, sampling: SamplingOptions | None) -> _Turn:
    version = versions.of_tokenizer(tokenizer)
    name = version.name
    default_sampling, default_length = chat_defaults(name)
    sampling = default_sampling if sampling is None else sampling
    max_length = default_length if max_length is None else max_length
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    if not (isinstance(max_length, int) and max_length >= 2):
        raise ValueError(f"max_length must be an integer >= 2 (prompt and answer tokens), got {max_length!r}")
    if name in PAIR_VERSIONS:
        if role != "user":
            raise ValueError(f"{name}'s chat has no roles (a query is the user's), got role={role!r}")
        turn_history = _pairs(history or (), name)
        record = SPORecord(query, None, history=tuple(turn_history) or None)
        encoding = EncodingOptions(prompt="", max_src_len=max_length, max_len=max_length + 2)
        prompt = version.prompt_ids(tokenizer, record, encoding)[0]
    else:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        turn_history = [*_messages(history or ()), {"role": role, "content": query}]
        prompt = version.chat_ids(tokenizer, turn_history)
    budget = max_length - len(prompt)
    if budget < 1:
        raise ValueError(f"the prompt has {len(prompt)} tokens, no room left under max_length={max_length}")
    return _Turn(name, tokenizer, query, turn_history, prompt, budget, sampling, version.stop_ids(tokenizer))


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
            messages += [{"role": "user", "content": item[0]}, {"role": "assistant", "metadata": "", "content": item[1]}]
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
) -> tuple:
    """The official `model.chat(tokenizer, query, history)` of the tokenizer's version: (response, history).

    ChatGLM-6B / ChatGLM2: history is (query, response) pairs (a role message is a ValueError), the answer
    `history + [(query, response)]`, `role` only "user". ChatGLM3 / GLM-4: history is role messages
    (`ROLES`; pairs are converted), the query is a message of `role` ("observation" for a tool's result),
    the answer `history + [query message, assistant message(s)]` (`process_chat_response`: a response is
    text, or a tool call dict). The caller's history is not changed. `max_length` counts prompt and answer
    tokens; it and `sampling` default to the version's official values (`chat_defaults`).
    """
    turn = _turn(tokenizer, query, history, role, max_length, sampling)
    new_ids = generate(model, torch.tensor([turn.prompt]), max_new_tokens=turn.budget, sampling=turn.sampling, seed=seed,
                       eos_token_id=turn.stop, vocab_limit=len(tokenizer))[0]
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
) -> Iterator[tuple]:
    """The official `model.stream_chat`: yields (response so far, history as `chat` would return it) while
    the answer grows, one KV-cached step a token (`generate_steps`), the last one `chat`'s result (same
    arguments, same seed). A step whose text ends in U+FFFD (a character whose bytes have not all come)
    or whose response is still empty yields nothing, and neither does one that changes nothing; the
    final answer is always yielded. Arguments are checked here, before the first step."""
    turn = _turn(tokenizer, query, history, role, max_length, sampling)
    return _stream(model, turn, seed)


def _stream(model, turn: _Turn, seed: int | None) -> Iterator[tuple]:
    ids: list[int] = []
    last = None
    for _, tokens in generate_steps(model, torch.tensor([turn.prompt]), max_new_tokens=turn.budget, sampling=turn.sampling,
                                    seed=seed, eos_token_id=turn.stop, vocab_limit=len(turn.tokenizer)):
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
             temperature: float | None = None, top_k: int | None = None, logits_processor=None, seed: int | None = None):
        """(response, history): see `chat`."""
        sampling = _chat_sampling(tokenizer, do_sample, top_p, temperature, top_k,
                                  num_beams=num_beams, logits_processor=logits_processor)
        return chat(self, tokenizer, query, history or [], role=role, max_length=max_length, sampling=sampling, seed=seed)

    def stream_chat(self, tokenizer, query: str, history=None, role: str = "user", past_key_values=None, *,
                    max_length: int | None = None, do_sample: bool | None = None, top_p: float | None = None,
                    temperature: float | None = None, top_k: int | None = None, logits_processor=None,
                    return_past_key_values: bool = False, seed: int | None = None):
        """Yields (response so far, history): see `stream_chat`."""
        if past_key_values is not None or return_past_key_values:
            raise ValueError("past_key_values / return_past_key_values are not supported: pass the history, the "
                             "prompt is built from it")
        sampling = _chat_sampling(tokenizer, do_sample, top_p, temperature, top_k, logits_processor=logits_processor)
        return stream_chat(self, tokenizer, query, history or [], role=role, max_length=max_length, sampling=sampling,
                           seed=seed)


def _chat_sampling(tokenizer, do_sample, top_p, temperature, top_k, *, num_beams: int = 1,
                   logits_processor=None) -> SamplingOptions:
    """The sampling of a `Chat` call: the version's official default where an argument is None."""
    if num_beams != 1:
        raise ValueError(f"num_beams must be 1 (beam search is not implemented), got {num_beams!r}")
    if logits_processor is not None:
        raise ValueError("logits_processor is not supported (the samplers are generation.next_tokens)")
    default, _ = chat_defaults(versions.of_tokenizer(tokenizer).name)
    return SamplingOptions(
        do_sample=default.do_sample if do_sample is None else do_sample,
        top_p=default.top_p if top_p is None else top_p,
        temperature=default.temperature if temperature is None else temperature,
        top_k=default.top_k if top_k is None else (top_k or None),
    )
