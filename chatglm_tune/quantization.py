"""Weight-only INT8/INT4 quantization of ChatGLM-6B's block Linears, in the official checkpoint layout.

What is quantized: the four Linears of every GLM block (`query_key_value`, `dense`, `dense_h_to_4h`,
`dense_4h_to_h`); embeddings, LayerNorms, `lm_head` and the P-tuning prefix encoder stay in float.
Opt-in, beyond the official format: `quantize_embedding` holds the word embedding and `lm_head` in INT8,
ChatGLM-6B's tied pair as one copy, the untied ChatGLM2/3 / GLM-4 pair as one each (a runtime form,
never saved).

Format (the official ChatGLM quantization format), for `W [out, in]`:
- per-row symmetric scale `weight_scale = (absmax(W, row) / (2**(bits-1) - 1)).half()`, fp16 `[out]`;
- `q = round(W / weight_scale)`, INT8 in [-127, 127] stored as int8 `weight [out, in]`; INT4 in [-7, 7]
  packed two per byte, int8 `weight [out, in/2]`, `byte = (q[2j] << 4) | (q[2j+1] & 0xF)` (even column
  in the HIGH nibble), unpacked with arithmetic shifts (signed);
- `bias` kept in float.
Beyond the official format: INT4 with group-wise scales `weight_scale [out, in/group_size]` (the group
size belongs in the model config, never in a file name).

Matmul paths of `QuantizedLinear`. The weight-only kernels run near the memory-bandwidth limit on
AVX-512/AMX CPUs (shared notes `cpu-kernels.md`); on AVX2-only CPUs they are compute-bound, about
3-4 G weights/s a core (bench/quant.py), so INT4 decodes no faster than INT8 there.
- "int8pack" (CPU): `torch._weight_int8pack_mm`, bf16 activations, per-row scales;
- "int4pack" (CPU): `aten._weight_int4pack_mm_for_cpu` on a weight repacked once per process (the
  packed layout depends on the CPU's ISA, so it is never saved); official per-row scales are applied to
  its output in fp32, the kernel's own group scales being one shared tensor of ones;
- "dequant" (everywhere, CUDA included): dequantize to the activation dtype (in row tiles on CPU) and
  run an ordinary matmul; it also serves prefill/large batches, where the weight-only kernels lose.
Backward always gives the input gradient through the dequantized weight, never a weight gradient.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from . import cpu_matmul, heap, int4_cpu
from .options import raise_problems
from .versions import VERSIONS

# The four Linears of every ChatGLM-6B block: the default of the module swaps; the other
# versions' lists are theirs in `versions`.
TARGETS = VERSIONS["chatglm"].quantizable_linears

# Group sizes that `_weight_int4pack_mm_for_cpu` accepts, largest first (fewest scale reads).
_INT4_KERNEL_GROUPS = (256, 128, 64, 32)
KERNELS = ("auto", "int8pack", "int4pack", "int4cpu", "dequant")  # int4cpu: int4_cpu, for AVX2-only CPUs


# ------------------------------------------------------------------------------------------------
# Pure primitives
# ------------------------------------------------------------------------------------------------


def _check_format(in_features: int, bits: int, group_size: int) -> None:
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
    _check_format(in_features, bits, group_size)
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


# ------------------------------------------------------------------------------------------------
# Matmuls behind QuantizedLinear (x2d is (M, in))
# ------------------------------------------------------------------------------------------------


def _aligned_bf16(x2d: Tensor) -> Tensor:
    """bf16, contiguous, 64-byte aligned copy of x when needed: the CPU kernels segfault on rows that
    start mid-vector (a view offset by one element; cpu-kernels.md)."""
    x2d = x2d.to(torch.bfloat16).contiguous()
    return x2d.clone() if x2d.data_ptr() % 64 else x2d


def _int8pack_mm(x2d: Tensor, weight: Tensor, weight_scale: Tensor) -> Tensor:
    """(M, in) @ int8 (out, in).T -> (M, out) in x's dtype, computed in bf16 (the only fast dtype)."""
    y = torch._weight_int8pack_mm(_aligned_bf16(x2d), weight.contiguous(), weight_scale.to(torch.bfloat16))
    return y.to(x2d.dtype)


