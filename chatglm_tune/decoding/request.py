"""A decoding job as the engine takes it: a prompt's ids, an answer budget, sampling options, a seed and stop ids,
the two callbacks that hand its tokens and its end back to whoever asked, and optionally a grammar its answer keeps
to."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chatglm_tune.decoding.sampling import SEED_MAX, SEED_MIN
from chatglm_tune.options import DEFAULT_SAMPLING, SamplingOptions

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"


@dataclass(eq=False)
class Request:
    """One decoding job. `on_token(token_id)` gets each new id (the stop id that ended it included) and
    `on_finish(reason, error)` once at the end (`FINISH_*`; `error` a message with FINISH_ERROR), both on
    the engine's thread: they must be quick and must not raise."""

    prompt: Sequence[int]
    max_new_tokens: int
    on_token: Callable[[int], None]
    on_finish: Callable[[str, str | None], None]
    sampling: SamplingOptions = DEFAULT_SAMPLING
    seed: int | None = None
    stop_ids: Sequence[int] = ()
    # With `logprobs` (how many alternatives, 0 or more), `on_logprob(logprob, top)` gets, before each new id, its log
    # probability under the model (its scores' log-softmax, before sampling options) and the `logprobs` likeliest ids
    # with theirs, ((id, logprob), ...), on the engine's thread.
    logprobs: int | None = None
    on_logprob: Callable[[float, tuple[tuple[int, float], ...]], None] | None = None
    # With `constraint` (a `grammar.Constraint` of its own), each new id is one its grammar allows (the stop ids once
    # the grammar is complete); the engine moves it on by each id.
    constraint: object | None = None
    cancelled: bool = False  # set by `Engine.cancel`; the engine drops the request at its next step

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("a request needs a prompt of at least one token")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer from {SEED_MIN} to {SEED_MAX}, got {self.seed!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and self.logprobs >= 0
                                              and self.on_logprob is not None):
            raise ValueError(f"logprobs must be an integer >= 0 with an on_logprob callback, got {self.logprobs!r}")
