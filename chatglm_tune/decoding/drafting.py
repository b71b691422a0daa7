"""Drafts for speculative greedy decoding, looked up in a row's own tokens (prompt lookup): no draft model.

An extraction answer copies most of its tokens from the text it reads (subjects and objects are spans of
the input), so the tokens that followed the last n tokens' latest earlier occurrence are a good guess of
what comes next. `options.DraftOptions` holds the lengths; each row adapts its draft length to what it
has been taking.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatglm_tune.options import DraftOptions


def lookup(tokens: Sequence[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of `tokens`, for
    the longest n in [ngram_min, ngram_max] that occurs earlier; [] when none does."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        pattern = list(tokens[length - n:])
        first = pattern[0]
        for start in range(length - n - 1, -1, -1):  # latest first; the match may overlap the pattern's own end
            if tokens[start] == first and list(tokens[start:start + n]) == pattern:
                return list(tokens[start + n:start + n + k])
    return []


def next_length(options: DraftOptions, length: int, drafted: int, accepted: int) -> int:
    """A row's draft length after a step where it guessed `drafted` tokens and the model agreed with the first
    `accepted`: twice as many after a full take (up to `max_draft`), else one more than it took."""
    if drafted == 0:
        return length
    return min(2 * length, options.max_draft) if accepted == drafted else max(1, accepted + 1)


class PromptLookup:
    """A draft length per row (keyed by the caller's row id), adapted to the row's acceptance."""

    def __init__(self, options: DraftOptions):
        self.options = options
        self._lengths: dict[int, int] = {}

    def draft(self, row: int, tokens: Sequence[int], limit: int) -> list[int]:
        """At most `limit` guessed next tokens of the row whose tokens so far are `tokens`."""
        k = min(self._lengths.setdefault(row, self.options.first_draft), limit)
        if k <= 0:
            return []
        return lookup(tokens, k, self.options.ngram_max, self.options.ngram_min)

    def update(self, row: int, drafted: int, accepted: int) -> None:
        """After a step where the row guessed `drafted` tokens and the model agreed with the first `accepted`."""
        self._lengths[row] = next_length(self.options, self._lengths[row], drafted, accepted)
