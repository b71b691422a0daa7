"""Few-row float matmuls on CPU: `x @ W.T (+ b)` for up to `MAX_ROWS` rows of x, fp32 or bf16 weights read once.

A decode step multiplies one row per sequence by every weight; a speculative check a few rows; a small batch a
few more. PyTorch sends fp32 products to MKL, whose GEMV reads an fp32 weight well below the memory's bandwidth
and which packs the whole weight first at 2 or more rows; bf16 without native bf16 GEMMs is no better. This kernel
(fewrow_cpu.cpp, AVX2 + FMA) streams 4 weight rows side by side and multiplies each 8-column piece with up to 3
rows of x before the next, so the weight comes from memory once for every row of x. It is chosen for up to
`MAX_ROWS` rows, where it beat PyTorch's products on an AVX2 CPU at nearly every shape and row count, and sped up a
mid-size GLM-4's fp32 decode steps and speculative checks (bench/kernels/fewrow.py, bench/results/fewrow.md,
bench/decode/fewrow_decode.py, bench/results/fewrow-decode.md; figures: bench/results/kernel-notes.md).

The arithmetic of a row of x does not depend on the other rows: each output is one fp32 accumulator over K in steps
of 8 columns (a fused multiply-add each), summed across its 8 lanes, plus the last K % 8 columns in order, then the
bias. So a row gives the same bits alone, in a batch or among a speculative check's rows: a check's Linears give
each position what plain decoding's would (its attention over several positions may still round otherwise).
Against PyTorch's product the difference is float rounding (relative ~1e-6 in fp32); bf16 inputs are multiplied
in fp32 and the result rounded once to bf16.

`cpu_matmul.linear` (the forward of the models' Linears) sends a product here where `routes` says so: no gradient
flows through it, no CPU autocast is on (it would change the product's dtype), x and W on the CPU in fp32 (or bf16
where the CPU has no native bf16 GEMM), W contiguous, at most MAX_ROWS rows; the rest stays with PyTorch. A
torch.compile'd graph calls it too (its output's shape is registered) where it was built before the tracing. Built
at first use like the other CPU kernels (`inline_build`); where it cannot be built, or the CPU lacks AVX2 / FMA,
`available()` is False and PyTorch's products run as before.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from chatglm_tune.quant import inline_build

# Rows of x up to which the kernel runs: up to 32 it led PyTorch's fp32 product at every shape of
# bench/kernels/fewrow.py (figures: bench/results/kernel-notes.md); beyond, PyTorch's GEMM reuses each weight tile
# from cache for many rows, which this kernel, 3 rows at a time, does not.
MAX_ROWS = 32
DTYPES = (torch.float32, torch.bfloat16)


_built: list[bool] = []  # [whether the kernel runs], once `available` has asked (read as it is while compiling)


def available() -> bool:
    """Whether the kernel runs on this machine (x86-64 with AVX2 and FMA, built), asked once."""
    if not _built:
        _built.append(_build())
    return _built[0]


def _build() -> bool:
    if not inline_build.x86():
        return False
    source = (Path(__file__).parent / "fewrow_cpu.cpp").read_text()
    if not inline_build.build("chatglm_fewrow_cpu", source, [], "the few-row float matmul kernel",
                              "float matmuls keep PyTorch's kernels"):
        return False
    if not torch.ops.chatglm_fewrow_cpu.supported():
        return False

    @torch.library.register_fake("chatglm_fewrow_cpu::mm")
    def _(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:  # its shape and dtype, for torch.compile's graphs
        return x.new_empty(x.shape[0], w.shape[0])

    return True


def routes(x: Tensor, weight: Tensor) -> bool:
    """Whether `x @ weight.T` goes to `matmul` (module docstring); cheap checks first, the build last. Inside a
    torch.compile'd graph (CPU compiled decoding) the graph calls the kernel where it was built before tracing."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (0 < rows <= MAX_ROWS and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == weight.dtype and x.dtype in DTYPES and weight.dim() == 2 and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch.is_autocast_enabled("cpu")
            and (bool(_built) and _built[0] if torch.compiler.is_compiling() else available()))


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` by the kernel (check `routes` first): x [..., K], weight [N, K] -> [..., N]."""
    y = torch.ops.chatglm_fewrow_cpu.mm(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
