"""Continuous batching: one KV-cached decoding loop serving many requests, each as `generate` serves it alone.

A `Request` is a prompt's ids, an answer budget, sampling options, a seed and stop ids; `Engine.submit`
queues it. Each `Engine.step` (run on a thread of its own by `Engine.start`):
1. drops cancelled requests (a client gone, a stop string seen) from the queue and from the batch;
2. runs one cached step for the running batch (each row's last token in, its next token out), hands each
   token to its request (`Request.on_token`) and drops the rows that finished (a stop id, the budget);
3. prefills at most `prefill_tokens` prompt tokens: waiting requests while the batch has room
   (`max_batch`) and their prompts fit the budget together (one left-padded forward), or, for a prompt
   longer than the budget, its next chunk of `prefill_tokens` tokens (chunked prefill, over a cache of its
   own); a request whose prompt is all in hands over its first token and joins the running batch.
So a newcomer waits at most one step of the batch, and a running stream waits at most one prefill of
`prefill_tokens` tokens per step. ChatGLM-6B's prompt attends both ways (every prompt token sees the
whole prompt), so its prompts cannot be cut: a longer one is prefilled whole, alone.

Cache layout, as `generate`'s: every layer's keys/values `[rows, heads, P + L, D]`: the P-tuning prefix
(the model's first `pre_seq_len` entries), then the real tokens left-padded to a common length L; the 2D
mask `[rows, L]` covers the real tokens (1 = token, 0 = pad). Merging a prefilled group into the batch
inserts pads after the prefix of the shorter side; columns that no row uses any more (pads left by a long
row that finished) are cut, so the batch costs what its longest live row costs.

Exactness: masked pads weigh exactly 0 in attention and positions come from each row's own tokens
(`model.prompt_positions` / `next_positions`, or the mask), a request samples with its own generator
(seeded with its seed, as `generate` seeds a batch of one) and rows sample in groups of equal options with
`generation.next_tokens`, which treats each row alone. So a request's tokens are the ones `generate` gives
its prompt alone, up to the float rounding of batched matrix products.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from chatglm_tune import heap
from chatglm_tune.batches import SpecialIds, collate_prompts
from chatglm_tune.decoding.sampling import next_tokens, row_generators
from chatglm_tune.options import DEFAULT_SAMPLING, ServingOptions, SamplingOptions

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"

log = logging.getLogger("chatglm_tune.decoding.engine")


class QueueFull(RuntimeError):
    """The engine's queue holds `max_queue` requests already."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and admits nothing more."""


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
    cancelled: bool = False  # set by `Engine.cancel`; the engine drops the request at its next step

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("a request needs a prompt of at least one token")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")


@dataclass(eq=False)
class _Row:
    """A running request: its generator, how many tokens it has, the token it feeds next."""

    request: Request
    generator: torch.Generator | None
    generated: int = 0
    pending: int = 0  # the last token sampled, fed at the next step


@dataclass(eq=False)
class _Partial:
    """A long prompt being prefilled a chunk a step, in a cache of its own."""

    request: Request
    cache: DynamicCache
    done: int = 0  # prompt tokens in the cache


@dataclass
class _Batch:
    """The running rows and their shared cache (layout in the module docstring)."""

    rows: list[_Row]
    cache: DynamicCache
    mask: torch.Tensor  # [rows, L] long
    next_positions: torch.Tensor | None  # ChatGLM-6B's positions of each pending token; None for the others


