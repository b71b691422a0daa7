"""The official ChatGLM INT8/INT4 weight format, as pure functions on tensors.

For `W [out, in]`:
- per-row symmetric scale `weight_scale = (absmax(W, row) / (2**(bits-1) - 1)).half()`, fp16 `[out]`;
- `q = round(W / weight_scale)`, INT8 in [-127, 127] stored as int8 `weight [out, in]`; INT4 in [-7, 7]
  packed two per byte, int8 `weight [out, in/2]`, `byte = (q[2j] << 4) | (q[2j+1] & 0xF)` (even column
  in the HIGH nibble), unpacked with arithmetic shifts (signed);
- `bias` kept in float.
Beyond the official format: INT4 with group-wise scales `weight_scale [out, in/group_size]` (the group
size belongs in the model config, never in a file name).
"""

from __future__ import annotations

import torch
from torch import Tensor

from chatglm_tune.options import raise_problems
from chatglm_tune.runtime import heap


# ------------------------------------------------------------------------------------------------
# Pure primitives
# ------------------------------------------------------------------------------------------------


def check_format(in_features: int, bits: int, group_size: int) -> None:
    problems = []
    if bits not in (4, 8):
        problems.append(f"bits must be 4 or 8, got {bits}")
    if bits == 4 and in_features % 2:
        problems.append(f"INT4 packs two columns per byte: in_features={in_features} must be even")
    if group_size < 0:
        problems.append(f"group_size must be >= 0, got {group_size}")
    if group_size > 0 and bits != 4:
        problems.append("group-wise scales are an INT4 extension: use group_size=0 with bits=8")
    if group_size > 0 and in_features % group_size:
        problems.append(f"in_features={in_features} is not a multiple of group_size={group_size}")
    raise_problems(problems)


def quantize_weight(w: Tensor, bits: int, group_size: int = 0) -> tuple[Tensor, Tensor]:
    """Symmetric quantization of `w [out, in]` with the official ChatGLM rule.

    Returns `q` int8 `[out, in]` in [-127, 127] (bits 8) or [-7, 7] (bits 4), unpacked, and
    `scale` fp16 `[out]` (group_size 0, official) or `[out, in/group_size]` (group-wise INT4).

    Dtypes: for fp16 `w` everything runs in fp16, as the official code does on CUDA (the fp16 absmax
    divided by 127 or 7 in fp16, then `w / scale` in fp16 before rounding), so the result is
    bit-identical to it. For fp32 and bf16 `w` the scale is computed in fp32 and rounded to fp16, and
    `w / scale` runs in fp32 with that fp16 scale: what PyTorch's type promotion does in the official
    line for fp32 weights (for bf16 weights the official line would round the scale through bf16 first;
    we do not). Rows whose scale is 0 (all zeros, or an absmax that underflows fp16) give q = 0, never
    NaN; q is clamped to the symmetric range, a no-op for normal weights.
    """
    out_features, in_features = w.shape
    check_format(in_features, bits, group_size)
    qmax = 2 ** (bits - 1) - 1
    work = torch.float16 if w.dtype == torch.float16 else torch.float32
    groups = w.to(work).view(out_features, -1, group_size or in_features)  # (out, G, group)
    scale = (groups.abs().amax(dim=-1) / qmax).half()  # (out, G) fp16
    divisor = scale.to(work)
    divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    q = torch.div(groups, divisor[..., None]).round_().clamp_(-qmax, qmax)
    q = q.to(torch.int8).view(out_features, in_features)
    return q, (scale if group_size else scale.squeeze(1))


def pack_int4(q: Tensor) -> Tensor:
    """Pack int8 `q [..., in]` with values in [-8, 7] into int8 `[..., in/2]`, even column high."""
    hi = q[..., 0::2].view(torch.uint8)
    lo = q[..., 1::2].view(torch.uint8)
    return ((hi << 4) | (lo & 0xF)).view(torch.int8)


def unpack_int4(packed: Tensor) -> Tensor:
    """Unpack int8 `packed [..., in/2]` into signed int8 `[..., in]` (arithmetic shifts)."""
    hi = packed >> 4  # int8 >> sign-extends the high nibble
    lo = (packed << 4) >> 4  # (int8)(byte << 4) >> 4
    return torch.stack((hi, lo), dim=-1).flatten(-2)


def dequantize(
    weight: Tensor, weight_scale: Tensor, bits: int, dtype: torch.dtype = torch.float16, out: Tensor | None = None
) -> Tensor:
    """Float weight `[out, in]` from a stored `weight` (int8 `[out, in]`, or packed `[out, in/2]` for
    INT4) and `weight_scale` (`[out]`, or `[out, in/group]`: the group size follows from its shape).

    fp16 output is computed in fp16, exactly as the official kernel (`scale * q` is exact in fp32, so
    one fp16 rounding); other dtypes are computed in fp32 and rounded once. `out`, an fp16 or fp32
    tensor `[out, in]` of `dtype`, receives the result instead of a new tensor.
    """
    q = unpack_int4(weight) if bits == 4 else weight
    out_features = q.shape[0]
    work = dtype if dtype in (torch.float16, torch.float32) else torch.float32
    scale = weight_scale.view(out_features, -1).to(work)  # (out, G)
    w = out.copy_(q) if out is not None and work == dtype else q.to(work)
    w = w.view(out_features, scale.shape[1], -1).mul_(scale[..., None])  # (out, G, group), no second copy
    return w.view(out_features, -1).to(dtype)


def check_bits(stored: int, requested: int | None, where) -> None:
    """ValueError when weights stored as INT`stored` are asked for as another width."""
    if requested and stored and requested != stored:
        raise ValueError(f"{where} holds INT{stored} weights; cannot load them as INT{requested}")


def quantize_rows(weight: Tensor, dtype: torch.dtype, bits: int, group_size: int,
                  release=None) -> tuple[Tensor, Tensor]:
    """`quantize_weight(weight.to(dtype), ...)` (packed for INT4), computed a few rows at a time: the
    rule is per row, so the result is identical, and no full-size float temporary ever exists.
    `release(chunk)` is called on each chunk of `weight` once it is read (a file map's pages). On the CPU the
    chunks' float temporaries, freed among small tensors that stay, go back to the system at the end (`heap.trim`):
    without that a ChatGLM3-6B INT8 load kept 0.16 GB of them resident at its peak."""
    out_features, in_features = weight.shape
    rows = max(1, (1 << 20) // max(1, in_features))  # ~4 MB float32 temporaries per chunk
    q_shape = (out_features, in_features // 2 if bits == 4 else in_features)
    q_out = (heap.large_empty(q_shape, torch.int8) if weight.device.type == "cpu"  # 2 MB pages where offered
             else torch.empty(q_shape, dtype=torch.int8, device=weight.device))
    scale_out = None
    for start in range(0, out_features, rows):
        chunk = weight[start : start + rows]
        q, scale = quantize_weight(chunk.to(dtype) if chunk.is_floating_point() else chunk, bits, group_size)
        q_out[start : start + rows] = pack_int4(q) if bits == 4 else q
        if scale_out is None:
            scale_out = scale.new_empty((out_features, *scale.shape[1:]))
        scale_out[start : start + rows] = scale
        if release is not None:
            release(chunk)
    if weight.device.type == "cpu":
        heap.trim()
    return q_out, scale_out
