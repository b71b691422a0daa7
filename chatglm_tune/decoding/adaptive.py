"""Speculation that picks itself (`DraftOptions.auto`): each step of speculative decoding either checks the rows'
guesses or decodes plainly, whichever has given a token in less time at this many live rows.

Whether guessing pays depends on the machine, the model and the batch: checking k guesses a row costs k more
positions a forward, which is nearly free where a step is bound by reading the weights (one row, a small model's
Python bookkeeping) and costs in full where it is bound by arithmetic (many rows: plain decoding already shares
each weight read among them). Measured on the README main job's model: 1.59x plain at batch 1 and 0.69x at batch
8 on an AVX2 EPYC. So the choice is made from what this run measures: for each bucket of live rows (1, 2, 3-4,
5-8, ... rows) the seconds a generated token of each kind of step (an exponential average), each kind tried first
(`WARM_UP` steps), then the faster one taken, the other tried again after `EXPLORE_EVERY` steps so that a change
(a row count that grows the cache, a busier machine) is seen; each try that confirms the choice doubles the steps
to the next (up to `EXPLORE_MAX`), one that overturns it starts them over. The tokens are the same either way: both
kinds are greedy decoding (`speculative`).
"""

from __future__ import annotations

import time

WARM_UP = 2  # steps of each kind a bucket tries before it chooses
EXPLORE_EVERY = 16  # a bucket's steps before it tries the kind it does not choose, at first
EXPLORE_MAX = 256  # ... and at most, after tries that confirmed its choice
DECAY = 0.7  # weight of a bucket's earlier average against a new step's seconds a token


def bucket(rows: int) -> int:
    """The power of two at or above `rows`: the rows a bucket of steps holds at most."""
    return 1 << max(0, rows - 1).bit_length()


class SpeculationChooser:
    """Per bucket of live rows: [plain, speculative] seconds a token (None: not tried), tries, and steps since the
    other kind was tried."""

    def __init__(self):
        self._seconds: dict[int, list[float | None]] = {}
        self._tries: dict[int, list[int]] = {}
        self._since: dict[int, int] = {}
        self._every: dict[int, int] = {}  # steps between tries of the other kind, now
        self._trying: dict[int, bool] = {}  # the choice a try of the other kind is testing

    def speculate(self, rows: int) -> bool:
        """Whether the next step of `rows` live rows checks guesses."""
        b = bucket(rows)
        tries = self._tries.setdefault(b, [0, 0])
        if min(tries) < WARM_UP:
            return tries[1] < tries[0]  # plain first, then in turn
        plain, spec = self._seconds[b]
        best = spec < plain
        self._since[b] = self._since.get(b, 0) + 1
        if self._since[b] >= self._every.setdefault(b, EXPLORE_EVERY):
            self._since[b] = 0
            self._trying[b] = best
            return not best
        return best

    def record(self, rows: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A step of `rows` live rows, of the kind `speculated`, took `seconds` for `tokens` tokens."""
        b = bucket(rows)
        per_token = seconds / max(tokens, 1)
        averages = self._seconds.setdefault(b, [None, None])
        earlier = averages[speculated]
        averages[speculated] = per_token if earlier is None else DECAY * earlier + (1 - DECAY) * per_token
        self._tries.setdefault(b, [0, 0])[speculated] += 1
        if b in self._trying:  # a try of the other kind: the choice stands (try later) or falls (try soon)
            kept = self._trying.pop(b) == (averages[1] < averages[0])
            self._every[b] = min(2 * self._every[b], EXPLORE_MAX) if kept else EXPLORE_EVERY


def timed(step):
    """(`step()`'s result, its seconds)."""
    start = time.perf_counter()
    result = step()
    return result, time.perf_counter() - start
