"""How a command stops on a signal: SIGTERM (docker stop, Kubernetes, SLURM at its time limit, a spot instance's
preemption) and SIGUSR1 (SLURM's `--signal=USR1@<seconds>` warning before the limit) are taken as Ctrl-C (SIGINT).

Within `signals_stop()`, each of the three raises `Stopped` (a KeyboardInterrupt naming the signal) where the
program is, as Python's own Ctrl-C does: a command's Ctrl-C handling (atomic writes, saved state, a message) then
serves all three. While the returned `StopRequest` is `deferring` (from the start with `deferred=True`: every
process of a distributed run must stop at the same step; or where the program sets it around work that must not be
cut, a training step) a signal only records itself there, and the program reads it at its safe points; a second
signal while one waits raises at once (a user who presses Ctrl-C twice means it). The handlers before the block come
back after it.

A command interrupted this way exits with 128 + the signal's number (130 Ctrl-C, 143 SIGTERM, 138 SIGUSR1:
`exit_status`), the shell's convention for "ended by that signal", which job schedulers read as interrupted.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")


class Stopped(KeyboardInterrupt):
    """A KeyboardInterrupt raised for SIGINT, SIGTERM or SIGUSR1 (`signal_name`); `where`: what was done by then, for
    the message."""

    def __init__(self, signal_name: str = "SIGINT", where: str = ""):
        super().__init__(signal_name, where)
        self.signal_name, self.where = signal_name, where


@dataclass
class StopRequest:
    """The signal received while deferring (None: none yet), and whether signals are deferred now."""

    signal_name: str | None = None
    deferring: bool = False


def signal_name(interrupt: BaseException) -> str:
    """The signal behind a KeyboardInterrupt: a `Stopped`'s, else SIGINT (Python's own Ctrl-C)."""
    return getattr(interrupt, "signal_name", "SIGINT")


def exit_status(interrupt: BaseException | str) -> int:
    """128 + the number of the signal that interrupted (a KeyboardInterrupt, or a signal's name)."""
    name = interrupt if isinstance(interrupt, str) else signal_name(interrupt)
    return 128 + int(getattr(signal, name))


@contextmanager
def signals_stop(*, deferred: bool = False) -> Iterator[StopRequest]:
    """SIGINT, SIGTERM and SIGUSR1 as Ctrl-C within the block (module docstring); off the main thread (where Python
    takes no handlers) the block runs as it is."""
    request = StopRequest(deferring=deferred)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handle(signum, frame) -> None:
        name = signal.Signals(signum).name
        if request.deferring and request.signal_name is None:
            request.signal_name = name
            return
        raise Stopped(name)

    previous = {name: signal.signal(getattr(signal, name), handle) for name in STOP_SIGNALS}
    try:
        yield request
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
