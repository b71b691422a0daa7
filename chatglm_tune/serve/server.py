"""uvicorn with a shutdown that lets clients hear it: the server that serve.py runs.

uvicorn alone, on Ctrl-C / SIGTERM, closes its listening socket at once (a newcomer's connection is refused)
and, once its graceful-shutdown timeout runs out, cancels the tasks still answering (a stream stops
mid-answer: no finish, no error, no `[DONE]`). Here the first signal starts a drain instead:
- the server keeps listening: a new request gets 503 in OpenAI's error JSON, /health 503
  `{"status": "shutting_down"}` (`Service.stopping`);
- running requests get `grace` seconds to finish; then the engine is closed, and each request still
  decoding ends with a 503 (a stream: an error event, then `data: [DONE]`);
- then uvicorn shuts down as usual, its timeout only for those last responses to be written (FLUSH_S).
A second signal ends the grace at once; a third is uvicorn's own (a second Ctrl-C there forces the exit).
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger("chatglm_tune.serve")

FLUSH_S = 5.0  # after the grace: seconds for the responses the engine's close ended to be written
_POLL_S = 0.05  # how often the drain checks that nothing runs any more


class DrainingServer(uvicorn.Server):
    """A uvicorn server of `config` (its app serving `service`) that drains on the first signal (see the module
    docstring); `grace`: seconds running requests get."""

    def __init__(self, config: uvicorn.Config, service, grace: float):
        config.timeout_graceful_shutdown = FLUSH_S
        super().__init__(config)  # uvicorn's loggers are configured by now
        log.setLevel(logging.INFO)  # the drain's messages and the app's errors beside uvicorn's own, in its format
        log.handlers, log.propagate = logging.getLogger("uvicorn").handlers, False
        self.service, self.grace = service, grace
        self.signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadline = float("inf")

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        """The signal handler (the main thread, between the loop's callbacks) and a way to stop the server from
        any thread: the first call starts the drain, the second ends its grace, later ones are uvicorn's."""
        self.signals += 1
        if self.signals > 2 or self._loop is None or self._loop.is_closed():
            super().handle_exit(sig, frame)
        elif self.signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain, sig, frame)
        else:
            self._loop.call_soon_threadsafe(self._end_grace)

    def _start_drain(self, sig, frame) -> None:
        self._deadline = self._loop.time() + self.grace
        self._drain_task = self._loop.create_task(self._drain(sig, frame))

    def _end_grace(self) -> None:
        self._deadline = self._loop.time()

    async def _drain(self, sig, frame) -> None:
        service = self.service
        service.stopping = True
        log.info("shutting down: no new requests; running ones get %.0f s (a second signal ends that at once)",
                 self.grace)
        while service.engine.unfinished and self._loop.time() < self._deadline:
            await asyncio.sleep(_POLL_S)
        if service.engine.unfinished:
            log.info("the shutdown grace ran out: ending the running requests")
        await asyncio.to_thread(service.engine.close)  # what still decodes ends with FINISH_CANCELLED: a 503
        super().handle_exit(sig, frame)
