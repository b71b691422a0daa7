"""The matmuls behind `QuantizedLinear` (`x2d` is (M, in)), and which one runs.

The weight-only kernels run near the memory-bandwidth limit on AVX-512/AMX CPUs; on AVX2-only CPUs they
are compute-bound (bench/decode/quant.py; figures: bench/results/kernel-notes.md), so INT4 decodes no faster than
INT8 there.
- "int8pack" (CPU): `torch._weight_int8pack_mm`, bf16 activations, per-row scales;
- "int4pack" (CPU): `aten._weight_int4pack_mm_for_cpu` on a weight repacked once per process (the
  packed layout depends on the CPU's ISA, so it is never saved); official per-row scales are applied to
  its output in fp32, the kernel's own group scales being one shared tensor of ones;
- "int4cpu" (AVX2-only CPUs): `int4_cpu`, which reads the official packed weight as it is;
- "int8dot" (CPU, INT8 and per-row INT4, AVX2 or AVX-512 VNNI): `int8dot_cpu`, the weight as it is (short rows:
  rearranged once per process into its interleaved layout) times activations quantized once per call (INT4: int8 in
  blocks of 32, q8_0; INT8: int16 in blocks of 64), integer dot products; the first choice at decode;
- "intmm" / "int4mm" (CUDA; intmm anywhere when forced): `cuda_matmul`, weight-only kernels that read the integers;
- "dequant" (everywhere, CUDA's where a gradient flows through x): dequantize to the activation dtype (in row tiles on
  CPU) and run an ordinary matmul; it also serves prefill/large batches, where the weight-only kernels lose.
Backward (`QuantizedMatmul`) always gives the input gradient through the dequantized weight, never a
weight gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch import Tensor

from chatglm_tune.quant import cpu_matmul, cuda_matmul, int4_cpu, int8dot_cpu
from chatglm_tune.quant.format import dequantize, unpack_int4

# int4cpu: int4_cpu, for AVX2-only CPUs; intmm / int4mm: cuda_matmul, CUDA's weight-only kernels
KERNELS = ("auto", "int8pack", "int4pack", "int4cpu", "int8dot", "intmm", "int4mm", "dequant")


# ------------------------------------------------------------------------------------------------
# Matmuls behind QuantizedLinear (x2d is (M, in))
# ------------------------------------------------------------------------------------------------


def _aligned_bf16(x2d: Tensor) -> Tensor:
    """bf16, contiguous, 64-byte aligned copy of x when needed: the CPU kernels segfault on rows that
    start mid-vector (a view offset by one element; measured)."""
    x2d = x2d.to(torch.bfloat16).contiguous()
    return x2d.clone() if x2d.data_ptr() % 64 else x2d


def int8pack_mm(x2d: Tensor, weight: Tensor, weight_scale: Tensor) -> Tensor:
    """(M, in) @ int8 (out, in).T -> (M, out) in x's dtype, computed in bf16 (the only fast dtype)."""
    y = torch._weight_int8pack_mm(_aligned_bf16(x2d), weight.contiguous(), weight_scale.to(torch.bfloat16))
    return y.to(x2d.dtype)


