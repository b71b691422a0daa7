"""Giving freed heap memory back to the system (glibc's `malloc_trim` and `mallopt`).

Loading, repacking and the tiled matmuls of a large model free many megabyte-sized temporaries between
small tensors that stay (scales, biases, activations). glibc keeps such fragmented free memory resident
(hundreds of MB at 6B size) unless asked: `trim()` asks once; `mmap_large_blocks(model)` makes glibc
serve large blocks with mmap, which it returns as soon as they are freed. No-ops where the C library
is not glibc (musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import functools
import sys


# A model of at least this many bytes of weights gets `mmap_large_blocks`: its per-layer temporaries
# (weight tiles of 8-32 MB) fragment the heap. Measured at ChatGLM-6B size, a P-tuning step on an INT4
# base: peak RSS 5.86 GB with glibc's defaults, 5.04 GB with blocks of 1 MiB and more mmap'd.
LARGE_MODEL_BYTES = 1 << 30
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


@functools.cache
def _glibc(name: str):
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc
        return None


def trim() -> None:
    """Return the free pages of every malloc arena to the system."""
    malloc_trim = _glibc("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(ctypes.c_size_t(0))


def mmap_large_blocks(model) -> bool:
    """For a model of at least LARGE_MODEL_BYTES of weights, have glibc mmap every block of
    MMAP_THRESHOLD_BYTES or more (process-wide), so that freed tiles leave at once. Small models keep
    glibc's defaults: their few large temporaries are reused well, and mmap's page faults would cost
    them time. train.py calls this once the model is loaded (a training step at 6B: 0.5-1.9 GB less
    peak RSS); infer.py does not: since the tile loops reuse their buffers (`cpu_matmul.workspace`),
    it changes a 6B inference peak by under 0.01 GB and slows its prefill. Returns whether set."""
    on_cpu = [p for p in model.parameters() if p.device.type == "cpu"]
    mallopt = _glibc("mallopt")
    if sum(p.numel() * p.element_size() for p in on_cpu) < LARGE_MODEL_BYTES or mallopt is None:
        return False
    return bool(mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD_BYTES)))
