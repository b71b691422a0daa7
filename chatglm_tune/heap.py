"""Giving freed heap memory back to the system (glibc's `malloc_trim`).

Loading and repacking weights free many megabyte-sized temporaries between small tensors that stay
(scales, biases). glibc keeps such fragmented free memory resident (hundreds of MB at 6B size) unless
asked; `trim()` asks. A no-op where the C library has no `malloc_trim` (musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim() -> None:
    """Return the free pages of every malloc arena to the system."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)
