"""bf16 matmuls and attention on CPUs without native bf16 GEMMs (AVX2 only: no AVX-512 BF16, no AMX).

There PyTorch runs a bf16 `x @ W.T` in its fallback kernels, several times slower than fp32 on the same core, and
the input gradient `grad @ W` of a backward pass two orders of magnitude slower (bench/scale/scale.py; figures:
bench/results/kernel-notes.md). `linear` runs such matmuls in fp32 instead, on row tiles of the weight upcast on
the fly (a full fp32 copy never exists), and returns bf16: faster, and more exact. It applies to inputs of at least
`MIN_ROWS` rows (prefill, training); decoding (a few rows, no gradient) reads the bf16 weight as it is, in
`fewrow_cpu`'s kernel, which takes fp32 products of a few rows too. Under
`torch.autocast("cpu", dtype=torch.bfloat16)` the same matmuls likewise run in fp32 and return bf16, as autocast
would. `scaled_dot_product_attention`
does the same for attention over at least `MIN_ROWS` queries: PyTorch's bf16 flash-attention backward
there is several times slower than its fp32 one. On CPUs
with native bf16 GEMMs, on CUDA and for every other dtype, both are PyTorch's own functions (but for the
few-row fp32 products, `fewrow_cpu`'s on every CPU).

`tiled_mm` and `tiled_mm_grad` are the tile loops that these fp32 matmuls and the dequantizing matmuls
of `kernels` share: weight tiles and partial products go to reusable per-thread buffers
(`workspace`), not fresh allocations. Fresh megabyte-sized tiles cost page faults where glibc maps them
and fragment the heap where it does not (0.1-0.25 GB of peak RSS in a 6B prefill).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from chatglm_tune.quant import fewrow_cpu

MIN_ROWS = 33  # as QuantizedLinear.max_kernel_rows + 1: the GEMV side of the same measured crossover
# Weight elements upcast or dequantized at a time: 8 MB of fp32 (512 rows at ChatGLM-6B's 4096 columns,
# 128 at 16384). Tiles of 8-32 MB ran about as fast for 64-256 rows of activations (figures:
# bench/results/kernel-notes.md); the smaller, the leaner.
TILE_ELEMENTS = 1 << 21


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether this CPU runs bf16 GEMMs natively (oneDNN with AVX-512 BF16 or AMX), and PyTorch's own kernels
    may use them: under `ATEN_CPU_CAPABILITY=avx2` on such a CPU oneDNN still reports bf16, but PyTorch's bf16
    flash attention then fails ("pack_vnni2 is only supported when avx512 is supported"), so that setting
    counts as a CPU without them, as it is meant to act."""
    return (torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512"))


def slow_bf16(x: Tensor) -> bool:
    """True when a bf16 matmul over `x`'s rows would take PyTorch's slow fallback path on this CPU."""
    return x.device.type == "cpu" and x.numel() >= MIN_ROWS * x.shape[-1] and not native_bf16_gemm()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`: a few rows by `fewrow_cpu` where it runs them (fp32, or bf16 without native bf16
    GEMMs), in fp32 where a bf16 GEMM would be slow (module docstring)."""
    if fewrow_cpu.routes(x, weight) and (x.dtype == torch.float32 or not native_bf16_gemm()):
        return fewrow_cpu.matmul(x, weight, bias)
    if slow_bf16(x):
        if x.dtype == weight.dtype == torch.bfloat16:
            return _Fp32TiledLinear.apply(x, weight, bias)
        if _bf16_autocast() and weight.dtype == torch.float32 and x.is_floating_point():
            with torch.autocast("cpu", enabled=False):
                return F.linear(x.float(), weight, bias).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
    """`F.scaled_dot_product_attention` over [b, heads, s, d], in fp32 for bf16 (or bf16-autocast) queries
    of at least MIN_ROWS positions where bf16 is slow (module docstring); bf16 out, as autocast gives.

    One fp32 query a row with no mask (a decode step) is two matmuls and a softmax: PyTorch's CPU flash
    kernel, which SDPA picks there, costs many times what the two matmuls do over a few cached tokens (figures:
    bench/results/kernel-notes.md)."""
    if q.device.type == "cpu" and q.shape[-2] == 1 and attn_mask is None and q.dtype == k.dtype == torch.float32 \
            and not (q.requires_grad or k.requires_grad or v.requires_grad):
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(q.shape[-1]))
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    slow = q.device.type == "cpu" and q.shape[-2] >= MIN_ROWS and not native_bf16_gemm()
    if slow and (q.dtype == torch.bfloat16 or (_bf16_autocast() and q.dtype == torch.float32)):
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask)
        return out.to(torch.bfloat16)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def _bf16_autocast() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


class _Fp32TiledLinear(torch.autograd.Function):
    """y = x @ W.T + b for bf16 x and W, computed in fp32 on row tiles of W (TILE_ELEMENTS each); bf16 out."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.has_bias = bias is not None
        bias32 = None if bias is None else bias.float()
        y = tiled_mm(x.reshape(-1, x.shape[-1]).float(), _upcast_tiles(weight), weight.shape[0], bias32, x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        g2d = grad.reshape(-1, weight.shape[0]).float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            gx = tiled_mm_grad(g2d, _upcast_tiles(weight), weight.shape[1])
            grad_x = gx.to(grad.dtype).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_w = (g2d.t() @ x.reshape(-1, weight.shape[1]).float()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2d.sum(0).to(grad.dtype)
        return grad_x, grad_w, grad_b


def _upcast_tiles(weight: Tensor) -> Iterator[tuple[slice, Tensor]]:
    """(rows, fp32 copy of those rows of `weight`), `tile_rows` at a time, in the workspace."""
    step = tile_rows(weight.shape[1])
    for start in range(0, weight.shape[0], step):
        rows = weight[start : start + step]
        yield slice(start, start + step), workspace("weight", rows.shape, torch.float32).copy_(rows)


# ------------------------------------------------------------------------------------------------
# Tile loops and their buffers
# ------------------------------------------------------------------------------------------------

_buffers = threading.local()


def tile_rows(in_features: int) -> int:
    """Weight rows a CPU tile loop takes at a time: TILE_ELEMENTS of them (an 8 MB fp32 tile)."""
    return max(1, TILE_ELEMENTS // in_features)


def workspace(name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
    """A CPU buffer of `shape` for this thread, reused by every call with the same name and dtype (grown
    when too small, never freed): its contents last until the next call that asks for it."""
    numel, key = math.prod(shape), (name, dtype)
    buffer = _buffers.__dict__.get(key)
    if buffer is None or buffer.numel() < numel:
        _buffers.__dict__[key] = None  # free the old one before the new one is allocated
        with torch.inference_mode(False):  # a normal tensor: one made under inference_mode (generate's) could
            buffer = _buffers.__dict__[key] = torch.empty(numel, dtype=dtype)  # not be written outside it
    return buffer[:numel].view(shape)


def tiled_mm(
    x2d: Tensor, tiles: Iterable[tuple[slice, Tensor]], out_features: int, bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """(M, in) @ W.T (+ bias) -> (M, out), W given as (rows, W[rows]) tiles in x2d's dtype, as is the
    bias; the result is rounded once into `out_dtype` (default x2d's). On CPU the partial products go
    through the workspace; each tile is used before the next is asked for."""
    y = x2d.new_empty(x2d.shape[0], out_features, dtype=out_dtype)
    for rows, w in tiles:
        if x2d.device.type == "cpu":
            part = torch.mm(x2d, w.t(), out=workspace("product", (x2d.shape[0], w.shape[0]), x2d.dtype))
        else:
            part = x2d @ w.t()
        if bias is not None:
            part += bias[rows]
        y[:, rows] = part
    return y


def tiled_mm_grad(g2d: Tensor, tiles: Iterable[tuple[slice, Tensor]], in_features: int) -> Tensor:
    """(M, out) @ W -> (M, in): the input gradient of `tiled_mm`, over the same tiles."""
    grad_x = g2d.new_zeros(g2d.shape[0], in_features)
    for rows, w in tiles:
        grad_x.addmm_(g2d[:, rows], w)
    return grad_x


class Linear(nn.Linear):
    """`nn.Linear` whose forward is `linear` above: the model's block Linears and head."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def adopt(module: nn.Module) -> nn.Module:
    """`module` with every plain `nn.Linear` in it made a `Linear` (the same parameters, this forward)."""
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = Linear
    return module