def int4pack_weight(weight: Tensor, weight_scale: Tensor,
                    tile_rows: int = 128) -> tuple[Tensor, int, Tensor, Tensor | None]:
    """Repack an official INT4 weight for `_weight_int4pack_mm_for_cpu` (run by `int4pack_mm`).

    The kernel computes w = (u - 8) * scale + zero for u in [0, 15]; with u = q + 8 and zero = 0 that is
    exactly q * scale. A scale group of length L (L = in for per-row scales) is expressed as L / gs
    kernel groups of size gs. Returns (packed uint8, gs, scale_and_zeros bf16 (in/gs, out, 2), row_scale).
    Group-wise scales go into scale_and_zeros (rounded to bf16, the kernel's dtype), row_scale None.
    Per-row scales (the official format) are constant along a row, so they are applied to the output
    instead: row_scale is the fp16 scale as fp32 [out], and scale_and_zeros the unit scales that every
    layer of that shape shares (`cuda_matmul.tinygemm_scales`); one (in/gs, out, 2) tensor per layer would be 4 bytes
    per group and row, 0.16 GB at GLM-4-9B. Built `tile_rows` rows at a time (a multiple of the kernel's
    row blocks, so the bytes equal a whole-matrix conversion): no full-size int32 temporary; 128 rows
    are 8 MB of int32 at ChatGLM-6B's widest layer (1024 rows added ~0.15 GB to the peak RSS of a load).
    """
    out_features, in_features = weight.shape[0], weight.shape[1] * 2
    scale = weight_scale.view(out_features, -1)  # (out, G)
    group_len = in_features // scale.shape[1]
    gs = next(g for g in cuda_matmul.INT4MM_GROUPS if group_len % g == 0)  # tinygemm's, the CPU's too
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    for start in range(0, out_features, tile_rows):
        q = unpack_int4(weight[start : start + tile_rows])  # (rows, in) in [-7, 7]
        unsigned = (q + 8).to(torch.int32)
        packed[start : start + tile_rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
    return packed, gs, *cuda_matmul.tinygemm_scales(scale, in_features, gs)


def int4pack_mm(x2d: Tensor, packed: Tensor, gs: int, scale_and_zeros: Tensor, row_scale: Tensor | None) -> Tensor:
    """(M, in) @ an `int4pack_weight` weight -> (M, out) in x's dtype: the kernel (bf16), then the per-row
    scales in fp32 where they were kept apart."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_aligned_bf16(x2d), packed, gs, scale_and_zeros)
    if row_scale is not None:
        y = torch.mul(y, row_scale)  # bf16 * fp32 -> fp32
    return y.to(x2d.dtype)


# The int4pack layout, in blocks of B rows (AVX2: 32, AVX-512: 64): in a block, column k's B nibbles take
# B/2 bytes, byte j holding row j in its low nibble and row j + B/2 in its high one
# (aten/src/ATen/native/cpu/int4mm_kernel.cpp, `weight_to_int4pack_kernel`, BLOCK_N). A tail of fewer
# rows is packed otherwise, and other ISAs may differ: `int4pack_block_rows` checks which one holds here.
INT4PACK_BLOCKS = (32, 64)


def int4pack_to_int(packed: Tensor, in_features: int, out: Tensor | None = None, block: int | None = None) -> Tensor:
    """Signed int8 `[rows, in]` in [-8, 7] from rows of the int4pack layout of `block`-row blocks (default:
    this CPU's; rows % block == 0), into `out` (int8 `[rows, in]`) when given."""
    block = block or int4pack_block_rows()
    rows, half = packed.shape[0], block // 2
    b = packed.view(torch.uint8).reshape(rows // block, in_features, half).permute(0, 2, 1)
    nibbles = torch.empty(rows, in_features, dtype=torch.uint8) if out is None else out.view(torch.uint8)
    blocks = nibbles.view(rows // block, block, in_features)
    torch.bitwise_and(b, 15, out=blocks[:, :half])  # rows j of a block: low nibbles; rows j + B/2: high ones
    torch.bitwise_right_shift(b, 4, out=blocks[:, half:])
    return nibbles.view(torch.int8).sub_(8)


def whole_int4pack_blocks(rows: int) -> int:
    """`rows` rounded up to whole blocks of the kernel layout (the unit `int4pack_to_int` reads)."""
    block = int4pack_block_rows()
    return -(-rows // block) * block


@functools.cache
def int4pack_block_rows() -> int | None:
    """The block rows of this CPU's int4pack layout where `int4pack_to_int` reads it back (32 on AVX2, 64 on
    AVX-512), else None (checked once, on 192 rows: whole blocks of either)."""
    probe = torch.randint(0, 16, (192, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    except RuntimeError:  # no such kernel here
        return None
    return next((b for b in INT4PACK_BLOCKS
                 if torch.equal(int4pack_to_int(packed, 64, block=b).int() + 8, probe)), None)


def int4pack_is_invertible() -> bool:
    """Whether this CPU's int4pack layout can be read back (`int4pack_block_rows`)."""
    return int4pack_block_rows() is not None


def dequant_tiles(
    layer, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[slice, Tensor]]:
    """(rows, dequantized weight rows (r, in)): on CPU in tiles, written into `cpu_matmul.workspace`
    buffers (valid until the next tile); elsewhere one new tile holding all rows."""
    on_cpu = device.type == "cpu"
    reuse = on_cpu and dtype in (torch.float16, torch.float32)  # the dtypes `dequantize` writes into `out`
    step = cpu_matmul.tile_rows(layer.in_features) if on_cpu else layer.out_features
    if layer.held_layout == "int4pack":
        step = whole_int4pack_blocks(step)
    for start in range(0, layer.out_features, step):
        rows = slice(start, start + step)
        n = min(step, layer.out_features - start)
        out = cpu_matmul.workspace("weight", (n, layer.in_features), dtype) if reuse else None
        # a released weight: its rows from the kernel layout that holds it
        weight, bits = layer.held_rows(start, start + n) if layer.held_layout else (layer.weight[rows], layer.bits)
        yield rows, dequantize(weight, layer.weight_scale[rows], bits, dtype, out=out)


def _work_dtype(x2d: Tensor) -> torch.dtype:
    """x's dtype, or fp32 for bf16 where bf16 GEMMs are slow (`cpu_matmul`)."""
    return torch.float32 if x2d.dtype == torch.bfloat16 and cpu_matmul.slow_bf16(x2d) else x2d.dtype


def dequant_mm(x2d: Tensor, layer) -> Tensor:
    """(M, in) @ dequant(W).T -> (M, out), in x's dtype."""
    xw = x2d.to(_work_dtype(x2d))
    tiles = dequant_tiles(layer, xw.dtype, x2d.device)
    return cpu_matmul.tiled_mm(xw, tiles, layer.out_features, out_dtype=x2d.dtype)


def dequant_mm_grad(grad_y2d: Tensor, layer) -> Tensor:
    """(M, out) @ dequant(W) -> (M, in): the input gradient, in grad_y's dtype."""
    gw = grad_y2d.to(_work_dtype(grad_y2d))
    grad_x = cpu_matmul.tiled_mm_grad(gw, dequant_tiles(layer, gw.dtype, grad_y2d.device), layer.in_features)
    return grad_x.to(grad_y2d.dtype)


def quantized_matmul(x: Tensor, layer, kernel: str, bias: Tensor | None = None) -> Tensor:
    """x (..., in) @ dequant(W).T (+ bias, in x's dtype) -> (..., out) in x's dtype, by `kernel`; no autograd."""
    x2d = x.reshape(-1, layer.in_features)
    if kernel == "int8dot":  # INT8 / INT4 interleaved, quantized activations, integer dot products; adds the bias
        y, bias = int8dot_cpu.matmul(x2d, layer.weight_for(kernel), layer.float_scale(), layer.bits, bias=bias), None
    elif kernel == "int8pack":
        y = int8pack_mm(x2d, layer.weight_for(kernel), layer.weight_scale)
    elif kernel == "int4cpu":  # official INT4 read as it is, fp32 math (AVX2-only CPUs)
        y = int4_cpu.matmul(x2d, layer.weight_for(kernel), layer.weight_scale)
    elif kernel == "int4pack":
        y = int4pack_mm(x2d, *layer.weight_for(kernel))
    elif kernel == "intmm":
        y = cuda_matmul.intmm(x2d, layer.weight_for(kernel), layer.weight_scale, layer.bits)
    elif kernel == "int4mm":
        y = cuda_matmul.int4mm(x2d, *layer.weight_for(kernel))
    else:
        y = dequant_mm(x2d, layer)
    y = y.view(*x.shape[:-1], layer.out_features)
    return y if bias is None else y + bias.to(y.dtype)


class QuantizedMatmul(torch.autograd.Function):
    """y = x @ dequant(W).T with a fast forward kernel (`quantized_matmul`); backward gives grad_x only."""

    @staticmethod
    def forward(ctx, x: Tensor, layer, kernel: str) -> Tensor:
        ctx.layer = layer
        return quantized_matmul(x, layer, kernel)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        layer = ctx.layer
        grad_x = dequant_mm_grad(grad_y.reshape(-1, layer.out_features), layer)
        return grad_x.view(*grad_y.shape[:-1], layer.in_features), None, None
