"""Named moments where a crash test kills this process with a real signal: the instants between a write and its
rename, or between two renames, that a kill from outside lands on only by chance.

Off unless the environment asks, and then a dictionary lookup a moment:
- CHATGLM_TUNE_CRASH_AT="<moment>#<n>:<SIGNAL>" (e.g. "replace-dir#2:SIGKILL"): the n-th time (from 1) this
  process reaches `moment`, it sends itself SIGNAL (SIGINT, SIGTERM, SIGUSR1 or SIGKILL); the signal's handler (or the
  kernel, for SIGKILL) acts as if the signal had come from outside at that instant;
- CHATGLM_TUNE_CRASH_LOG=<file>: each moment reached is appended to the file, a line each, so a test learns from an
  uninterrupted run which moments a command passes and how often.
"""

from __future__ import annotations

import os
import signal

AT_ENV = "CHATGLM_TUNE_CRASH_AT"
LOG_ENV = "CHATGLM_TUNE_CRASH_LOG"
SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGKILL")

_counts: dict[str, int] = {}


def reached(moment: str) -> None:
    """This process is at `moment`: logged and counted where the environment asks (module docstring)."""
    at, log = os.environ.get(AT_ENV), os.environ.get(LOG_ENV)
    if not (at or log):
        return
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(moment + "\n")
    _counts[moment] = count = _counts.get(moment, 0) + 1
    if at and parse(at) == (moment, count, parse(at)[2]):
        os.kill(os.getpid(), getattr(signal, parse(at)[2]))


def parse(at: str) -> tuple[str, int, str]:
    """("moment", n, "SIGNAL") of a CHATGLM_TUNE_CRASH_AT value; ValueError naming the variable otherwise."""
    try:
        where, sig = at.rsplit(":", 1)
        moment, n = where.rsplit("#", 1)
        if sig not in SIGNALS or int(n) < 1:
            raise ValueError
        return moment, int(n), sig
    except ValueError:
        raise ValueError(f"{AT_ENV}={at!r}: expected <moment>#<n>:<signal> with n >= 1 and a signal of "
                         f"{', '.join(SIGNALS)}") from None


def spell(moment: str, n: int, sig: str) -> str:
    """The CHATGLM_TUNE_CRASH_AT value that kills at the n-th `moment` with `sig`."""
    return f"{moment}#{n}:{sig}"
