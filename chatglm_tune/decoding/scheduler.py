"""Who runs at the engine's next step: the queue of waiting requests and the rules that admit them.

- The queue holds at most `max_queue` requests beyond what the running batch has room for (QueueFull past
  that), and nothing once the engine is closing (EngineClosed).
- Newcomers are admitted in arrival order while the batch has room (`max_batch`) and their prompts fit the
  prefill budget together (`prefill_tokens`: the engine's forwards of one step); the first always goes.
- A prompt longer than the budget is taken alone, to be prefilled a chunk of `prefill_tokens` a step, where
  the model attends causally within a prompt. ChatGLM-6B's prompt attends both ways (every prompt token sees
  the whole prompt), so its prompts cannot be cut: a longer one is admitted whole, alone.
So a newcomer waits at most one step of the batch, and a running stream at most one prefill of
`prefill_tokens` tokens a step.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from chatglm_tune.decoding.request import Request
from chatglm_tune.options import ServingOptions


class QueueFull(RuntimeError):
    """The engine's queue holds `max_queue` requests already."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and admits nothing more."""


class Scheduler:
    """The waiting requests (any thread submits; the engine's thread takes), and a condition that wakes the
    engine when there is something to do."""

    def __init__(self, options: ServingOptions):
        self.options = options
        self.wake = threading.Condition()
        self.closing = False
        self._waiting: collections.deque[Request] = collections.deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def submit(self, request: Request, *, running: int, room: int) -> None:
        """Queue `request` (see the module docstring for QueueFull and EngineClosed)."""
        with self.wake:
            if self.closing:
                raise EngineClosed("the server is shutting down")
            limit = self.options.max_queue
            if limit is not None and len(self._waiting) >= limit + max(0, room):
                raise QueueFull(f"{running} requests are running and {len(self._waiting)} waiting (the queue "
                                f"holds {limit} beyond a batch of {self.options.max_batch})")
            self._waiting.append(request)
            self.wake.notify()

    def notify(self) -> None:
        with self.wake:
            self.wake.notify()

    def close(self) -> None:
        """Admit nothing more; every waiting request is cancelled."""
        with self.wake:
            self.closing = True
            for request in self._waiting:
                request.cancelled = True
            self.wake.notify()

    def wait(self, idle: Callable[[], bool]) -> bool:
        """Block while `idle()` and not closing; False once closing with nothing left to do."""
        with self.wake:
            while idle() and not self.closing:
                self.wake.wait()
            return not (self.closing and idle())

    def take_cancelled(self) -> list[Request]:
        """The waiting requests that were cancelled, out of the queue."""
        with self.wake:
            gone = [r for r in self._waiting if r.cancelled]
            if gone:
                self._waiting = collections.deque(r for r in self._waiting if not r.cancelled)
        return gone

    def take_long_prompt(self, room: int, attends_both_ways: Callable[[Request], bool]) -> Request | None:
        """The first waiting request, to prefill in chunks, when its prompt is over the budget and the model
        does not attend both ways within it (`attends_both_ways(request)`, asked under the queue's lock)."""
        with self.wake:
            if not self._waiting or room < 1 or len(self._waiting[0].prompt) <= self.options.prefill_tokens:
                return None
            if attends_both_ways(self._waiting[0]):
                return None  # ChatGLM-6B: prefilled whole, through `admit`
            return self._waiting.popleft()

    def admit(self, room: int) -> list[Request]:
        """Waiting requests to prefill together: room in the batch, prompt tokens within the budget."""
        admitted: list[Request] = []
        tokens = 0
        with self.wake:
            while self._waiting and len(admitted) < room:
                n = len(self._waiting[0].prompt)
                if admitted and tokens + n > self.options.prefill_tokens:
                    break
                admitted.append(self._waiting.popleft())
                tokens += n
        return admitted
