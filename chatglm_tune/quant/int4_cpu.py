"""A batch-1 INT4 matmul for CPUs without AVX-512, reading the official packed INT4 weight as it is.

On AVX2-only CPUs PyTorch's `_weight_int4pack_mm_for_cpu` is compute-bound, slower than int8pack for half the
bytes, so INT4 decodes slower than INT8 there (bench/results/scale.json; figures: bench/results/kernel-notes.md).
`matmul` computes `x @ dequant(W).T` for official per-row-scale INT4 (`weight` int8 `[out, in/2]`,
even column in the high nibble; `weight_scale` fp16 `[out]`) with a small C++ kernel (AVX2 + FMA
intrinsics, PyTorch's intra-op thread pool): per 8 bytes of a row, zero-extend to 8 int32 lanes and XOR
0x88 (each signed nibble q becomes q + 8, offset binary), take the high nibble by a shift and the low one
by a mask, convert to fp32 and FMA with the even and odd columns of x, kept in fp32; the row's sum less
8 * sum(x), times its scale, is the dequantized math (`q * scale` is exact in fp32), fp32 throughout, so
more exact than the bf16 kernels. Four rows share each load of x, and each row prefetches the weight two
blocks ahead (rows of 2 KB, as most of ChatGLM's are, defeat the hardware prefetcher). With more than
`DIRECT_ROWS` rows of x, each 4-row x 512-column chunk of the weight is unpacked once (less 8) into an fp32
buffer (8 KB, L1) that every row of x then reads.

At the AVX2 level the kernel beats PyTorch's int8pack and int4pack at batch 1, and ChatGLM-6B decodes INT4 faster
than INT8 with it; at the AVX-512 level it beats int4pack at decode too, but prefill is then slower (the dequantizing
path unpacks the official layout more slowly than it reads int4pack's back), so `available()` is True only where
PyTorch's CPU capability is AVX2 (bench/kernels/int4_kernels.py, bench/peer/peer.py `--capability avx2`; figures:
bench/results/kernel-notes.md). Exact to fp32 rounding (relative error ~1e-6, where the bf16 kernels give ~2e-3).
What limits it at the AVX2 level is arithmetic more than memory: 5 of the 8 instructions per 16 weights need the two
vector ports that convert and multiply. No repacking: the official weight is the only copy, and
nothing ISA-dependent is built from it.

Rows of the weight are split over PyTorch's intra-op threads by `at::parallel_for`, which is OpenMP inside
this extension too: it is built with `-fopenmp` (without it the same code compiles and runs on one thread, which
the op `parallel_chunks` shows: 1 chunk).

The kernel is compiled once per machine and torch install at first use (`inline_build`: 10-40 s, kept in the
kernel cache) with the same compiler torch.compile's C++ backend needs. Where it cannot be built (no
compiler), `available()` is False (with one warning)
and QuantizedLinear keeps PyTorch's int4pack kernel.

Where `int8dot_cpu` (int8 dot products on activations quantized to int8 blocks) builds, QuantizedLinear routes
per-row INT4 decode there first; this kernel stays the exact-fp32 choice (`kernel = "int4cpu"`) and the AVX2
fallback where that one is unavailable.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from chatglm_tune.quant import inline_build

# Rows of x up to which each row unpacks the weight in registers; above, chunks are unpacked once into
# an fp32 buffer shared by every row (crossover measured at 16384x4096 by bench/kernels/int4_kernels.py `--rows`:
# the buffer wins from 4 rows on). QuantizedLinear routes up to its `max_kernel_rows` (32) rows here.
DIRECT_ROWS = 2


@functools.cache
def _build() -> bool:
    """Compile and load the kernel, int4_cpu.cpp (once per process; the build itself is cached on disk)."""
    source = (Path(__file__).parent / "int4_cpu.cpp").read_text()
    return inline_build.build("chatglm_int4_cpu", source, ["-mavx2", "-mfma"], "the AVX2 INT4 kernel",
                              "using PyTorch's int4pack kernel")


_x86 = inline_build.x86


def compiled() -> bool:
    """Whether the kernel runs on this CPU (x86-64 with AVX2 and FMA, which PyTorch's AVX2 and AVX512
    capabilities imply) and has been built: what `matmul` needs, wherever it is faster or not."""
    return _x86() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and _build()


@functools.cache
def available() -> bool:
    """Whether QuantizedLinear should use `matmul`: PyTorch's kernels run at the AVX2 level here (no
    AVX-512, where this kernel beats int4pack; `ATEN_CPU_CAPABILITY=avx2` emulates such a CPU on an AVX-512
    one) and the kernel builds. Checked before any build, so AVX-512 machines never compile it."""
    return _x86() and torch.backends.cpu.get_cpu_capability() == "AVX2" and compiled()


def usable(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether a layer of this shape and format can use `matmul` (per-row scales, 16 | in, 4 | out)."""
    return group_size == 0 and in_features % 16 == 0 and out_features % 4 == 0


def matmul(x2d: Tensor, weight: Tensor, weight_scale: Tensor, direct_rows: int = DIRECT_ROWS) -> Tensor:
    """(M, in) @ dequant(W).T -> (M, out) in x's dtype, computed in fp32, for official INT4 `weight` int8
    `[out, in/2]` and per-row `weight_scale` `[out]` (check `compiled()` or `available()`, and `usable`, first)."""
    x = x2d.float()
    xe, xo = x[:, 0::2].contiguous(), x[:, 1::2].contiguous()  # (M, in/2) each: the high and low nibbles' columns
    y = torch.ops.chatglm_int4_cpu.rows_mm(xe, xo, weight.contiguous(), weight_scale.float().contiguous(), direct_rows)
    return y.to(x2d.dtype)
