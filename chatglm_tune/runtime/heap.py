"""The process's memory: giving freed heap memory back to the system (glibc's `malloc_trim` and `mallopt`), and
weights in 2 MB pages (`huge_pages_empty`).

Loading, repacking and the tiled matmuls of a large model free many megabyte-sized temporaries between
small tensors that stay (scales, biases, activations). glibc keeps such fragmented free memory resident
(hundreds of MB at 6B size) unless asked: `trim()` asks once; `trim_after_each(layers)` asks after each layer
of a prefill (inside `one_trim()`, once at its end instead); `mmap_large_blocks(model)` makes glibc serve large
blocks with mmap, which it returns as soon as they are freed; `heap_large_blocks()` the opposite, for a server.
No-ops where the C library is not glibc (musl, macOS, Windows).

A decode step reads every weight once, GBs of them, and with 4 KB pages it also misses the TLB for each 4 KB read,
which 2 MB pages avoid: the int8dot kernel reads a large weight markedly faster from them (figures:
bench/results/kernel-notes.md). PyTorch's allocator gives 4 KB pages unless its process started with
THP_MEM_ALLOC_ENABLE=1, and Linux gives large pages to anonymous memory only where asked (transparent huge pages in
"madvise" mode, the usual setting). `huge_pages_empty` asks; `large_empty` is what checkpoint loaders and quantizers
write weights into, so that the int8dot layout, made in a weight's own bytes, keeps them (no second copy of a layer,
not even for a moment).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import sys
import threading
from pathlib import Path

import torch


# A model of at least this many bytes of weights gets `mmap_large_blocks`: its per-layer temporaries
# (weight tiles of 8-32 MB) fragment the heap, which mmap'd blocks of 1 MiB and more avoid: a lower peak RSS
# (figures: bench/results/kernel-notes.md).
LARGE_MODEL_BYTES = 1 << 30
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1  # glibc's mallopt parameter numbers
# `heap_large_blocks`: blocks up to this size come from the heap. A prefill of 16 prompts of 42 tokens at ChatGLM3-6B
# size frees and takes again 37-74 MB activations a layer, over glibc's largest automatic threshold (32 MB): fresh
# mmaps, each paid again in page faults and system time; from the heap far fewer (figures:
# bench/results/kernel-notes.md).
HEAP_BLOCK_MAX_BYTES = 512 << 20
# An inference forward of a layer over at least this many positions (a prefill; not a decode step of up to 32 rows)
# is followed by `trim()`, whose cost is small beside such a layer's.
TRIM_MIN_ROWS = 33
HUGE_PAGE_BYTES = 2 << 20  # x86-64's transparent huge page
# Weights from this size up to one 2 MB page share such pages (`large_empty`): a mixture-of-experts model's experts are
# that small (GLM-4.7-Flash's INT4 projections: 1.5 MB each, 60 of them read a decode step, 0.9 GB), and on 4 KB pages
# its decode step took ms longer.
SHARED_PAGE_MIN_BYTES = 256 << 10
SHARED_BLOCK_BYTES = 32 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # "always [madvise] never": the mode in brackets


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


def trim_after_each(layers) -> None:
    """Have every module of `layers` (a model's blocks) call `trim()` after a CPU forward without gradients over
    at least TRIM_MIN_ROWS positions (training has `mmap_large_blocks`), outside `one_trim()`. A prefill frees
    its activations layer by layer among the cache entries it keeps, and glibc kept ~2 MB more of them resident
    per layer: 0.07 GB at ChatGLM3-6B's 28 layers over 64 tokens, enough to lift an INT8 model's peak RSS above
    llama.cpp's (6.75 against 6.72 GB; 6.71 with this)."""
    for layer in layers:
        layer.register_forward_hook(trim_after_rows)


_scope = threading.local()  # .one_trim: inside `one_trim()` on this thread


def trim_after_rows(module, args, output) -> None:
    """The hook of `trim_after_each`: nothing for fewer than TRIM_MIN_ROWS positions (a decode step skips it freely)."""
    x = args[0] if args else None
    if (isinstance(x, torch.Tensor) and x.device.type == "cpu" and not torch.is_grad_enabled() and x.dim()
            and x.numel() >= TRIM_MIN_ROWS * x.shape[-1] and not getattr(_scope, "one_trim", False)):
        trim()


@contextlib.contextmanager
def one_trim():
    """Within the block, the layers of `trim_after_each` leave their freed pages to the next layer (no trim each);
    `trim()` once at its end. Each trim gives back pages the next layer takes again, page fault by page fault,
    which within this a prefill does not pay; its peak RSS is higher by the prefill's freed activations (figures:
    bench/results/kernel-notes.md). For a server's prefills, where time to the first token counts; one-off runs
    keep the lower peak."""
    outer = getattr(_scope, "one_trim", False)
    _scope.one_trim = True
    try:
        yield
    finally:
        _scope.one_trim = outer
        if not outer:
            trim()


def heap_large_blocks() -> bool:
    """Have glibc serve blocks up to HEAP_BLOCK_MAX_BYTES from its heap (process-wide), so that a prefill's layers
    take again the activations the layer before freed, where fresh mmaps fault in every page; with `one_trim()`
    the pages go back once a prefill is done. For a server, where prefills of many prompts come one after another.
    Returns whether set (False where the C library is not glibc)."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    # and the heap's top is not handed back at each free either (glibc's default: over 128 KB), only by `trim()`
    options = (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)
    return all(mallopt(ctypes.c_int(option), ctypes.c_int(HEAP_BLOCK_MAX_BYTES)) for option in options)


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


@functools.cache
def huge_pages_available() -> bool:
    """Whether `huge_pages_empty` can ask for 2 MB pages: Linux with transparent huge pages not switched off."""
    if not (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def huge_pages_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialized CPU tensor in private anonymous memory, 2 MB-aligned, its whole 2 MB pages marked
    MADV_HUGEPAGE: the kernel backs those with 2 MB pages as they are first written, where it has them free; the
    last part page keeps 4 KB ones (a 2 MB page there would hold up to 2 MB that no tensor uses). None where that
    cannot be asked (`huge_pages_available`) or for tensors under one such page. The mapping lives as long as the
    tensor; its pages beyond the tensor are never touched, so they take no memory."""
    nbytes = _nbytes(shape, dtype)
    if nbytes < HUGE_PAGE_BYTES or not huge_pages_available():
        return None
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping`
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return raw[start : start + nbytes].view(dtype).view(shape)


def large_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` on the CPU, in 2 MB pages where `huge_pages_empty` gives them: for weights,
    which loaders write once and decoding streams at every step. Weights from SHARED_PAGE_MIN_BYTES up to one such
    page share them (`_SharedPages`)."""
    nbytes = _nbytes(shape, dtype)
    out = _SHARED.take(nbytes, shape, dtype) if SHARED_PAGE_MIN_BYTES <= nbytes < HUGE_PAGE_BYTES else None
    if out is None:
        out = huge_pages_empty(shape, dtype)
    return out if out is not None else torch.empty(shape, dtype=dtype)


class _SharedPages:
    """Weights under one 2 MB page cut, one after another, from blocks of SHARED_BLOCK_BYTES in 2 MB pages (a new
    block where the next does not fit). A block is unmapped once no tensor cut from it lives, but for the one being
    cut from, which this keeps (at most SHARED_BLOCK_BYTES)."""

    def __init__(self):
        self.block: torch.Tensor | None = None
        self.used = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        step = -(-nbytes // 64) * 64  # each tensor starts on a cache line
        with self.lock:
            if self.block is None or self.used + step > self.block.numel():
                self.block, self.used = huge_pages_empty((SHARED_BLOCK_BYTES,), torch.uint8), 0
                if self.block is None:
                    return None
            out = self.block[self.used : self.used + nbytes].view(dtype).view(shape)
            self.used += step
        return out


_SHARED = _SharedPages()


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether `tensor` starts on a 2 MB boundary of CPU memory and fills at least one such page, as every tensor of
    `huge_pages_empty` does (glibc's blocks never start there: their data follows a header): rearranging it in its
    own bytes then keeps its pages."""
    return (tensor.device.type == "cpu" and huge_pages_available() and tensor.data_ptr() % HUGE_PAGE_BYTES == 0
            and tensor.numel() * tensor.element_size() >= HUGE_PAGE_BYTES)
