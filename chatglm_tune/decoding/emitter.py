"""The engine's sampler and emitter: each running row's next token, sampled with its request's own options
and generator, handed to its request, and the end of the rows that stop (a stop id, the budget).

Rows of equal sampling options and fallback id sample together through `sampling.next_tokens`, which treats
each row alone, with the generator its request's seed made (seeded as `generate` seeds a batch of one), so
a request draws what `generate` draws for its prompt alone.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from chatglm_tune.decoding.request import FINISH_LENGTH, FINISH_STOP, Request
from chatglm_tune.decoding.sampling import next_tokens, row_generators


@dataclass(eq=False)
class Row:
    """A running request: its generator, how many tokens it has, the token it feeds next."""

    request: Request
    generator: torch.Generator | None
    generated: int = 0
    pending: int = 0  # the last token sampled, fed at the next step


class Emitter:
    """Samples and hands over tokens for a model whose config stops on `default_stop` (a request's own stop
    ids rule where it has some); ids >= `vocab_limit` (the tokenizer's size) are never produced."""

    def __init__(self, default_stop: list[int], vocab_limit: int | None, device):
        self.default_stop = default_stop
        self.vocab_limit = vocab_limit
        self.device = device

    def row(self, request: Request) -> Row:
        return Row(request, row_generators(request.seed, 1, self.device)[0])

    def emit(self, rows: list[Row], scores: torch.Tensor) -> list[bool]:
        """Sample each row's next token from its scores [rows, V] and hand it over; which rows go on (False:
        finished, and told so)."""
        keep = []
        for row, token in zip(rows, self._sample(rows, scores)):
            request = row.request
            row.pending, row.generated = token, row.generated + 1
            request.on_token(token)
            if token in self._stop_ids(request):
                request.on_finish(FINISH_STOP, None)
            elif row.generated >= request.max_new_tokens:
                request.on_finish(FINISH_LENGTH, None)
            else:
                keep.append(True)
                continue
            keep.append(False)
        return keep

    def _stop_ids(self, request: Request):
        return request.stop_ids or self.default_stop

    def _sample(self, rows: list[Row], scores: torch.Tensor) -> list[int]:
        groups: dict[tuple, list[int]] = collections.defaultdict(list)
        for i, row in enumerate(rows):
            groups[(row.request.sampling, self._stop_ids(row.request)[0])].append(i)
        tokens = [0] * len(rows)
        for (sampling, fallback), members in groups.items():
            picked = next_tokens(scores[members], sampling, [rows[i].generator for i in members], fallback_id=fallback,
                                 vocab_limit=self.vocab_limit)
            for i, token in zip(members, picked.tolist()):
                tokens[i] = token
        return tokens