def _int4pack_weight(weight: Tensor, weight_scale: Tensor, tile_rows: int = 128) -> tuple[Tensor, int, Tensor, Tensor | None]:
    """Repack an official INT4 weight for `_weight_int4pack_mm_for_cpu` (run by `_int4pack_mm`).

    The kernel computes w = (u - 8) * scale + zero for u in [0, 15]; with u = q + 8 and zero = 0 that is
    exactly q * scale. A scale group of length L (L = in for per-row scales) is expressed as L / gs
    kernel groups of size gs. Returns (packed uint8, gs, scale_and_zeros bf16 (in/gs, out, 2), row_scale).
    Group-wise scales go into scale_and_zeros (rounded to bf16, the kernel's dtype), row_scale None.
    Per-row scales (the official format) are constant along a row, so they are applied to the output
    instead: row_scale is the fp16 scale as fp32 [out], and scale_and_zeros the unit scales that every
    layer of that shape shares (`_unit_scales`); one (in/gs, out, 2) tensor per layer would be 4 bytes per
    group and row, 0.16 GB at GLM-4-9B. Built `tile_rows` rows at a time (a multiple of the kernel's
    row blocks, so the bytes equal a whole-matrix conversion): no full-size int32 temporary; 128 rows
    are 8 MB of int32 at ChatGLM-6B's widest layer (1024 rows added ~0.15 GB to the peak RSS of a load).
    """
    out_features, in_features = weight.shape[0], weight.shape[1] * 2
    scale = weight_scale.view(out_features, -1)  # (out, G)
    group_len = in_features // scale.shape[1]
    gs = next(g for g in _INT4_KERNEL_GROUPS if group_len % g == 0)
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    for start in range(0, out_features, tile_rows):
        q = unpack_int4(weight[start : start + tile_rows])  # (rows, in) in [-7, 7]
        packed[start : start + tile_rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q + 8).to(torch.int32), 1)
    if scale.shape[1] == 1:
        return packed, gs, _unit_scales(in_features // gs, out_features), scale.view(out_features).float()
    scales = scale.repeat_interleave(group_len // gs, dim=1).t()  # (in/gs, out)
    scale_and_zeros = torch.stack((scales, torch.zeros_like(scales)), dim=-1).to(torch.bfloat16)
    return packed, gs, scale_and_zeros.contiguous(), None


@functools.cache
def _unit_scales(groups: int, out_features: int) -> Tensor:
    """The kernel's (groups, out, 2) bf16 scale_and_zeros of scale 1 and zero 0: one tensor per shape, shared."""
    return torch.stack((torch.ones(groups, out_features), torch.zeros(groups, out_features)), dim=-1).to(torch.bfloat16)


def _int4pack_mm(x2d: Tensor, packed: Tensor, gs: int, scale_and_zeros: Tensor, row_scale: Tensor | None) -> Tensor:
    """(M, in) @ an `_int4pack_weight` weight -> (M, out) in x's dtype: the kernel (bf16), then the per-row
    scales in fp32 where they were kept apart."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_aligned_bf16(x2d), packed, gs, scale_and_zeros)
    if row_scale is not None:
        y = torch.mul(y, row_scale)  # bf16 * fp32 -> fp32
    return y.to(x2d.dtype)


# The int4pack layout, in blocks of B rows (AVX2: 32, AVX-512: 64): in a block, column k's B nibbles take
# B/2 bytes, byte j holding row j in its low nibble and row j + B/2 in its high one
# (aten/src/ATen/native/cpu/int4mm_kernel.cpp, `weight_to_int4pack_kernel`, BLOCK_N). A tail of fewer
# rows is packed otherwise, and other ISAs may differ: `_int4pack_block_rows` checks which one holds here.
_INT4PACK_BLOCKS = (32, 64)


def _int4pack_to_int(packed: Tensor, in_features: int, out: Tensor | None = None, block: int | None = None) -> Tensor:
    """Signed int8 `[rows, in]` in [-8, 7] from rows of the int4pack layout of `block`-row blocks (default:
    this CPU's; rows % block == 0), into `out` (int8 `[rows, in]`) when given."""
    block = block or _int4pack_block_rows()
    rows, half = packed.shape[0], block // 2
    b = packed.view(torch.uint8).reshape(rows // block, in_features, half).permute(0, 2, 1)
    nibbles = torch.empty(rows, in_features, dtype=torch.uint8) if out is None else out.view(torch.uint8)
    blocks = nibbles.view(rows // block, block, in_features)
    torch.bitwise_and(b, 15, out=blocks[:, :half])  # rows j of a block: low nibbles; rows j + B/2: high ones
    torch.bitwise_right_shift(b, 4, out=blocks[:, half:])
    return nibbles.view(torch.int8).sub_(8)


def _whole_int4pack_blocks(rows: int) -> int:
    """`rows` rounded up to whole blocks of the kernel layout (the unit `_int4pack_to_int` reads)."""
    block = _int4pack_block_rows()
    return -(-rows // block) * block


@functools.cache
def _int4pack_block_rows() -> int | None:
    """The block rows of this CPU's int4pack layout where `_int4pack_to_int` reads it back (32 on AVX2, 64 on
    AVX-512), else None (checked once, on 192 rows: whole blocks of either)."""
    probe = torch.randint(0, 16, (192, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    except RuntimeError:  # no such kernel here
        return None
    return next((b for b in _INT4PACK_BLOCKS if torch.equal(_int4pack_to_int(packed, 64, block=b).int() + 8, probe)), None)


def _int4pack_is_invertible() -> bool:
    """Whether this CPU's int4pack layout can be read back (`_int4pack_block_rows`)."""
    return _int4pack_block_rows() is not None


def _dequant_tiles(
    layer: QuantizedLinear, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[slice, Tensor]]:
    """(rows, dequantized weight rows (r, in)): on CPU in tiles, written into `cpu_matmul.workspace`
    buffers (valid until the next tile); elsewhere one new tile holding all rows."""
    on_cpu = device.type == "cpu"
    reuse = on_cpu and dtype in (torch.float16, torch.float32)  # the dtypes `dequantize` writes into `out`
    step = cpu_matmul.tile_rows(layer.in_features) if on_cpu else layer.out_features
    if layer.holds_int4pack_only:
        step = _whole_int4pack_blocks(step)
    for start in range(0, layer.out_features, step):
        rows = slice(start, start + step)
        n = min(step, layer.out_features - start)
        out = cpu_matmul.workspace("weight", (n, layer.in_features), dtype) if reuse else None
        if layer.holds_int4pack_only:  # integers from the kernel layout; `dequantize` of int8 is q * scale
            ints = cpu_matmul.workspace("int4", (n, layer.in_features), torch.int8) if on_cpu else None
            q = _int4pack_to_int(layer._int4_cache[1][rows], layer.in_features, out=ints)
            yield rows, dequantize(q, layer.weight_scale[rows], 8, dtype, out=out)
        else:
            yield rows, dequantize(layer.weight[rows], layer.weight_scale[rows], layer.bits, dtype, out=out)


def _work_dtype(x2d: Tensor) -> torch.dtype:
    """x's dtype, or fp32 for bf16 where bf16 GEMMs are slow (`cpu_matmul`)."""
    return torch.float32 if x2d.dtype == torch.bfloat16 and cpu_matmul.slow_bf16(x2d) else x2d.dtype


def _dequant_mm(x2d: Tensor, layer: QuantizedLinear) -> Tensor:
    """(M, in) @ dequant(W).T -> (M, out), in x's dtype."""
    xw = x2d.to(_work_dtype(x2d))
    tiles = _dequant_tiles(layer, xw.dtype, x2d.device)
    return cpu_matmul.tiled_mm(xw, tiles, layer.out_features, out_dtype=x2d.dtype)


def _dequant_mm_grad(grad_y2d: Tensor, layer: QuantizedLinear) -> Tensor:
    """(M, out) @ dequant(W) -> (M, in): the input gradient, in grad_y's dtype."""
    gw = grad_y2d.to(_work_dtype(grad_y2d))
    grad_x = cpu_matmul.tiled_mm_grad(gw, _dequant_tiles(layer, gw.dtype, grad_y2d.device), layer.in_features)
    return grad_x.to(grad_y2d.dtype)


class _QuantizedMatmul(torch.autograd.Function):
    """y = x @ dequant(W).T with a fast forward kernel; backward gives grad_x only."""

    @staticmethod
    def forward(ctx, x: Tensor, layer: QuantizedLinear, kernel: str) -> Tensor:
        ctx.layer = layer
        x2d = x.reshape(-1, layer.in_features)
        if kernel == "int8pack":
            y = _int8pack_mm(x2d, layer.weight, layer.weight_scale)
        elif kernel == "int4cpu":  # official INT4 read as it is, fp32 math (AVX2-only CPUs)
            y = int4_cpu.matmul(x2d, layer.weight, layer.weight_scale)
        elif kernel == "int4pack":
            y = _int4pack_mm(x2d, *layer._int4pack())
        else:
            y = _dequant_mm(x2d, layer)
        return y.view(*x.shape[:-1], layer.out_features)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        layer = ctx.layer
        grad_x = _dequant_mm_grad(grad_y.reshape(-1, layer.out_features), layer)
        return grad_x.view(*grad_y.shape[:-1], layer.in_features), None, None


# ------------------------------------------------------------------------------------------------
# Module
# ------------------------------------------------------------------------------------------------


class QuantizedLinear(nn.Module):
    """A frozen Linear holding official-layout integer weights: `y = x @ dequant(W).T + bias`.

    Parameters (all `requires_grad=False`), named as the checkpoint keys and the only state_dict
    entries: `weight` int8 `[out, in]` (bits 8) or `[out, in/2]` (bits 4, packed), `weight_scale` fp16
    `[out]` or `[out, in/group_size]`, `bias` in the compute dtype (or None). `model.to(dtype)` casts
    the bias but keeps `weight_scale` fp16 (a cast would round the official scales).

    `kernel` picks the matmul: "auto" (default), or force "int8pack", "int4pack" or "dequant"; a forced
    kernel whose requirements are not met (shape, device, bits) falls back to "dequant", never crashes.
    `last_kernel` records the path that ran. "auto" uses the CPU kernels for at most `max_kernel_rows`
    rows of x: measured at 16384x4096 on 2 cores, dequantizing in 512-row tiles then an fp32 matmul
    ties int8pack near M = 64 and wins beyond it, and the notes' AMX machine has bf16 GEMMs that win
    sooner.
    """

    max_kernel_rows = 32

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int = 0,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float16,
    ):
        """Empty (uninitialized) layer of the given format, e.g. on "meta" before loading a checkpoint;
        `dtype` is the bias (compute) dtype."""
        super().__init__()
        _check_format(in_features, bits, group_size)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        packed_in = in_features // 2 if bits == 4 else in_features
        scale_shape = (out_features, in_features // group_size) if group_size else (out_features,)

        def frozen(shape, dt):
            return nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)

        self.weight = frozen((out_features, packed_in), torch.int8)
        self.weight_scale = frozen(scale_shape, torch.float16)
        self.bias = frozen((out_features,), dtype) if bias else None
        self.kernel = "auto"
        self.last_kernel: str | None = None
        # (data_ptr of the official weight, or None once it is released; then `_int4pack_weight`'s four)
        self._int4_cache: tuple | None = None  # never saved

    @classmethod
    def from_parts(cls, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, bits: int, group_size: int = 0) -> QuantizedLinear:
        """A layer holding these tensors as they are (the stored layout: `weight` packed for INT4; Parameters,
        e.g. a tied embedding's, shared, not wrapped); `bias` None for none, or a meta tensor for one assigned
        later (by a checkpoint loader)."""
        in_features = weight.shape[1] * (2 if bits == 4 else 1)
        layer = cls(in_features, weight.shape[0], bits, group_size, bias=False, device="meta")
        layer.weight, layer.weight_scale = _frozen(weight), _frozen(weight_scale)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int = 0) -> QuantizedLinear:
        """Quantize `linear.weight` with `quantize_weight`; the bias tensor is reused, not copied."""
        q, scale = quantize_weight(linear.weight.detach(), bits, group_size)
        return cls.from_parts(pack_int4(q) if bits == 4 else q, scale, linear.bias, bits, group_size)

    def extra_repr(self) -> str:
        packed_in = self.in_features // 2 if self.bits == 4 else self.in_features
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, weight={(self.out_features, packed_in)}, "
            f"weight_scale={tuple(self.weight_scale.shape)}, bias={self.bias is not None}"
            + (", held in the int4pack layout" if self.holds_int4pack_only else "")
        )

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out), in x's dtype."""
        kernel = self._choose_kernel(x)
        self.last_kernel = kernel
        y = _QuantizedMatmul.apply(x, self, kernel)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _choose_kernel(self, x: Tensor) -> str:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        rows = x.numel() // self.in_features
        on_cpu = x.device.type == "cpu" and self.weight.device.type == "cpu"
        usable = {
            # int8pack segfaults for K % 16 != 0 (cpu-kernels.md)
            "int8pack": self.bits == 8 and self.in_features % 16 == 0,
            # the int4 kernel needs N % 16 == 0 and scale groups made of 32..256-column kernel groups
            "int4pack": self.bits == 4
            and self.out_features % 16 == 0
            and (self.group_size or self.in_features) % 32 == 0,
            # where it beats int4pack (AVX2-only CPUs) and the official weight is still held
            "int4cpu": self.bits == 4 and on_cpu and int4_cpu.usable(self.in_features, self.out_features, self.group_size)
            and not self.holds_int4pack_only and int4_cpu.available(),
        }
        if not (on_cpu and x.is_floating_point() and rows > 0):
            return "dequant"
        if self.kernel == "auto":
            fast = "int8pack" if self.bits == 8 else "int4cpu" if usable["int4cpu"] else "int4pack"
            return fast if usable[fast] and rows <= self.max_kernel_rows else "dequant"
        return self.kernel if usable.get(self.kernel, True) else "dequant"

    @property
    def holds_int4pack_only(self) -> bool:
        """True once an INT4 weight lives only in the CPU kernel's layout (see `_int4pack`)."""
        return self._int4_cache is not None and self._int4_cache[0] is None

    def _int4pack(self) -> tuple[Tensor, int, Tensor, Tensor | None]:
        """The CPU-repacked INT4 weight, built at first use and kept for this process only.

        Where this CPU's layout can be read back (`_int4pack_block_rows`: AVX2, AVX-512), the official packed
        weight is then released: one resident copy, not two. The dequantize path reads its integers from
        the kernel layout, and `state_dict`, `load_state_dict` and `.to()` rebuild the official one.
        """
        cache = self._int4_cache
        if cache is None or (cache[0] is not None and cache[0] != self.weight.data_ptr()):
            repacked = _int4pack_weight(self.weight, self.weight_scale)
            block = _int4pack_block_rows()
            release = block is not None and self.out_features % block == 0
            self._int4_cache = (None if release else self.weight.data_ptr(), *repacked)
            if release:
                self.weight.data = torch.empty(0, dtype=torch.int8)
                heap.trim()  # the freed official weight and the repacking temporaries sit among kept tensors
        return self._int4_cache[1:]

    def _official_weight(self) -> Tensor:
        """The official packed INT4 weight `[out, in/2]`, rebuilt (tile by tile) from the kernel layout."""
        packed = self._int4_cache[1]
        step = _whole_int4pack_blocks(cpu_matmul.tile_rows(self.in_features))
        tiles = range(0, self.out_features, step)
        return torch.cat([pack_int4(_int4pack_to_int(packed[s : s + step], self.in_features)) for s in tiles])

    def _restore_official_weight(self) -> None:
        if self.holds_int4pack_only:
            self.weight.data = self._official_weight()
        self._int4_cache = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.holds_int4pack_only:
            destination[prefix + "weight"] = self._official_weight()

    def _apply(self, fn, recurse=True):
        # Move the fp16 scales with the module but never cast them; drop the repacked weight.
        self._restore_official_weight()
        return _apply_keeping_scale_dtype(self, super()._apply, fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        # load_state_dict copies in place (same data_ptr, new values): drop the repacked weight
        if self.holds_int4pack_only:
            self.weight.data = torch.empty(self.out_features, self.in_features // 2, dtype=torch.int8)
        self._int4_cache = None
        super()._load_from_state_dict(*args, **kwargs)


class QuantizedEmbedding(nn.Module):
    """An input embedding held as INT8 rows (`quantize_embedding`): `weight` int8 `[vocab, hidden]` and fp16
    per-row `weight_scale` `[vocab]`, the official rule. ChatGLM-6B's are the tied head's own Parameters (one
    copy, tied as the float embedding and head are); ChatGLM2/3's and GLM-4's its own, beside an INT8 head.

    A lookup dequantizes only the rows asked for, in the compute dtype, which the empty buffer `_dtype`
    holds so that it follows `model.to(dtype)`.
    """

    bits, group_size = 8, 0  # the format, in QuantizedLinear's terms (what a loader quantizes into)

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, *,
                 device: torch.device | str | None = None):
        """Empty (uninitialized) rows, e.g. on "meta" before a loader quantizes into them; `dtype`: the compute dtype."""
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = _frozen(torch.empty(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.weight_scale = _frozen(torch.empty(num_embeddings, dtype=torch.float16, device=device))
        # It holds no data, so never on "meta": a model loaded there can then be moved.
        self.register_buffer("_dtype", torch.empty(0, dtype=dtype, device=None if str(device) == "meta" else device),
                             persistent=False)

    @classmethod
    def from_parts(cls, weight: Tensor, weight_scale: Tensor, dtype: torch.dtype) -> QuantizedEmbedding:
        """An embedding holding these tensors as they are (Parameters, e.g. a tied head's, shared, not wrapped)."""
        embedding = cls(*weight.shape, dtype, device="meta")
        embedding.weight, embedding.weight_scale = _frozen(weight), _frozen(weight_scale)
        return embedding

    def forward(self, input_ids: Tensor) -> Tensor:
        ids = input_ids.reshape(-1)
        rows = dequantize(self.weight[ids], self.weight_scale[ids], 8, self._dtype.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, INT8 rows, computing in {self._dtype.dtype}"

    def _apply(self, fn, recurse=True):  # the fp16 scales move but are never cast
        return _apply_keeping_scale_dtype(self, super()._apply, fn, recurse)


def _frozen(tensor: Tensor) -> nn.Parameter:
    """`tensor` as a frozen Parameter; a Parameter as it is (shared: a tied embedding and head stay one)."""
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


def _apply_keeping_scale_dtype(module: nn.Module, apply, fn, recurse: bool) -> nn.Module:
    """`apply(fn, recurse)` (nn.Module._apply), then `module.weight_scale` back in its own dtype, on the
    new device: `model.to(dtype)` must not round the official fp16 scales."""
    scale = module.weight_scale.detach()
    apply(fn, recurse)
    if module.weight_scale.dtype != scale.dtype:
        module.weight_scale.data = scale.to(module.weight_scale.device)
    return module


def quantize_embedding(model: nn.Module, *, empty_init: bool = False, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace, in place, the float word embedding and `lm_head` of a model by INT8 rows (per-row scales, the
    official rule): the head becomes a `QuantizedLinear` (its decode matmul the int8pack kernel), the
    embedding a `QuantizedEmbedding`; tied (ChatGLM-6B) as one copy that both read, untied (ChatGLM2/3,
    GLM-4) as one each, the float embedding freed before the head is quantized. Beyond the official format
    (which keeps them in half: 1.07 GB at ChatGLM-6B, 2 x 1.24 GB at GLM-4-9B): half their memory and the
    fastest head on CPU, for a small logit error (tested). A runtime form for inference and for P-tuning/LoRA
    on a frozen base; saving the whole model refuses it (`refuse_int8_embedding`). `empty_init=True` (untied
    only; a tied pair is quantized as its tensor is read, `QuantizeOnLoad`) creates empty INT8 forms on the
    weights' device: a meta model that a loader then quantizes into. `dtype`: what the rows are quantized in
    and a lookup computes in (default: the float embedding's). Returns `model`.
    """
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embedding, nn.Embedding) or type(head) not in (nn.Linear, cpu_matmul.Linear) or head.bias is not None:
        raise TypeError(f"quantize_embedding needs a float nn.Embedding and a bias-free nn.Linear head, not "
                        f"{type(embedding).__name__} and {type(head).__name__} (load the model without quantize_embedding)")
    dtype, tied = dtype or embedding.weight.dtype, head.weight is embedding.weight
    if tied and empty_init:
        raise ValueError("empty_init is for an untied embedding and head: a tied one is quantized as it is read (QuantizeOnLoad)")

    def int8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:  # (int8 [rows, cols], fp16 scales [rows])
        if empty_init:
            scale = torch.empty(weight.shape[0], dtype=torch.float16, device=weight.device)
            return torch.empty_like(weight, dtype=torch.int8), scale
        return quantize_rows(weight.detach(), dtype, 8, 0)

    if tied:
        install_int8_embedding(model, *int8_rows(embedding.weight), dtype)  # the float weight is then unreferenced
        return model
    model.set_input_embeddings(QuantizedEmbedding.from_parts(*int8_rows(embedding.weight), dtype))
    del embedding  # freed before the head's quantization temporaries exist
    model.set_output_embeddings(QuantizedLinear.from_parts(*int8_rows(head.weight), None, 8))
    return model


def install_int8_embedding(model: nn.Module, weight: Tensor, weight_scale: Tensor, dtype: torch.dtype) -> None:
    """Make INT8 rows `weight [vocab, hidden]` with fp16 `weight_scale [vocab]` the model's tied head and
    input embedding (computing in `dtype`); also used by the loader, which quantizes them while reading."""
    embedding = QuantizedEmbedding.from_parts(weight, weight_scale, dtype)
    model.set_input_embeddings(embedding)
    model.set_output_embeddings(QuantizedLinear.from_parts(embedding.weight, embedding.weight_scale, None, 8))


def refuse_int8_embedding(state: dict[str, Tensor], scale_keys: tuple[str, ...]) -> None:
    """ValueError when the state dict to save holds an INT8 embedding or head (`quantize_embedding`: one of
    `scale_keys`, their `weight_scale` keys), a runtime form that no official layout has."""
    held = [k for k in scale_keys if k in state]
    if held:
        raise ValueError(f"this model holds its embedding in INT8 (quantize_embedding: {', '.join(held)}), a runtime "
                         "form with no official layout: save a model loaded without it")


# ------------------------------------------------------------------------------------------------
# Module swaps
# ------------------------------------------------------------------------------------------------

_BLOCK = re.compile(r"(^|\.)layers\.\d+(\.|$)")


def _target_slots(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, full name) of every target child inside a `layers.N` block, all checked to
    be plain `nn.Linear` before anything is swapped. Holds parents only, so that a swapped-out Linear
    is freed at once."""
    slots, problems = [], []
    for name, module in model.named_modules():
        if not _BLOCK.search(name):
            continue
        for attr, child in module.named_children():
            if attr not in targets:
                continue
            full = f"{name}.{attr}"
            if type(child) not in (nn.Linear, cpu_matmul.Linear):
                problems.append(f"{full} is {type(child).__name__}")
            slots.append((module, attr, full))
    if problems:
        raise TypeError(
            "only plain nn.Linear layers can be swapped; " + ", ".join(problems) + ". A LoRA-wrapped "
            "Linear would lose its adapter: merge the adapter first, or quantize the base before wrapping."
        )
    if not slots:
        raise ValueError(f"no Linear named one of {targets} inside a `layers.N` block")
    return slots


def quantize_model(
    model: nn.Module,
    bits: int,
    group_size: int = 0,
    *,
    targets: tuple[str, ...] = TARGETS,
    empty_init: bool = False,
) -> nn.Module:
    """Swap, in place, every `nn.Linear` named in `targets` inside a `layers.N` block for a
    `QuantizedLinear` (official `model.quantize(bits)`); embeddings, LayerNorms, `lm_head` and the
    prefix encoder are untouched. Layer by layer: each float weight is freed as soon as its quantized
    form exists, so peak memory stays about one copy of the model. `empty_init=True` creates empty
    quantized layers on the Linears' device (use a meta model, then `load_state_dict(assign=True)`).
    The model's config (when it has one) records `quantization_bit` and `quantization_group_size`.
    Returns `model`.
    """
    _record_format(model, bits, group_size)
    for parent, attr, _ in _target_slots(model, targets):
        linear = getattr(parent, attr)
        if empty_init:
            new = QuantizedLinear(
                linear.in_features, linear.out_features, bits, group_size, bias=linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype,
            )
        else:
            new = QuantizedLinear.from_linear(linear, bits, group_size)
        setattr(parent, attr, new)
        del linear, new  # the float weight goes now, not at the end of the loop
    return model


def _record_format(model: nn.Module, bits: int, group_size: int) -> None:
    config = getattr(model, "config", None)
    if config is not None:
        config.quantization_bit, config.quantization_group_size = bits, group_size


def check_bits(stored: int, requested: int | None, where) -> None:
    """ValueError when weights stored as INT`stored` are asked for as another width."""
    if requested and stored and requested != stored:
        raise ValueError(f"{where} holds INT{stored} weights; cannot load them as INT{requested}")


class QuantizeOnLoad:
    """A checkpoint placement (`checkpoint.Placement`) that quantizes while loading: each block Linear
    weight named in `targets` becomes INT`bits` rows as it is read (its layer swapped for a
    `QuantizedLinear` whose bias the loader then assigns), and with `embedding` the tied word
    embedding becomes one INT8 copy (`install_int8_embedding`). No whole float weight ever exists:
    `quantize_rows` reads a few rows at a time and releases their file pages."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, bits: int = 0, group_size: int = 0, *, embedding: bool = False,
                 embedding_key: str = "transformer.word_embeddings.weight", targets: tuple[str, ...] = TARGETS):
        self.model, self.dtype, self.bits, self.group_size = model, dtype, bits, group_size
        self.embedding_key = embedding_key if embedding else None
        self.linears = {f"{name}.weight": name for _, _, name in _target_slots(model, targets)} if bits else {}
        if bits:
            _record_format(model, bits, group_size)

    def __call__(self, key: str, tensor: Tensor, pages) -> bool:
        if key == self.embedding_key:
            install_int8_embedding(self.model, *quantize_rows(tensor, self.dtype, 8, 0, pages.release), self.dtype)
        elif key in self.linears:
            owner, _, attr = self.linears[key].rpartition(".")
            parent = self.model.get_submodule(owner)
            bias = getattr(parent, attr).bias  # meta: the loader assigns the real one when it reads it
            q, scale = quantize_rows(tensor, self.dtype, self.bits, self.group_size, pages.release)
            setattr(parent, attr, QuantizedLinear.from_parts(q, scale, bias, self.bits, self.group_size))
            heap.trim()  # the quantization temporaries interleave with small kept tensors
        else:
            return False
        return True


def quantize_rows(weight: Tensor, dtype: torch.dtype, bits: int, group_size: int, release=None) -> tuple[Tensor, Tensor]:
    """`quantize_weight(weight.to(dtype), ...)` (packed for INT4), computed a few rows at a time: the
    rule is per row, so the result is identical, and no full-size float temporary ever exists.
    `release(chunk)` is called on each chunk of `weight` once it is read (a file map's pages)."""
    out_features, in_features = weight.shape
    rows = max(1, (1 << 20) // max(1, in_features))  # ~4 MB float32 temporaries per chunk
    q_out = torch.empty(out_features, in_features // 2 if bits == 4 else in_features, dtype=torch.int8, device=weight.device)
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
    return q_out, scale_out


def to_bitsandbytes(model: nn.Module, mode: str, *, targets: tuple[str, ...] = TARGETS) -> nn.Module:
    """Swap, in place, the same Linears as `quantize_model` for bitsandbytes layers (the QLoRA base):
    `mode="int8"` -> `Linear8bitLt` (LLM.int8(), outlier threshold 6.0), `mode="nf4"` -> `Linear4bit`
    (NF4, computing in the Linear's dtype). Quantizes on the Linear's device; the bias is kept, frozen.
    Returns `model`.
    """
    if mode not in ("int8", "nf4"):
        raise ValueError(f"mode must be 'int8' or 'nf4', got {mode!r}")
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError("to_bitsandbytes needs bitsandbytes: pip install 'chatglm_tune[bnb]'") from e
    for parent, attr, _ in _target_slots(model, targets):
        linear = getattr(parent, attr)
        weight, device, has_bias = linear.weight.detach(), linear.weight.device, linear.bias is not None
        if mode == "int8":
            new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias,
                                      has_fp16_weights=False, threshold=6.0, device="meta")
            # Int8Params quantizes when moved off the CPU-held float data (bitsandbytes 0.50).
            new.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False).to(device)
        else:
            new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,
                                    compute_dtype=weight.dtype, quant_type="nf4", device="meta")
            new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4").to(device)
        if has_bias:
            new.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        setattr(parent, attr, new)
        del linear, weight, new
    return model
