"""The repository's scripts run as a user runs them, for the tests: `cli` in an interpreter of its own, `start` and
`finish` for several side by side (a test machine has two cores and a short run is mostly an interpreter start)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# A command or a wait still going after this many seconds has hung. It bounds a hang and says nothing of how fast
# a machine is: every wait in the tests ends on an event (a process exits, a line or a file appears), and a busy
# machine only makes that event come later.
HANG_S = 600


def start(script: str, *args, env: dict | None = None) -> subprocess.Popen:
    """`python script args` from the repository root, offline, in this environment without OMP_NUM_THREADS, plus
    `env` (default: OMP_NUM_THREADS=1; `{}`: the thread count left to the script)."""
    environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environment | (ONE_THREAD if env is None else env),
                            cwd=ROOT)


def finish(process: subprocess.Popen, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    """Wait for a `start`ed command to exit (killed past `timeout`, a hang): its exit code and output."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def cli(script: str, *args, env: dict | None = None, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    return finish(start(script, *args, env=env), timeout)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def side_by_side(*commands: tuple) -> list[subprocess.CompletedProcess]:
    """Each `(script, *args)` started at once, then each checked to exit 0."""
    started = [start(*command) for command in commands]
    return [ok(finish(process)) for process in started]


def wait_until(ready: Callable[[], bool], what: str, *, alive: Callable[[], bool] = lambda: True) -> None:
    """Return once `ready()` holds (polled every 50 ms). AssertionError naming `what` where `alive()` stops holding
    first (the process that was to make it happen exited), or after HANG_S (a hang)."""
    deadline = time.monotonic() + HANG_S
    while not ready():
        if not alive():
            assert ready(), f"{what}: the process ended first"
            return
        assert time.monotonic() < deadline, f"{what}: not after {HANG_S} s (a hang)"
        time.sleep(0.05)
