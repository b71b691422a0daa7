"""Samplers: small pure functions on a `[b, V]` float score tensor, and one random generator a row.

Applied in this order by `next_tokens`:
1. `guard_invalid_scores`: a row holding any NaN or +-inf (an fp16 overflow, a broken checkpoint) is
   replaced by a row that can only pick `fallback_id` (the `<eop>` id in `generate`), so a numerically
   broken row stops instead of emitting garbage. The official `InvalidScoreLogitsProcessor` instead
   zeroes the *whole batch* and forces id 5 (`▁`) whenever one value is invalid; ours touches only the
   broken rows and never invents text.
2. `limit_vocab`: ids >= `vocab_limit` get -inf (and, for a constrained row, the ids its grammar does not allow).
   ChatGLM-6B's embedding has 130528 rows but its tokenizer 130344 pieces; ids in between cannot be decoded (the
   tokenizer raises on them).
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
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from chatglm_tune.options import SamplingOptions

# The seeds `torch.Generator.manual_seed` takes: a 64-bit integer, signed or not (a negative one is read modulo 2**64).
SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 64 - 1


def guard_invalid_scores(scores: torch.Tensor, fallback_id: int) -> torch.Tensor:
    """[b, V] -> [b, V]: rows with any NaN/+-inf become 0 at `fallback_id` and -inf elsewhere."""
    bad = ~torch.isfinite(scores).all(dim=-1)  # [b]
    if not bool(bad.any()):
        return scores
    warnings.warn(f"{int(bad.sum())} row(s) of scores held NaN/inf; they emit token {fallback_id} instead",
                  RuntimeWarning)
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


def draw(sorted_probs: torch.Tensor, sorted_ids: torch.Tensor,
         generators: Sequence[torch.Generator | None]) -> torch.Tensor:
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
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The next token of each row, [b] long, from the last-position scores [b, V] (see module docstring); with
    `allowed` ([b, V] bool: a grammar's), each row among its allowed ids only."""
    scores = limit_vocab(guard_invalid_scores(scores.float(), fallback_id), vocab_limit)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
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
