"""The CPU cores a process may use and how many of them other work keeps busy, so that a default thread count fits
a shared machine.

PyTorch's CPU kernels run on OpenMP teams whose threads wait for each other at the end of every small parallel
region; a thread whose core another process holds comes late to every one of them. On a 2-core machine with one
other busy process, the README main job's infer.py extracted 1.82 records/s on 2 threads and 12.78 on 1. So where
no thread count is given (`--threads`, OMP_NUM_THREADS), the default (a run's, a preset's, torch's) is capped at the
cores left free: those this process may run on (its affinity, within its cgroup's CPU quota) less the ones other
processes kept busy over a short look at /proc/stat (`LOOK_S`; this process's own time taken out). It is read once,
at the start: work that starts later on the machine is not seen.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from chatglm_tune.options import GIVEN_THREADS

LOOK_S = 0.15  # how long the machine's load is looked at (/proc/stat counts in 10 ms ticks)
BUSY_CORE = 0.5  # the busy time, in cores, that counts as a core taken


def usable() -> tuple[int, str]:
    """(cores this process may use, what bounds them): its affinity, and its cgroup's CPU quota where it is lower."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_quota()
    if quota is not None and quota < cores:
        return max(1, math.floor(quota)), f"the cgroup's CPU quota of {quota:g}"
    return cores, f"{cores} core{'s' * (cores != 1)} usable"


def cgroup_quota() -> float | None:
    """The CPU quota of this process's cgroup in cores (v2 cpu.max, v1 cfs_quota_us / cfs_period_us); None: none."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _busy_ticks(cores: set[int]) -> tuple[int, int]:
    """(busy, all) clock ticks of `cores` since boot, from /proc/stat."""
    busy = total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            ticks = list(map(int, fields[:8]))
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return busy, total


def busy_elsewhere(look: float = LOOK_S) -> float | None:
    """Cores' worth of time the processes other than this one kept busy, of those this process may use, over `look`
    seconds (None where /proc/stat cannot be read)."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        busy0, total0 = _busy_ticks(cores)
        mine0, start = time.process_time(), time.monotonic()
        time.sleep(look)
        busy1, total1 = _busy_ticks(cores)
    except OSError:
        return None
    if total1 <= total0:
        return None
    share = (busy1 - busy0) / (total1 - total0) * len(cores)  # cores' worth busy, all processes
    mine = (time.process_time() - mine0) / max(time.monotonic() - start, 1e-9)
    return max(0.0, share - mine)


def fit(threads: int) -> tuple[int, str]:
    """(threads to run on, why): `threads` capped at the cores left free (one thread: nothing to look at)."""
    cores, bound = usable()
    busy = busy_elsewhere() if min(threads, cores) > 1 else None
    taken = 0 if busy is None else min(cores - 1, math.floor(busy + 1 - BUSY_CORE))
    chosen = max(1, min(threads, cores - taken))
    why = f"{bound}" + (f", {taken} kept busy by other work" if taken else "")
    return chosen, why


def fitted(threads: int | None, origin: str) -> tuple[int, str]:
    """(threads, where the number came from and why) of `options.choose_threads`' choice: as it is where the user gave
    it (`GIVEN_THREADS`), else (a run's, a preset's, torch's default where None) capped at the free cores (`fit`)."""
    import torch

    wanted = threads or torch.get_num_threads()
    if origin in GIVEN_THREADS:
        return wanted, origin
    chosen, why = fit(wanted)
    return chosen, (f"{origin} {wanted}, capped at the cores free: {why}" if chosen < wanted else f"{origin}; {why}")
