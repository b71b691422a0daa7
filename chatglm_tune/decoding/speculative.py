"""Speculative greedy decoding: each row guesses its next tokens from its own (`drafting`), one forward checks
every row's guesses, and each row keeps the guesses the model agrees with plus the model's own next token.

The ids are plain greedy decoding's, token for token, up to the float rounding of a forward over several
positions instead of one (a near-tie of the two best scores can fall either way, as between batch sizes):
a guess is kept only where it is the argmax of the scores before it, and the token after the last kept
guess is the argmax there, as the plain loop would pick. A step costs one forward of (1 + guesses) rows a
row; decoding is bound by reading the weights once a step, so that is about the cost of one token. With the
integer-dot INT8 / INT4 kernels every row of a layer rounds alike whatever the rows beside it (their
activations are rounded to integers row by row), but a float difference elsewhere (the attention over several
queries) can move an activation across a rounding step: a quantized model's rows then differ as they do
between batch sizes.

The cache (`batch_cache.BatchCache.verify` / `accept`) takes each row's pending token and its guesses, then
keeps, per row, the pending token and the accepted guesses: rows that kept fewer are shifted right (left
padded), so the batch stays one left-padded cache. Rows stop on a stop id or the budget as in `generate`.
A model whose cache holds recurrent states (linear attention: GLM-5.3-Flash's KDA layers; its class says
`recurrent_cache`) cannot take rejected guesses back out of them: it decodes plainly where speculation was left to
choose itself (`DraftOptions.auto`), and refuses it where asked for (`usable_drafts`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from chatglm_tune.decoding.adaptive import timed
from chatglm_tune.decoding.batch_cache import BatchCache
from chatglm_tune.decoding.drafting import Drafter
from chatglm_tune.decoding.sampling import next_tokens
from chatglm_tune.options import DEFAULT_SAMPLING, DraftOptions


@dataclass
class DecodeStats:
    """What a speculative run did after the prefill: forwards, the rows they ran (a forward of a batch runs
    each live row once), the tokens they gave, guesses made and kept."""

    forwards: int = 0
    row_forwards: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_forward(self) -> float:
        """A row's tokens per forward (1.0 without speculation)."""
        return self.tokens / self.row_forwards if self.row_forwards else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def refusal(model) -> str | None:
    """Why speculative decoding cannot run on `model` (its cache holds recurrent states: the module docstring), or
    None."""
    if getattr(model, "recurrent_cache", False):
        return (f"{type(model).__name__} keeps recurrent states (linear attention) that cannot take rejected guesses "
                "back: it decodes without speculative drafts")
    return None


def usable_drafts(model, drafts: DraftOptions | Drafter | None) -> DraftOptions | Drafter | None:
    """`drafts` as `model` decodes with them: None where it cannot speculate (`refusal`) and speculation was to choose
    itself (`DraftOptions.auto`); ValueError where it was asked for outright."""
    why = None if drafts is None else refusal(model)
    if why is None:
        return drafts
    options = drafts.options if isinstance(drafts, Drafter) else drafts
    if options.auto:
        return None
    raise ValueError(f"speculative decoding: {why}")


def speculative_steps(model, ids: torch.Tensor, mask: torch.Tensor | None, *, stop: Sequence[int], fallback: int,
                      max_new_tokens: int, vocab_limit: int | None, drafter: Drafter,
                      stats: DecodeStats) -> Iterator[tuple[list[int], list[int]]]:
    """`generation`'s greedy loop with guesses: yields (the prompt index of each row with a token, its token),
    one token a row a yield, as the plain loop does (a forward may give a row several). `drafter` guesses,
    and learns each finished row's answer."""
    if max_new_tokens == 0:
        return
    stop = set(stop)
    batch, scores = BatchCache.prefill(model, ids, mask)
    history = [row[m.bool()].tolist() for row, m in zip(ids, torch.ones_like(ids) if mask is None else mask)]
    prompt_lengths = [len(tokens) for tokens in history]
    live = list(range(len(history)))  # batch row -> prompt index
    emitted = [[t] for t in _greedy(scores, fallback, vocab_limit)]
    while True:
        yield from _columns(live, emitted)
        going = []
        for i, r in enumerate(live):
            history[r] += emitted[i]
            if history[r][-1] in stop or len(history[r]) - prompt_lengths[r] >= max_new_tokens:
                drafter.finished(r, history[r][prompt_lengths[r]:])
            else:
                going.append(i)
        if not going:
            return
        if len(going) < len(live):
            batch.select(torch.tensor(going, device=ids.device))
            live = [live[i] for i in going]
        speculate = drafter.chooser is None or drafter.chooser.speculate(len(live))
        guesses = [drafter.draft(r, history[r], prompt_lengths[r],
                                 max_new_tokens - (len(history[r]) - prompt_lengths[r]) - 1)
                   if speculate else [] for r in live]
        emitted, seconds = timed(lambda: _step(model, batch, [history[r][-1] for r in live], guesses, stop, fallback,
                                               vocab_limit))
        if drafter.chooser is not None:
            drafter.chooser.record(len(live), speculate, seconds, sum(map(len, emitted)))
        for r, guess, out in zip(live, guesses, emitted):
            if speculate:
                drafter.update(r, len(guess), len(out) - 1)
            stats.drafted += len(guess)
            stats.accepted += len(out) - 1
            stats.tokens += len(out)
        stats.forwards += 1
        stats.row_forwards += len(live)


def _step(model, batch: BatchCache, pending: list[int], guesses: list[list[int]], stop: set[int], fallback: int,
          vocab_limit) -> list[list[int]]:
    """One forward over each row's pending token and guesses: each row's new tokens (kept guesses + one)."""
    if not any(guesses):
        scores = batch.step(model, torch.tensor(pending, device=batch.mask.device))
        return [[t] for t in _greedy(scores, fallback, vocab_limit)]
    scores = batch.verify(model, pending, guesses)
    width = scores.shape[1]
    targets = _greedy(scores.reshape(-1, scores.shape[-1]), fallback, vocab_limit)
    out = [agreed(guess, targets[i * width:(i + 1) * width], stop) for i, guess in enumerate(guesses)]
    batch.accept([len(tokens) for tokens in out])
    return out


def agreed(guess: Sequence[int], targets: Sequence[int], stop) -> list[int]:
    """A row's new tokens after a check: its guesses up to the first the model's argmax `targets` (at the
    row's pending token and at each guess) disagrees with, or that is a stop id, then the model's own."""
    n = 0
    while n < len(guess) and guess[n] == targets[n] and targets[n] not in stop:
        n += 1
    return list(guess[:n]) + [targets[n]]


def _greedy(scores: torch.Tensor, fallback: int, vocab_limit) -> list[int]:
    return next_tokens(scores, DEFAULT_SAMPLING, [None] * scores.shape[0], fallback_id=fallback,
                       vocab_limit=vocab_limit).tolist()


def _columns(live: list[int], emitted: list[list[int]]) -> Iterator[tuple[list[int], list[int]]]:
    """The tokens of one forward, one a row a yield: the rows that have a j-th token, for each j."""
    for j in range(max(len(tokens) for tokens in emitted)):
        has = [i for i, tokens in enumerate(emitted) if len(tokens) > j]
        yield [live[i] for i in has], [emitted[i][j] for i in has]
