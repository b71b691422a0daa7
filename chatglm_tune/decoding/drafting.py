"""Drafts for speculative greedy decoding, looked up in tokens already there: no draft model.

An extraction answer copies most of its tokens from the text it reads (subjects and objects are spans of the
input), and the rest (relation names, separators) from the answers before it: the tokens that followed the
last n tokens' latest earlier occurrence are a good guess of what comes next. `guess` looks, for the longest
n first (`DraftOptions.ngram_max` down to `ngram_min`), in the row's answer so far, then in the answers of the
run's earlier rows (`AnswerPool`, where the caller keeps one: infer.py does, for its run), then in the whole
prompt. On the shipped SPO dev set, with the README main job's model, guesses from a row's own prompt and
answer gave 1.50 tokens a forward, with the pool too 2.20 (its greedy answers replayed through the guessing). Each
row adapts its draft length to what it has been taking (`next_length`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from chatglm_tune.decoding.adaptive import SpeculationChooser
from chatglm_tune.options import DraftOptions


def follow(tokens: Sequence[int], n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last `n` tokens of `tokens`
    (an occurrence may overlap the last n themselves); [] when there is none."""
    length = len(tokens)
    if not 0 < n < length:
        return []
    pattern = list(tokens[length - n:])
    first = pattern[0]
    for start in range(length - n - 1, -1, -1):
        if tokens[start] == first and list(tokens[start:start + n]) == pattern:
            return list(tokens[start + n:start + n + k])
    return []


class AnswerPool:
    """The last `size` answers of a run's finished rows, each n-gram (n <= ngram_max) indexed at its latest
    occurrence, to guess from in O(1)."""

    def __init__(self, size: int, ngram_max: int):
        self.ngram_max = ngram_max
        self._answers: collections.OrderedDict[int, list[int]] = collections.OrderedDict()
        self._size = size
        self._serial = 0
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (answer serial, end of the n-gram)

    def add(self, answer: Sequence[int]) -> None:
        if self._size <= 0 or len(answer) < 2:
            return
        self._serial += 1
        self._answers[self._serial] = list(answer)
        while len(self._answers) > self._size:
            self._answers.popitem(last=False)
        for end in range(1, len(answer)):  # an n-gram followed by at least one token
            for n in range(1, min(self.ngram_max, end) + 1):
                self._index[tuple(answer[end - n:end])] = (self._serial, end)

    def follow(self, pattern: Sequence[int], k: int) -> list[int]:
        found = self._index.get(tuple(pattern))
        answer = None if found is None else self._answers.get(found[0])
        return [] if answer is None else answer[found[1]:found[1] + k]


def guess(tokens: Sequence[int], prompt_length: int, k: int, options: DraftOptions,
          pool: AnswerPool | None = None) -> list[int]:
    """Up to `k` guessed next tokens of a row whose prompt and answer so far are `tokens` (the prompt its first
    `prompt_length`): for each n from the longest, the row's answer, the pool, then the whole row."""
    if k <= 0:
        return []
    answer = tokens[prompt_length:]
    for n in range(min(options.ngram_max, len(tokens)), options.ngram_min - 1, -1):
        found = follow(answer, n, k) if len(answer) > n else []
        if not found and pool is not None:
            found = pool.follow(tokens[len(tokens) - n:], k)
        found = found or follow(tokens, n, k)
        if found:
            return found
    return []


def next_length(options: DraftOptions, length: int, drafted: int, accepted: int) -> int:
    """A row's draft length after a step where it guessed `drafted` tokens and the model agreed with the first
    `accepted`: twice as many after a full take (up to `max_draft`), else one more than it took."""
    if drafted == 0:
        return length
    return min(2 * length, options.max_draft) if accepted == drafted else max(1, accepted + 1)


class Drafter:
    """One run's guessing (`generate` over batches of rows): a draft length per live row, keyed by the caller,
    and the answers of the run's finished rows (`DraftOptions.pool_answers`)."""

    def __init__(self, options: DraftOptions):
        self.options = options
        self.chooser = SpeculationChooser() if options.auto else None  # which steps guess (`adaptive`), kept over calls
        self.pool = AnswerPool(options.pool_answers, options.ngram_max) if options.pool_answers else None
        self._lengths: dict[int, int] = {}

    def draft(self, row: int, tokens: Sequence[int], prompt_length: int, limit: int) -> list[int]:
        """At most `limit` guessed next tokens of `row`."""
        k = min(self._lengths.setdefault(row, self.options.first_draft), limit)
        return guess(tokens, prompt_length, k, self.options, self.pool)

    def update(self, row: int, drafted: int, accepted: int) -> None:
        self._lengths[row] = next_length(self.options, self._lengths[row], drafted, accepted)

    def finished(self, row: int, answer: Sequence[int]) -> None:
        """`row` is done with `answer`: later rows may guess from it."""
        self._lengths.pop(row, None)
        if self.pool is not None:
            self.pool.add(answer)
