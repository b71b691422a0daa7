"""Batched KV-cached generation for every version, on the samplers of `sampling` and the steps of `steps`.

`generate` returns the new ids of each row. A row that stops on `eos_token_id` ends *with* that id (as
transformers' and the official generate do, so the caller can tell a finished answer from a cut one; it
decodes to ""). Decoding: left-padded prompts (2D mask, 1 = token, 0 = left pad); positions asked of the
model (`model.prompt_positions`, then `model.next_positions` a step: ChatGLM-6B's 2D GLM positions, the
n-th token from `<sop>` at `[mask_pos, n]`; the other models return None and derive them from the
mask), a `batch_cache.BatchCache` filled once by the prompt (its first `pre_seq_len` entries are the
P-tuning prefix, put there by the model) and one token a step after, the step the serving engine takes.
Finished rows leave the batch and the cache (`BatchCache.select`), so they cost nothing.
`generate_steps` is the same loop one step at a time (a generator of each step's new tokens, which
`generate` consumes; a stream runs no step it is not asked for). `generate_recompute` is the reference
script's loop (no cache: the whole sequence and all its logits every step) kept for tests and benchmarks.

The official `chat` / `stream_chat` are in `decoding.chat`, on `generate` and `generate_steps`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from chatglm_tune.decoding import static_decoding
from chatglm_tune.decoding.batch_cache import BatchCache
from chatglm_tune.decoding.drafting import Drafter
from chatglm_tune.decoding.sampling import next_tokens, row_generators
from chatglm_tune.decoding.speculative import DecodeStats, speculative_steps, usable_drafts
from chatglm_tune.options import DEFAULT_SAMPLING, DraftOptions, SamplingOptions


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
    drafts: DraftOptions | Drafter | None = None,
    stats: DecodeStats | None = None,
    compiled: bool = False,
) -> list[list[int]]:
    """New token ids of each row (each ends with `eos_token_id` when it stopped on it), KV-cached.

    input_ids: [b, s] prompts containing `[gMASK] <sop>`, left-padded. attention_mask: [b, s], 1 = token,
    0 = left pad (None = no padding). The model runs in eval mode for the call. `seed`: see
    `row_generators`. `vocab_limit`: the tokenizer's vocabulary size; larger ids are never produced.
    `use_cache=False` decodes the reference script's way (`generate_recompute`), with the same result.
    `drafts`: greedy decoding checks guesses looked up in each row's own tokens, several a forward
    (`speculative`; the same ids; sampled rows decode plainly): `DraftOptions`, or a `drafting.Drafter` kept
    over calls, whose pool of finished answers then serves the later calls' guesses too; `stats` (a
    `DecodeStats`) counts its forwards, tokens and accepted guesses. `compiled`: the steps after the prompt run
    one compiled forward over a static cache (`static_decoding`; the same ids), on the models that have one.
    """
    d = _setup(model, input_ids, attention_mask, max_new_tokens, sampling, eos_token_id, seed, vocab_limit)
    with _eval_mode(model):
        if not use_cache:
            return _decode_recompute(model, d, max_new_tokens, sampling, vocab_limit)
        results: list[list[int]] = [[] for _ in range(d.input_ids.shape[0])]
        for rows, tokens in _steps(model, d, max_new_tokens, sampling, vocab_limit, drafts, stats, compiled):
            for row, token in zip(rows, tokens):
                results[row].append(token)
        return results


def generate_recompute(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       **options) -> list[list[int]]:
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
    drafts: DraftOptions | Drafter | None = None,
    stats: DecodeStats | None = None,
    compiled: bool = False,
) -> Iterator[tuple[list[int], list[int]]]:
    """`generate` one KV-cached step at a time: yields, each step, (the prompt index of every row still
    decoding, the new token of each). The tokens are `generate`'s with the same arguments. A step runs when
    the next item is asked for, so a consumer that stops early runs no more; the model stays in eval mode
    until the iteration ends or the generator is closed (inference mode holds only while a step runs)."""
    d = _setup(model, input_ids, attention_mask, max_new_tokens, sampling, eos_token_id, seed, vocab_limit)
    with _eval_mode(model):
        yield from _steps(model, d, max_new_tokens, sampling, vocab_limit, drafts, stats, compiled)


def _steps(model, d: _Decoding, max_new_tokens: int, sampling: SamplingOptions, vocab_limit,
           drafts: DraftOptions | Drafter | None, stats: DecodeStats | None,
           compiled: bool = False) -> Iterator[tuple[list[int], list[int]]]:
    """The KV-cached loop: speculative where drafts are asked for and decoding is greedy, compiled on a static
    cache where asked, else plain."""
    if compiled:
        if drafts is not None and sampling.greedy:
            raise ValueError("compiled decoding and speculative drafts do not combine: ask for one of them")
        why = static_decoding.unsupported(model)
        if why:
            raise ValueError(why)
        return static_decoding.static_steps(model, d.input_ids, d.mask, max_new_tokens=max_new_tokens,
                                            sampling=sampling, generators=d.generators, stop=d.stop,
                                            fallback=d.fallback, vocab_limit=vocab_limit)
    if drafts is not None and sampling.greedy:
        drafts = usable_drafts(model, drafts)  # none where the cache cannot take guesses back and `auto` chose
    if drafts is None or not sampling.greedy:
        return _cached_steps(model, d, max_new_tokens, sampling, vocab_limit)
    stop = [] if d.stop is None else d.stop.tolist()
    drafter = drafts if isinstance(drafts, Drafter) else Drafter(drafts)
    return speculative_steps(model, d.input_ids, d.mask, stop=stop, fallback=d.fallback, max_new_tokens=max_new_tokens,
                             vocab_limit=vocab_limit, drafter=drafter, stats=DecodeStats() if stats is None else stats)


def _cached_steps(model, d: _Decoding, max_new_tokens: int, sampling: SamplingOptions,
                  vocab_limit) -> Iterator[tuple[list[int], list[int]]]:
    """The KV-cached decoding loop: yields (live rows, their new tokens) after each sampling step, before the
    stop check and the next forward (so a consumer that stops at a stop id runs no forward past it)."""
    if max_new_tokens == 0:
        return
    batch, scores = BatchCache.prefill(model, d.input_ids, d.mask)
    live = list(range(d.input_ids.shape[0]))  # batch row -> index of the prompt it decodes
    generators = d.generators
    for n in range(max_new_tokens):
        tokens = next_tokens(scores, sampling, generators, fallback_id=d.fallback, vocab_limit=vocab_limit)
        yield live, tokens.tolist()
        if n == max_new_tokens - 1:
            break
        stopped = torch.isin(tokens, d.stop) if d.stop is not None else None
        if stopped is not None and bool(stopped.any()):
            keep = (~stopped).nonzero().flatten()  # [live']
            if keep.numel() == 0:
                break
            batch.select(keep)
            live = [live[i] for i in keep.tolist()]
            generators = [generators[i] for i in keep.tolist()]
            tokens = tokens[keep]
        scores = batch.step(model, tokens)


def _decode_recompute(model, d: _Decoding, max_new_tokens: int, sampling: SamplingOptions,
                      vocab_limit) -> list[list[int]]:
    seq, mask = d.input_ids, d.mask
    b = seq.shape[0]
    results: list[list[int]] = [[] for _ in range(b)]
    running = [True] * b
    for _ in range(max_new_tokens):
        positions = model.prompt_positions(seq, mask)
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
