"""The OpenMP runtime PyTorch's CPU kernels run on: handing a thread's idle worker threads back.

libgomp gives every thread that starts a parallel region a team of worker threads of its own, kept between
regions, and counts the workers of all teams. While they number no more than the cores, a team spins between
regions; once they outnumber the cores, every team sleeps instead (a short spin, then a futex wait), and each
region waits for its workers to wake. A decoding step is hundreds of regions. A server loads its model on one
thread and decodes on another, so the loading thread's idle team alone tips a 2-core machine over, and the
engine's decode steps slow down by thousands of context switches until the loading thread hands its team back
(figures: bench/results/kernel-notes.md).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

# The OpenMP runtimes PyTorch links: GNU (libgomp), LLVM (libomp) and Intel (libiomp5).
RUNTIMES = ("libgomp", "libomp", "libiomp5")
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads released, the runtime's state kept


@functools.cache
def _pause_functions() -> tuple:
    """`omp_pause_resource_all` of each OpenMP runtime this process has loaded (PyTorch's, and the copies some
    wheels bundle, e.g. sentencepiece's libgomp); none where there is no /proc (not Linux) or no OpenMP 5.0."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    paths = {line.split(None, 5)[-1] for line in maps.splitlines() if len(line.split(None, 5)) == 6}
    functions = []
    for path in sorted(p for p in paths if Path(p).name.startswith(RUNTIMES)):
        function = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        if function is not None:
            function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
            functions.append(function)
    return tuple(functions)


def release_idle_team() -> bool:
    """Hand the calling thread's idle OpenMP worker threads back, in every runtime loaded (`omp_pause_resource_all`,
    soft), so that the threads that go on running parallel regions spin between them. A team is made again if this
    thread runs a parallel region later. Call it outside any parallel region, after the runtimes are loaded (after
    importing torch). False where no OpenMP 5 runtime is loaded."""
    results = [pause(OMP_PAUSE_SOFT) == 0 for pause in _pause_functions()]
    return bool(results) and all(results)