class Engine:
    """The continuous-batching loop over one model (see the module docstring).

    `special`: the tokenizer's ids (`SpecialIds.of(tokenizer)`: the pad id prompts are padded with);
    `vocab_limit`: the tokenizer's size (larger ids are never produced). `options`: batch size, queue
    bound and prefill budget (`ServingOptions`).
    """

    def __init__(self, model, special: SpecialIds, *, vocab_limit: int | None, options: ServingOptions = ServingOptions()):
        self.model = model.eval()
        self.special = special
        self.vocab_limit = vocab_limit
        self.options = options
        self.device = next(model.parameters()).device
        self.prefix_len = getattr(model.config, "pre_seq_len", None) or 0
        self.default_stop = _as_list(model.config.eos_token_id)
        self._waiting: collections.deque[Request] = collections.deque()
        self._batch: _Batch | None = None
        self._partial: _Partial | None = None
        # ChatGLM-6B's prompts attend both ways (its model gives prompt positions; the others derive them from
        # the mask and attend causally): None until the first prompt over the prefill budget asks
        self._prompts_attend_both_ways: bool | None = None
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # decoding steps run (a step is one forward of the running batch)

    # ------------------------------------------------------------------------------------------
    # The caller's side (any thread)

    def submit(self, request: Request) -> None:
        """Queue `request`; QueueFull when the batch is full and `max_queue` requests wait beyond it already,
        EngineClosed while shutting down."""
        with self._wake:
            if self._closing:
                raise EngineClosed("the server is shutting down")
            limit = self.options.max_queue
            if limit is not None and len(self._waiting) >= limit + max(0, self._room()):
                raise QueueFull(f"{self.running} requests are running and {len(self._waiting)} waiting (the queue "
                                f"holds {limit} beyond a batch of {self.options.max_batch})")
            self._waiting.append(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """Drop `request` at the next step (its slot is free for the next newcomer); it finishes FINISH_CANCELLED
        unless it finished first."""
        request.cancelled = True
        with self._wake:
            self._wake.notify()

    def _idle(self) -> bool:
        return not self._waiting and self._batch is None and self._partial is None

    @property
    def running(self) -> int:
        batch = self._batch
        return 0 if batch is None else len(batch.rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> "Engine":
        """Run `step` on a daemon thread until `close`."""
        self._thread = threading.Thread(target=self._loop, name="chatglm_tune-engine", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Admit nothing more, cancel what waits and runs, and stop the thread (within `timeout` seconds)."""
        with self._wake:
            self._closing = True
            for request in self._waiting:
                request.cancelled = True
            if self._batch is not None:
                for row in self._batch.rows:
                    row.request.cancelled = True
            if self._partial is not None:
                self._partial.request.cancelled = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------
    # The loop

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                if self._idle():
                    heap.trim()  # the batch's cache is freed: give its pages back before waiting
                with self._wake:
                    while self._idle() and not self._closing:
                        self._wake.wait()
                    if self._closing and self._idle():
                        return
                try:
                    self.step()
                except Exception as err:  # a failed forward (out of memory, a broken layer): fail its requests, go on
                    log.exception("a decoding step failed: its requests end with an error")
                    self._fail_all(f"{type(err).__name__}: {err}")

    @torch.inference_mode()
    def step(self) -> None:
        """Drop cancelled requests, run one step of the running batch, prefill newcomers (or a chunk)."""
        self._drop_cancelled()
        if self._batch is not None:
            self._decode()
        if self._partial is None:
            self._partial = self._long_prompt()
        if self._partial is not None:
            self._prefill_chunk(self._partial)
        else:
            admitted = self._admit()
            if admitted:
                self._prefill(admitted)

    def _drop_cancelled(self) -> None:
        with self._wake:
            gone = [r for r in self._waiting if r.cancelled]
            if gone:
                self._waiting = collections.deque(r for r in self._waiting if not r.cancelled)
        if self._partial is not None and self._partial.request.cancelled:
            gone.append(self._partial.request)
            self._partial = None
        for request in gone:
            request.on_finish(FINISH_CANCELLED, None)
        if self._batch is not None:
            finished = [row.request.cancelled for row in self._batch.rows]
            if any(finished):
                for row, done in zip(self._batch.rows, finished):
                    if done:
                        row.request.on_finish(FINISH_CANCELLED, None)
                self._keep([not done for done in finished])

    def _room(self) -> int:
        return self.options.max_batch - self.running - (self._partial is not None)

    def _long_prompt(self) -> "_Partial | None":
        """The first waiting request, to prefill in chunks, when its prompt is over the budget and the model
        attends causally within a prompt (its positions come from the mask: `prompt_positions` is None)."""
        with self._wake:
            if not self._waiting or self._room() < 1 or len(self._waiting[0].prompt) <= self.options.prefill_tokens:
                return None
            head = self._waiting[0]
            if self._prompts_attend_both_ways is None:  # asked once, of the first long prompt
                try:
                    self._prompts_attend_both_ways = self.model.prompt_positions(torch.tensor([list(head.prompt)]),
                                                                                 None) is not None
                except ValueError:  # a prompt ChatGLM-6B cannot place (its prefill tells this request why)
                    self._prompts_attend_both_ways = True
            if self._prompts_attend_both_ways:
                return None  # ChatGLM-6B: prefilled whole
            self._waiting.popleft()
        return _Partial(head, DynamicCache())

    def _admit(self) -> list[Request]:
        """Waiting requests to prefill together: room in the batch, prompt tokens within the budget."""
        admitted: list[Request] = []
        tokens = 0
        with self._wake:
            room = self._room()
            while self._waiting and len(admitted) < room:
                n = len(self._waiting[0].prompt)
                if admitted and tokens + n > self.options.prefill_tokens:
                    break
                admitted.append(self._waiting.popleft())
                tokens += n
        return admitted

    def _prefill(self, requests: list[Request]) -> None:
        batch = collate_prompts([list(r.prompt) for r in requests], self.special)
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        model_mask = None if bool(mask.all()) else mask
        positions = self.model.prompt_positions(ids, model_mask)
        cache = DynamicCache()
        out = self._forward(requests, ids, position_ids=positions, attention_mask=model_mask, cache=cache)
        if out is not None:
            next_pos = None if positions is None else self.model.next_positions(positions[..., -1:])
            self._join(_Batch([self._row(r) for r in requests], cache, mask.long(), next_pos), out.logits[:, -1])

    def _prefill_chunk(self, partial: "_Partial") -> None:
        prompt = partial.request.prompt
        end = min(len(prompt), partial.done + self.options.prefill_tokens)
        ids = torch.tensor([list(prompt[partial.done:end])], device=self.device)
        out = self._forward([partial.request], ids, position_ids=None, attention_mask=None, cache=partial.cache)
        partial.done = end
        if out is None or end < len(prompt):
            self._partial = None if out is None else partial
            return
        self._partial = None
        mask = torch.ones(1, len(prompt), dtype=torch.long, device=self.device)
        self._join(_Batch([self._row(partial.request)], partial.cache, mask, None), out.logits[:, -1])

    def _forward(self, requests: list[Request], ids: torch.Tensor, **inputs):
        """The model on a prefill; None (the requests finished with FINISH_ERROR, the batch untouched) when it raises."""
        try:
            return self.model(ids, use_cache=True, logits_to_keep=1, **inputs)
        except Exception as err:  # out of memory, a broken layer: these requests fail, the running ones go on
            log.exception("a prefill failed: its requests end with an error")
            for request in requests:
                request.on_finish(FINISH_ERROR, f"{type(err).__name__}: {err}")
            return None

    def _row(self, request: Request) -> _Row:
        return _Row(request, row_generators(request.seed, 1, self.device)[0])

    def _join(self, group: _Batch, scores: torch.Tensor) -> None:
        """Prefilled rows: hand over their first token; the ones that go on join the running batch."""
        keep = self._emit(group.rows, scores)
        if not any(keep):
            return
        if not all(keep):
            _select(group, keep)
        self._batch = group if self._batch is None else self._merge(self._batch, group)

    def _decode(self) -> None:
        batch = self._batch
        tokens = torch.tensor([row.pending for row in batch.rows], device=self.device)
        mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.rows), 1)], dim=1)
        out = self.model(tokens[:, None], position_ids=batch.next_positions,
                         attention_mask=None if bool(mask.all()) else mask, cache=batch.cache, use_cache=True,
                         logits_to_keep=1)
        batch.mask = mask
        if batch.next_positions is not None:
            batch.next_positions = self.model.next_positions(batch.next_positions)
        self.steps += 1
        keep = self._emit(batch.rows, out.logits[:, -1])
        if not all(keep):
            self._keep(keep)

    def _emit(self, rows: list[_Row], scores: torch.Tensor) -> list[bool]:
        """Sample each row's next token, hand it over; which rows go on (False: finished, told so)."""
        tokens = self._sample(rows, scores)
        keep = []
        for row, token in zip(rows, tokens):
            request = row.request
            row.pending, row.generated = token, row.generated + 1
            request.on_token(token)
            stop_ids = request.stop_ids or self.default_stop
            if token in stop_ids:
                request.on_finish(FINISH_STOP, None)
            elif row.generated >= request.max_new_tokens:
                request.on_finish(FINISH_LENGTH, None)
            else:
                keep.append(True)
                continue
            keep.append(False)
        return keep

    def _sample(self, rows: list[_Row], scores: torch.Tensor) -> list[int]:
        """Each row's next token: rows of equal sampling options and fallback id sample together."""
        groups: dict[tuple, list[int]] = collections.defaultdict(list)
        for i, row in enumerate(rows):
            stop_ids = row.request.stop_ids or self.default_stop
            groups[(row.request.sampling, stop_ids[0])].append(i)
        tokens = [0] * len(rows)
        for (sampling, fallback), members in groups.items():
            picked = next_tokens(scores[members], sampling, [rows[i].generator for i in members], fallback_id=fallback,
                                 vocab_limit=self.vocab_limit)
            for i, token in zip(members, picked.tolist()):
                tokens[i] = token
        return tokens

    # ------------------------------------------------------------------------------------------
    # The batch's cache

    def _keep(self, keep: list[bool]) -> None:
        """Only the rows marked True stay; columns no remaining row uses are cut."""
        if not any(keep):
            self._batch = None
            return
        _select(self._batch, keep)
        self._trim(self._batch)

    def _trim(self, batch: _Batch) -> None:
        lead = int((batch.mask.cumsum(dim=1) == 0).sum(dim=1).min())  # pad columns every row has on its left
        if lead == 0:
            return
        p = self.prefix_len
        for layer in batch.cache.layers:
            layer.keys = torch.cat([layer.keys[..., :p, :], layer.keys[..., p + lead:, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :p, :], layer.values[..., p + lead:, :]], dim=-2)
        batch.mask = batch.mask[:, lead:]

    def _merge(self, a: _Batch, b: _Batch) -> _Batch:
        """`a`'s rows then `b`'s, in one cache: the shorter side left-padded after the prefix."""
        length = max(a.mask.shape[1], b.mask.shape[1])
        for layer_a, layer_b in zip(a.cache.layers, b.cache.layers, strict=True):
            for name in ("keys", "values"):
                parts = [self._pad_after_prefix(getattr(layer, name), length - mask.shape[1])
                         for layer, mask in ((layer_a, a.mask), (layer_b, b.mask))]
                setattr(layer_a, name, torch.cat(parts, dim=0))
        masks = [torch.cat([m.new_zeros(m.shape[0], length - m.shape[1]), m], dim=1) for m in (a.mask, b.mask)]
        a.mask = torch.cat(masks, dim=0)
        a.rows = a.rows + b.rows
        if a.next_positions is not None:
            a.next_positions = torch.cat([a.next_positions, b.next_positions], dim=0)
        return a

    def _pad_after_prefix(self, states: torch.Tensor, n: int) -> torch.Tensor:
        if n == 0:
            return states
        p = self.prefix_len
        pad = states.new_zeros(*states.shape[:-2], n, states.shape[-1])
        return torch.cat([states[..., :p, :], pad, states[..., p:, :]], dim=-2)

    def _fail_all(self, message: str) -> None:
        """A step raised: every running request ends with FINISH_ERROR; the engine goes on empty."""
        batch, self._batch = self._batch, None
        for row in batch.rows if batch is not None else ():
            row.request.on_finish(FINISH_ERROR, message)


def _select(batch: _Batch, keep: list[bool]) -> None:
    index = torch.tensor([i for i, k in enumerate(keep) if k], device=batch.mask.device)
    batch.cache.batch_select_indices(index)
    batch.rows = [row for row, k in zip(batch.rows, keep) if k]
    batch.mask = batch.mask[index]
    if batch.next_positions is not None:
        batch.next_positions = batch.next_positions[index]


def _as_list(ids) -> list[int]:
    return [ids] if isinstance(ids, int) else list(ids)
