"""Weight-only matmuls for INT8 / INT4 weights on a CUDA GPU: they read the integer weight, never a float copy of it.

- "intmm" (INT8 and per-row INT4; any device; CUDA's choice but for INT4 under bf16):
  `linear(x, ints(W).to(x.dtype)) * scale`, the per-row scales on the output in float32. Eagerly that is a cast
  and an ordinary matmul; in a compiled decode step (`static_decoding`, which compiles with coordinate-descent
  tuning on CUDA) PyTorch's compiler turns a one-row matmul into a reduction and fuses the unpacking and the cast
  into it, so the step reads the integer weight alone.
- "int4mm" (INT4 under bf16 activations, CUDA compute capability 8.0 or newer): PyTorch's tinygemm kernel
  (`aten._weight_int4pack_mm`) on the weight repacked once per process into its tiled layout (`int4mm_weight`;
  the official weight is then released: one copy held). The kernel computes w = (u - 8) * scale + zero for u in
  [0, 15]; with u = q + 8 and zero 0 that is q * scale exactly. Per-row scales (the official format) are applied to
  the output in float32 and the kernel's group scales are ones (shared by every layer of a shape), so the official
  fp16 scales are never rounded; group-wise scales go into the kernel's groups, rounded to bf16 (its dtype). The
  kernel takes bf16 activations (fp16 ones would lose precision to it: they take intmm).
`int4mm_to_int` reads integers back from the tiled layout (the kernel times identity rows: exact, |q| <= 8), which
`state_dict` and the dequantizing path use once the official weight is released.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from chatglm_tune.quant.format import unpack_int4

INT4MM_GROUPS = (256, 128, 64, 32)  # tinygemm's group sizes (CPU's int4pack too), largest first: fewest scale reads
INT4MM_INNER_K_TILES = (8, 4, 2)  # the layout's inner k tiles (16 columns each), largest first
INT4MM_ROWS = 8  # the layout's output rows come in blocks of this many
INT4MM_CAPABILITY = (8, 0)  # tinygemm needs bf16 tensor cores (Ampere or newer)
UNPACK_TILE = 1024  # identity rows a call of `int4mm_to_int`


def intmm(x2d: Tensor, weight: Tensor, weight_scale: Tensor, bits: int) -> Tensor:
    """(M, in) @ an official INT8 / per-row INT4 weight (out, in or in/2).T -> (M, out) in x's dtype: the integers
    cast to x's dtype inside the matmul, then the per-row scales in float32."""
    ints = unpack_int4(weight) if bits == 4 else weight
    y = torch.nn.functional.linear(x2d, ints.to(x2d.dtype))
    return torch.mul(y, weight_scale.float()).to(x2d.dtype)


def int4mm_shape(in_features: int, out_features: int, group_size: int) -> tuple[int, int] | None:
    """(kernel group size, inner k tiles) for a layer of this shape, or None where tinygemm cannot run it."""
    group_len = group_size or in_features
    gs = next((g for g in INT4MM_GROUPS if group_len % g == 0), None)
    tiles = next((t for t in INT4MM_INNER_K_TILES if in_features % (16 * t) == 0), None)
    if gs is None or tiles is None or out_features % INT4MM_ROWS:
        return None
    return gs, tiles


@functools.cache
def tinygemm_runs(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU that tinygemm runs on (compute capability 8.0 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= INT4MM_CAPABILITY


def int4mm_weight(weight: Tensor, weight_scale: Tensor,
                  tile_rows: int = 4096) -> tuple[Tensor, int, Tensor, Tensor | None]:
    """An official INT4 weight (int8 [out, in/2] on a CUDA GPU) in tinygemm's layout: (packed, gs, scale_and_zeros
    bf16 (in/gs, out, 2), row_scale float32 [out] or None); see the module docstring. Repacked `tile_rows` rows at a
    time (the layout's rows are independent in blocks of 8). The tensors are marked as static addresses: a compiled
    step's CUDA graphs read them in place rather than copying them at each replay."""
    out_features, in_features = weight.shape[0], weight.shape[1] * 2
    scale = weight_scale.view(out_features, -1)  # (out, G)
    group_len = in_features // scale.shape[1]
    gs, tiles = int4mm_shape(in_features, out_features, 0 if scale.shape[1] == 1 else group_len)
    parts = []
    for start in range(0, out_features, tile_rows):
        u = (unpack_int4(weight[start : start + tile_rows]) + 8).view(torch.uint8)  # [rows, in] in [1, 15]
        parts.append(torch.ops.aten._convert_weight_to_int4pack((u[:, 0::2] << 4) | u[:, 1::2], tiles))
    packed = torch.cat(parts) if len(parts) > 1 else parts[0]
    held = (packed, gs, *tinygemm_scales(scale, in_features, gs))
    for t in held:
        if isinstance(t, Tensor):
            torch._dynamo.mark_static_address(t)
    return held


def tinygemm_scales(scale: Tensor, in_features: int, gs: int) -> tuple[Tensor, Tensor | None]:
    """(scale_and_zeros bf16 (in/gs, out, 2), row_scale float32 [out] or None) of official scales `scale` (out, G) for
    tinygemm's kernels (CUDA's, and the CPU's int4pack, which share the convention): per-row scales (G = 1) kept
    apart for the output, the kernel's own scales the shared ones (`unit_scales`); group-wise ones expressed as
    kernel groups of `gs` columns, rounded to bf16."""
    out_features, groups = scale.shape
    if groups == 1:
        return unit_scales(in_features // gs, out_features, scale.device), scale.view(-1).float()
    scales = scale.repeat_interleave(in_features // groups // gs, dim=1).t()  # (in/gs, out)
    return torch.stack((scales, torch.zeros_like(scales)), dim=-1).to(torch.bfloat16).contiguous(), None


@functools.cache
def unit_scales(groups: int, out_features: int, device: torch.device) -> Tensor:
    """tinygemm's (groups, out, 2) bf16 scale_and_zeros of scale 1 and zero 0: one tensor per shape, shared."""
    ones = torch.ones(groups, out_features, device=device)
    return torch.stack((ones, torch.zeros_like(ones)), dim=-1).to(torch.bfloat16)


def int4mm(x2d: Tensor, packed: Tensor, gs: int, scale_and_zeros: Tensor, row_scale: Tensor | None) -> Tensor:
    """(M, in) @ an `int4mm_weight` weight -> (M, out) in x's dtype: tinygemm in bf16, then the per-row scales in
    float32 where they were kept apart."""
    y = torch.ops.aten._weight_int4pack_mm(x2d.to(torch.bfloat16).contiguous(), packed, gs, scale_and_zeros)
    if row_scale is not None:
        y = torch.mul(y, row_scale)  # bf16 * fp32 -> fp32
    return y.to(x2d.dtype)


def int4mm_to_int(packed: Tensor, gs: int, in_features: int, out_features: int) -> Tensor:
    """The signed integers int8 [out, in] held in tinygemm's layout: the kernel with unit scales times `UNPACK_TILE`
    identity rows at a time gives the columns' integers exactly."""
    unit = unit_scales(in_features // gs, out_features, packed.device)
    columns = []
    for start in range(0, in_features, UNPACK_TILE):
        n = min(UNPACK_TILE, in_features - start)
        eye = torch.zeros(n, in_features, dtype=torch.bfloat16, device=packed.device)
        eye[:, start : start + n].fill_diagonal_(1)
        columns.append(torch.ops.aten._weight_int4pack_mm(eye, packed, gs, unit).t().to(torch.int8))  # [out, n]
    return torch.cat(columns, dim=1)
