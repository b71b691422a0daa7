"""Continuous batching: one KV-cached decoding loop serving many requests, each as `generate` serves it alone.

A `request.Request` is a prompt's ids, an answer budget, sampling options, a seed and stop ids;
`Engine.submit` queues it. Each `Engine.step` (run on a thread of its own by `Engine.start`):
1. drops cancelled requests (a client gone, a stop string seen) from the queue and from the batch;
2. runs one cached step of the running batch (each row's last token in, its next token out), hands each
   token to its request (`emitter`) and drops the rows that finished (a stop id, the budget);
3. prefills what the `scheduler` admits: newcomers in groups of near prompt length (`padding_groups`), a
   left-padded forward each, or the next chunk of a prompt longer than the prefill budget (over a cache of
   its own); a request whose prompt is all in hands over its first token and joins the running batch
   (`batch_cache.BatchCache.merge`).
When rows leave, the pad columns no remaining row uses are cut, so the batch costs what its longest live
row costs. With `options.compiled` the running batch lives in fixed buffers (`slot_cache.SlotCache`: a slot a
request, its steps one compiled function on bucketed shapes, CUDA graphs on a GPU) instead.

Exactness: a request's tokens are the ones `generate` gives its prompt alone, up to the float rounding of
batched matrix products: masked pads weigh exactly 0 and positions come from each row's own tokens
(`batch_cache`), and each request samples with its own generator (`emitter`). Greedy requests guess their
next tokens from their own prompt and answer where `options.drafts` is set, and a step checks all guesses
in one forward (speculative decoding: the same tokens, fewer steps; sampled requests decode plainly).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatglm_tune.data.batches import SpecialIds, collate_prompts
from chatglm_tune.decoding import slot_cache
from chatglm_tune.decoding.batch_cache import BatchCache
from chatglm_tune.decoding.emitter import Emitter, Row
from chatglm_tune.decoding.request import FINISH_CANCELLED, FINISH_ERROR, Request
from chatglm_tune.decoding.scheduler import Scheduler
from chatglm_tune.decoding.speculative import usable_drafts
from chatglm_tune.options import ServingOptions
from chatglm_tune.runtime import crashpoints, heap, openmp

log = logging.getLogger("chatglm_tune.decoding.engine")

# Newcomers prefilled together waste at most this share of a forward on left pads (`padding_groups`): 16 SPO
# prompts of 30-48 tokens padded to the longest were a quarter pads, and at ChatGLM3-6B size on a CPU a prefill
# costs by positions (compute-bound), so a group of near lengths costs less than a padded batch.
PREFILL_PADDING = 0.1
WARM_UP_TOKENS = 3  # tokens each warm-up request decodes (`warm_up`): two steps of its batch


@dataclass(eq=False)
class _Partial:
    """A long prompt being prefilled a chunk a step, in a cache of its own."""

    request: Request
    cache: BatchCache
    done: int = 0  # prompt tokens in the cache


class Engine:
    """The continuous-batching loop over one model (see the module docstring).

    `special`: the tokenizer's ids (`SpecialIds.of(tokenizer)`: the pad id prompts are padded with);
    `vocab_limit`: the tokenizer's size (larger ids are never produced). `options`: batch size, queue
    bound and prefill budget (`ServingOptions`).
    """

    def __init__(self, model, special: SpecialIds, *, vocab_limit: int | None,
                 options: ServingOptions = ServingOptions()):
        self.model = model.eval()
        self.special = special
        self.options = options
        self.device = next(model.parameters()).device
        why = slot_cache.unsupported(model) if options.compiled else None
        if why:
            raise ValueError(f"compiled serving: {why}")
        usable_drafts(model, options.drafts)  # ValueError where guesses were asked for and the cache cannot take them
        eos = model.config.eos_token_id
        self.scheduler = Scheduler(options)
        self.emitter = Emitter([eos] if isinstance(eos, int) else list(eos), vocab_limit, self.device, options.drafts)
        self._rows: list[Row] = []  # the running batch's rows, in the order of its cache's
        self._cache: BatchCache | None = None
        self._partial: _Partial | None = None
        self._taken: list[Request] = []  # out of the queue this step, being prefilled (a step that raises ends them)
        # ChatGLM-6B's prompts attend both ways (its model gives prompt positions; the others derive them from
        # the mask and attend causally): None until the first prompt over the prefill budget asks
        self._prompts_attend_both_ways: bool | None = None
        self._thread: threading.Thread | None = None
        self._unfinished = 0  # submitted requests whose on_finish has not run (`unfinished`)
        self._count_lock = threading.Lock()
        self.steps = 0  # decoding steps run (a step is one forward of the running batch)
        self.model_lock = threading.Lock()  # held by each step: another forward of the model takes it (`scoring`)

    # ------------------------------------------------------------------------------------------
    # The caller's side (any thread)

    def submit(self, request: Request) -> None:
        """Queue `request`; QueueFull when the batch is full and `max_queue` requests wait beyond it already,
        EngineClosed while shutting down. Its `on_finish` runs once: a later end (a failed step ending every
        request it held, one that had just finished included) is not handed over."""
        finish = request.on_finish
        ended = False

        def finished(reason: str, error: str | None) -> None:
            nonlocal ended
            with self._count_lock:
                if ended:
                    return
                ended = True
                self._unfinished -= 1
            finish(reason, error)

        with self._count_lock:  # counted before the engine's thread can finish it
            request.on_finish = finished
            try:
                self.scheduler.submit(request, running=self.running, room=self._room())
            except Exception:
                request.on_finish = finish
                raise
            self._unfinished += 1

    def cancel(self, request: Request) -> None:
        """Drop `request` at the next step (its slot is free for the next newcomer); it finishes FINISH_CANCELLED
        unless it finished first."""
        request.cancelled = True
        self.scheduler.notify()

    @property
    def idle(self) -> bool:
        """Nothing waits, runs or is being prefilled."""
        return not len(self.scheduler) and not self._rows and self._partial is None

    @property
    def unfinished(self) -> int:
        """Requests submitted whose end has not been handed back yet. Unlike `idle`, exact from any thread: a
        request being prefilled is out of the queue and not yet in the batch (its first token already sent)."""
        return self._unfinished

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self.scheduler)

    def start(self, warm_up: list[int] | None = None) -> "Engine":
        """Run `step` on a daemon thread until `close`. The calling thread (the one that loaded the model, as a
        rule) hands its idle OpenMP workers back first, so that the engine's own team spins between parallel regions
        (`openmp.release_idle_team`). `warm_up`: a prompt the thread first runs `warm_up` with, returning once that
        is done (on the engine's thread, where compiled steps' CUDA graphs are then replayed)."""
        openmp.release_idle_team()
        ready = threading.Event()

        def run() -> None:
            try:
                if warm_up is not None:
                    self.warm_up(warm_up)
            except Exception:  # serving goes on: what the warm-up would have built is built at its first use instead
                log.exception("warming up failed")
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="chatglm_tune-engine", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def warm_up(self, prompt: list[int]) -> None:
        """Decode a few tokens of `prompt` before serving, on the calling thread (`start(warm_up=...)` runs it on
        the engine's), so that the first request waits for nothing of the kind: the CPU kernels the forward uses are
        built (or their builds waited for) and loaded; with `options.compiled`, the step is compiled, and recorded on
        a GPU, for every row bucket (that many requests of `prompt` at once: a new batch size would wait too)."""
        buckets = slot_cache.row_buckets(self.options.max_batch) if self.options.compiled else [1]
        for rows in buckets:
            for _ in range(rows):
                self.submit(Request(prompt, WARM_UP_TOKENS, on_token=lambda token: None, on_finish=lambda *_: None))
            while not self.idle:
                self.step()

    def close(self, timeout: float = 10.0) -> None:
        """Admit nothing more, cancel what waits and runs, and stop the thread (within `timeout` seconds)."""
        for row in list(self._rows):
            row.request.cancelled = True
        partial = self._partial
        if partial is not None:
            partial.request.cancelled = True
        self.scheduler.close()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------
    # The loop

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                if self.idle:
                    heap.trim()  # the batch's cache is freed: give its pages back before waiting
                if not self.scheduler.wait(lambda: self.idle):
                    return
                try:
                    with self.model_lock:
                        self.step()
                except Exception as err:  # a failed forward (out of memory, a broken layer): fail its requests, go on
                    log.exception("a decoding step failed: its requests end with an error")
                    self._fail_all(f"{type(err).__name__}: {err}")
                finally:
                    self._taken = []

    @torch.inference_mode()
    def step(self) -> None:
        """Drop cancelled requests, run one step of the running batch, prefill newcomers (or a chunk)."""
        crashpoints.reached("engine-step")
        self._drop_cancelled()
        if self._rows:
            self._decode()
        if self._partial is None:
            request = self.scheduler.take_long_prompt(self._room(), self._attends_both_ways)
            if request is not None:
                self._taken = [request]
                self._partial = _Partial(request, BatchCache.empty(self.model, self.device))
        if self._partial is not None:
            self._taken = [self._partial.request]
            self._prefill_chunk(self._partial)
        else:
            self._taken = self.scheduler.admit(self._room())
            if self._taken:
                self._prefill(self._taken)
        self._taken = []

    def _room(self) -> int:
        return self.options.max_batch - self.running - (self._partial is not None)

    def _attends_both_ways(self, request: Request) -> bool:
        """Whether the model's prompts attend both ways (asked once, of the first long prompt)."""
        if self._prompts_attend_both_ways is None:
            try:
                self._prompts_attend_both_ways = self.model.prompt_positions(torch.tensor([list(request.prompt)]),
                                                                             None) is not None
            except ValueError:  # a prompt ChatGLM-6B cannot place (its prefill tells this request why)
                self._prompts_attend_both_ways = True
        return self._prompts_attend_both_ways

    def _drop_cancelled(self) -> None:
        gone = self.scheduler.take_cancelled()
        if self._partial is not None and self._partial.request.cancelled:
            gone.append(self._partial.request)
            self._partial = None
        for request in gone:
            request.on_finish(FINISH_CANCELLED, None)
        cancelled = [row.request.cancelled for row in self._rows]
        if any(cancelled):
            for row, done in zip(self._rows, cancelled):
                if done:
                    row.request.on_finish(FINISH_CANCELLED, None)
            self._keep([not done for done in cancelled])

    # ------------------------------------------------------------------------------------------
    # Prefill and decode

    def _prefill(self, requests: list[Request]) -> None:
        """Newcomers in groups of prompts of near length (`padding_groups`), a left-padded forward each, shortest
        first; each group's first tokens go out as soon as its forward is done. A prompt several requests share (the
        `n` answers of one) is run once, its cache rows and scores copied to each."""
        for group in padding_groups(requests):
            prompts = [tuple(r.prompt) for r in group]
            unique = list(dict.fromkeys(prompts))
            batch = collate_prompts([list(p) for p in unique], self.special)
            ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
            copies = None if len(unique) == len(group) else torch.tensor([unique.index(p) for p in prompts],
                                                                         device=self.device)

            def prefill(group=group, ids=ids, mask=mask, copies=copies):  # the rows first: a request they refuse
                rows = [self.emitter.row(r) for r in group]  # fails its group alone
                cache, scores = BatchCache.prefill(self.model, ids, mask)
                if copies is not None:
                    cache.select(copies)
                    scores = scores[copies]
                return rows, cache, scores

            prefilled = self._guarded(group, prefill)
            if prefilled is not None:
                self._join(*prefilled)

    def _prefill_chunk(self, partial: _Partial) -> None:
        prompt = partial.request.prompt
        end = min(len(prompt), partial.done + self.options.prefill_tokens)
        ids = torch.tensor([list(prompt[partial.done:end])], device=self.device)
        scores = self._guarded([partial.request], lambda: partial.cache.extend(self.model, ids))
        partial.done = end
        if scores is None or end < len(prompt):
            self._partial = None if scores is None else partial
            return
        self._partial = None
        self._join([self.emitter.row(partial.request)], partial.cache, scores)

    def _guarded(self, requests: list[Request], prefill: Callable):
        """`prefill()`, its layers' freed memory trimmed once at the end (`heap.one_trim`: the time to the first
        token); None (the requests finished with FINISH_ERROR, the batch untouched) when it raises."""
        try:
            with heap.one_trim():
                return prefill()
        except Exception as err:  # out of memory, a broken layer: these requests fail, the running ones go on
            log.exception("a prefill failed: its requests end with an error")
            for request in requests:
                request.on_finish(FINISH_ERROR, f"{type(err).__name__}: {err}")
            return None

    def _join(self, rows: list[Row], cache: BatchCache, scores: torch.Tensor) -> None:
        """Prefilled rows: hand over their first token; the ones that go on join the running batch."""
        keep = self.emitter.emit(rows, scores)
        if not any(keep):
            return
        if not all(keep):
            cache.select(_kept(keep, self.device))
            rows = [row for row, k in zip(rows, keep) if k]
        if self._cache is None:
            self._cache = slot_cache.SlotCache(self.model, self.options.max_batch) if self.options.compiled else cache
        if self._cache is not cache:
            self._cache.merge(cache)
        self._rows = self._rows + rows

    def _decode(self) -> None:
        """One forward of the running batch: each row's pending token in, or, where greedy rows have guesses,
        each row's pending token and guesses (`speculative`: the same tokens, several a step)."""
        pending = [row.pending for row in self._rows]
        guesses = self.emitter.guesses(self._rows) if self.options.drafts is not None else []
        if any(guesses):
            scores = self._cache.verify(self.model, pending, guesses)
            kept, keep = self.emitter.emit_verified(self._rows, scores, guesses)
            self._cache.accept(kept)
        else:
            scores = self._cache.step(self.model, torch.tensor(pending, device=self.device))
            keep = self.emitter.emit(self._rows, scores)
        self.steps += 1
        if not all(keep):
            self._keep(keep)

    def _keep(self, keep: list[bool]) -> None:
        """Only the rows marked True stay; columns no remaining row uses are cut."""
        if not any(keep):
            self._rows = []
            if self.options.compiled:  # the slot cache stays, its tensors where the compiled step's graphs read them
                self._cache.select(_kept(keep, self.device))
            else:
                self._cache = None
            return
        self._cache.select(_kept(keep, self.device))
        self._cache.trim()
        self._rows = [row for row, k in zip(self._rows, keep) if k]

    def _fail_all(self, message: str) -> None:
        """A step raised: the requests it held end with FINISH_ERROR (the running ones, and the ones it was
        prefilling: taken from the queue, or the next chunk of a long prompt); the queue waits on."""
        rows, self._rows, self._cache = self._rows, [], None
        taken, self._taken = self._taken, []
        if self._partial is not None and self._partial.request in taken:
            self._partial = None
        for request in dict.fromkeys([row.request for row in rows] + taken):  # one that finished already is not
            request.on_finish(FINISH_ERROR, message)  # told again (`submit`)


def padding_groups(requests: list[Request], padding: float = PREFILL_PADDING) -> list[list[Request]]:
    """`requests` by prompt length, shortest first, cut into groups whose left pads are at most `padding` of the
    group's positions (a pad costs a forward as much as a token)."""
    groups: list[list[Request]] = []
    for request in sorted(requests, key=lambda r: len(r.prompt)):
        group = groups[-1] if groups else None
        if group is not None:
            positions = len(request.prompt) * (len(group) + 1)
            if positions - sum(len(r.prompt) for r in group) - len(request.prompt) <= padding * positions:
                group.append(request)
                continue
        groups.append([request])
    return groups


def _kept(keep: list[bool], device) -> torch.Tensor:
    return torch.tensor([i for i, k in enumerate(keep) if k], device=device)
