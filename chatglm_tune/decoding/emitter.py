"""The engine's sampler and emitter: each running row's next token, sampled with its request's own options
and generator, handed to its request, and the end of the rows that stop (a stop id, the budget).

Rows of equal sampling options and fallback id sample together through `sampling.next_tokens`, which treats
each row alone, with the generator its request's seed made (seeded as `generate` seeds a batch of one), so
a request draws what `generate` draws for its prompt alone.

With `drafts`, a greedy row guesses its next tokens from its own prompt and answer (`drafting`); the engine
checks every row's guesses in one forward (`BatchCache.verify`) and `emit_verified` hands over the guesses
the model agrees with plus its next token, as `speculative` does for `generate`: the same tokens.

A request with a `grammar.Constraint` samples among the ids its grammar allows (and never guesses).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from chatglm_tune.decoding.drafting import guess, next_length
from chatglm_tune.decoding.request import FINISH_LENGTH, FINISH_STOP, Request
from chatglm_tune.decoding.sampling import next_tokens, row_generators
from chatglm_tune.decoding.scoring import token_logprobs
from chatglm_tune.decoding.speculative import agreed
from chatglm_tune.options import DEFAULT_SAMPLING, DraftOptions


@dataclass(eq=False)
class Row:
    """A running request: its generator, how many tokens it has, the token it feeds next."""

    request: Request
    generator: torch.Generator | None
    generated: int = 0
    pending: int = 0  # the last token sampled, fed at the next step
    history: list[int] = field(default_factory=list)  # prompt and answer so far (where the row guesses)
    draft_length: int = 0  # tokens the row guesses at its next step (0: it does not)


class Emitter:
    """Samples and hands over tokens for a model whose config stops on `default_stop` (a request's own stop
    ids rule where it has some); ids >= `vocab_limit` (the tokenizer's size) are never produced."""

    def __init__(self, default_stop: list[int], vocab_limit: int | None, device, drafts: DraftOptions | None = None):
        self.default_stop = default_stop
        self.vocab_limit = vocab_limit
        self.device = device
        self.drafts = drafts

    def row(self, request: Request) -> Row:
        guesses = self.drafts is not None and request.sampling.greedy and request.constraint is None
        return Row(request, row_generators(request.seed, 1, self.device)[0],
                   history=list(request.prompt) if guesses else [],
                   draft_length=self.drafts.first_draft if guesses else 0)

    def emit(self, rows: list[Row], scores: torch.Tensor) -> list[bool]:
        """Sample each row's next token from its scores [rows, V] and hand it over; which rows go on (False:
        finished, and told so)."""
        tokens = self._sample(rows, scores)
        return [self._hand(row, token, scores[i]) for i, (row, token) in enumerate(zip(rows, tokens))]

    def guesses(self, rows: list[Row]) -> list[list[int]]:
        """Each row's guessed next tokens (none for rows that sample, or that find no match), within its budget,
        from its own prompt and answer only: one request's text never changes how fast another's comes."""
        return [guess(row.history, len(row.request.prompt),
                      min(row.draft_length, row.request.max_new_tokens - row.generated - 1), self.drafts)
                for row in rows]

    def emit_verified(self, rows: list[Row], scores: torch.Tensor,
                      guesses: list[list[int]]) -> tuple[list[int], list[bool]]:
        """After `BatchCache.verify` (scores [rows, W, V] after each row's pending token and guesses): hand each row
        its agreed guesses and next token. (The cache columns each row keeps, which rows go on.)"""
        firsts = self._sample(rows, scores[:, 0])
        kept, keep = [], []
        for i, (row, guessed) in enumerate(zip(rows, guesses)):
            tokens = [firsts[i]]
            if guessed:
                stop = self._stop_ids(row.request)
                targets = next_tokens(scores[i, :len(guessed) + 1], DEFAULT_SAMPLING, [None] * (len(guessed) + 1),
                                      fallback_id=stop[0], vocab_limit=self.vocab_limit).tolist()
                tokens = agreed(guessed, targets, stop)
                row.draft_length = next_length(self.drafts, row.draft_length, len(guessed), len(tokens) - 1)
            going = all(self._hand(row, token, scores[i, j]) for j, token in enumerate(tokens))  # to the first end
            kept.append(len(tokens))
            keep.append(going)
        return kept, keep

    def _hand(self, row: Row, token: int, scores: torch.Tensor) -> bool:
        """Hand `token` (drawn from `scores` [V]) to the row's request, with its log probability where the request
        asks; whether the row goes on (False: finished, and told so)."""
        request = row.request
        row.pending, row.generated = token, row.generated + 1
        if row.draft_length:
            row.history.append(token)
        if request.logprobs is not None:
            request.on_logprob(*token_logprobs(scores[None], [token], request.logprobs, self.vocab_limit)[0])
        if request.constraint is not None:
            request.constraint.take(token, self._stop_ids(request))
        request.on_token(token)
        if token in self._stop_ids(request):
            request.on_finish(FINISH_STOP, None)
        elif row.generated >= request.max_new_tokens:
            request.on_finish(FINISH_LENGTH, None)
        else:
            return True
        return False

    def _stop_ids(self, request: Request):
        return request.stop_ids or self.default_stop

    def _sample(self, rows: list[Row], scores: torch.Tensor) -> list[int]:
        allowed = self._allowed(rows, scores)
        groups: dict[tuple, list[int]] = collections.defaultdict(list)
        for i, row in enumerate(rows):
            groups[(row.request.sampling, self._stop_ids(row.request)[0])].append(i)
        tokens = [0] * len(rows)
        for (sampling, fallback), members in groups.items():
            picked = next_tokens(scores[members], sampling, [rows[i].generator for i in members], fallback_id=fallback,
                                 vocab_limit=self.vocab_limit, allowed=None if allowed is None else allowed[members])
            for i, token in zip(members, picked.tolist()):
                tokens[i] = token
        return tokens

    def _allowed(self, rows: list[Row], scores: torch.Tensor) -> torch.Tensor | None:
        """[rows, V] bool: the ids each row may take (a constrained row's grammar's; every id for the others); None
        where no row is constrained."""
        constrained = [i for i, row in enumerate(rows) if row.request.constraint is not None]
        if not constrained:
            return None
        allowed = torch.ones(scores.shape, dtype=torch.bool)
        for i in constrained:
            grammar = rows[i].request.constraint.allowed(self._stop_ids(rows[i].request))[:scores.shape[-1]]
            allowed[i, :grammar.shape[0]] = grammar
            allowed[i, grammar.shape[0]:] = False
        return allowed.to(scores.device)
