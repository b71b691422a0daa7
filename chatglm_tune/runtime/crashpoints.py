"""Named moments where a crash test kills this process with a real signal: the instants between a write and its
rename, or between two renames, that a kill from outside lands on only by chance.

Off unless the environment asks, and then a dictionary lookup a moment:
- CHATGLM_TUNE_CRASH_AT="<moment>#<n>:<SIGNAL>[@<rank>]" (e.g. "replace-dir#2:SIGKILL"): the n-th time (from 1) this
  process reaches `moment`, it sends itself SIGNAL (SIGINT, SIGTERM, SIGUSR1 or SIGKILL); the signal's handler (or the
  kernel, for SIGKILL) acts as if the signal had come from outside at that instant. With `@<rank>`, only the process
  of a distributed launch whose RANK is that one does (the others share the environment);
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
    if not at:
        return
    where, n, sig, rank = parse(at)
    if (where, n) == (moment, count) and (rank is None or rank == int(os.environ.get("RANK", "0"))):
        os.kill(os.getpid(), getattr(signal, sig))


def parse(at: str) -> tuple[str, int, str, int | None]:
    """("moment", n, "SIGNAL", rank or None) of a CHATGLM_TUNE_CRASH_AT value; ValueError naming the variable
    otherwise."""
    try:
        where, sig = at.rsplit(":", 1)
        sig, _, rank = sig.partition("@")
        moment, n = where.rsplit("#", 1)
        if sig not in SIGNALS or int(n) < 1 or (rank and int(rank) < 0):
            raise ValueError
        return moment, int(n), sig, int(rank) if rank else None
    except ValueError:
        raise ValueError(f"{AT_ENV}={at!r}: expected <moment>#<n>:<signal>[@<rank>] with n >= 1 and a signal of "
                         f"{', '.join(SIGNALS)}") from None


def spell(moment: str, n: int, sig: str, rank: int | None = None) -> str:
    """The CHATGLM_TUNE_CRASH_AT value that kills at the n-th `moment` with `sig` (in process `rank` only)."""
    return f"{moment}#{n}:{sig}" + ("" if rank is None else f"@{rank}")
