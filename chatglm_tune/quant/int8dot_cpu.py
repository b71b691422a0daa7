"""Batch-1 (few-row) INT8 and INT4 matmuls on CPU with integer dot products, as llama.cpp's q4_0 x q8_0 does.

`matmul(x2d, weight, weight_scale, bits)` computes `x @ dequant(W).T` for the official layouts (INT8 `weight`
int8 `[out, in]`, INT4 packed int8 `[out, in/2]` with the even column in the high nibble; fp16 per-row
`weight_scale` `[out]`), read as they are or in the interleaved layout `pack` makes of them (the same bytes
reordered: each group of 4 or 8 rows one sequential stream, faster; QuantizedLinear holds its weight that way, made
at first use, the official one rebuilt for `state_dict`), with one
change to the arithmetic: the activations are quantized once per call, in blocks with
one fp32 scale each: `d = absmax / Q`, `q = round(x * Q / absmax)` (half to even). For INT4, int8 in blocks of 32
columns (Q = 127: llama.cpp's q8_0); for INT8, int16 in blocks of 64 (Q = 32767; `INT8_ACTIVATION_BITS`, see
there why; `act=8` gives the int8 ones). Blocks rather than one scale per row keep the error small where a few
activations are outliers (as LLM hidden states have: one large column would otherwise coarsen every column of the
row). Then for each weight row `n` and block `b` the integer dot product of `q` with the weight's integers is
exact in int32, and `y[m, n] = weight_scale[n] * sum_b d_b * dot_b`, accumulated in fp32 (`reference` is the
same arithmetic in PyTorch). Against the fp32 dequantized math, int8 activations give a relative error of 0.5%
on Gaussian activations and 1.3% with a few columns 50x the rest, where one scale per row gives 0.9% and 8.3%
and bf16 activations (the int8pack / int4pack kernels) 0.2%; int16 ones 0.006% (tests/test_int8dot_cpu.py).

The integer products, as the instructions take them:
- INT8 x int16 activations: the weight bytes sign-extended to int16 (`vpmovsxbw`), then `vpdpwssd` (AVX-512 VNNI)
  or `vpmaddwd` (AVX2), signed x signed; at most 4 products of 127 * 32767 per int32 lane: exact.
- int8 activations, AVX-512 VNNI (`vpdpbusd`, unsigned x signed, 64 bytes a step): INT4 bytes XOR 0x88 give each
  signed nibble plus 8 (offset binary, a shift and a mask apart), INT8 bytes XOR 0x80 the weight plus 128, both
  unsigned, times the signed activations; the offset times the block sums of the activations is one number per
  row of x (`off`), subtracted once per output. Exact for every int8 weight.
- int8 activations, AVX2 (`vpmaddubsw` + `vpmaddwd`, 32 bytes a step): INT4 as above (products of at most
  15 * 127: no int16 saturation); INT8 by |x| times the weight with x's sign (`vpsignb`, |x| <= 127 and
  |w| <= 127, the official range: pairs stay below 2^15).
Both are compiled into one library (`#pragma GCC target` regions) and picked at run time: AVX-512 VNNI where
the CPU has it and PyTorch runs at its AVX512 level, so `ATEN_CPU_CAPABILITY=avx2` (bench/peer/peer.py
`--capability avx2`) selects the AVX2 path as it does PyTorch's own kernels.

For INT4 the activations come in the order the nibbles unpack (per 64 packed bytes, the 64 even columns of
those 128, then the 64 odd ones), with one fp32 scale per int32 lane: every lane sums columns of one block only, so the
order costs nothing at run time (it is made with the quantized activations, once per call). Weight rows go
in blocks of 8 sharing each load of the activations (8 rather than 4: faster at batch 1), each
prefetching the weight ahead (official layout: two blocks ahead, as `int4_cpu`: rows of a few KB defeat the
hardware prefetcher; interleaved: 2 KB ahead in its stream), blocks split over PyTorch's threads by
`at::parallel_for` (OpenMP, built with `-fopenmp`). Rows of x go in tiles of 4 (AVX2: 2; 2 on the AVX-512
interleaved layout, whose passes take all 8 rows of a group): each weight chunk is loaded and unpacked once per
tile and its integer dot products taken with each of the tile's rows, at most 16 accumulators (AVX2: 8) at a time
(a block of 8 weight rows takes two passes of 4 for a tile of 4 rows); the weight is read from memory by the first
tile and from cache by the others, so prefill and batched decoding run here too. Tails (in not a multiple of 64
bytes, out not a multiple of 8) are handled: in the official layout the last partial chunk of a row is copied into
a zeroed 64-byte buffer (zero activations there) and the last rows go one at a time; the interleaved layout is
zero-padded to whole chunks and blocks (the padding rows' outputs are not written).

The kernel beats PyTorch's int8pack / int4pack (and `int4_cpu` at the AVX2 level) at batch 1, at one thread and
at two, where it reads the weight near the copy bandwidth (bench/kernels/int8dot_kernels.py; figures:
bench/results/kernel-notes.md). Rows of x: `MAX_ROWS`, `MAX_ROWS_INT8_BF16`; the layout: `INTERLEAVE`.

The decode steps the GLM mixture-of-experts models hold in C++ (`moe_decoder`, `latent_layer`) and latent attention's
float32 products (`latent_scores`, `latent_mix`) are C++ of their own, int8dot_steps.cpp, built into the same library
after this kernel's source, int8dot_cpu.cpp.

Built once per machine and torch install at first use (`inline_build`, kept in the kernel cache). Where it
cannot be built (no compiler) `available()` is False with one
warning; on CPUs without AVX2 (or not x86-64) it is False without a build; either way QuantizedLinear keeps
the kernels it used before.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from chatglm_tune.quant import cpu_matmul, inline_build

BLOCK = 32  # activation columns per fp32 scale (q8_0)
ACT_BLOCKS = {8: BLOCK, 16: 64}  # activation width -> columns per scale
# INT8 weights take int16 activations (blocks of 64, `vpdpwssd` / `vpmaddwd`): int8 ones add an error as large as
# INT8's own (0.5% per Linear on Gaussian activations, against 0.2% for int8pack's bf16), and on the golden test
# models (random weights that amplify any perturbation ~10x) they took the INT8 logits past the toolkit's bounds
# (largest relative error 0.27 against 0.2, a top-1 lost at a margin >= 0.5); int16 ones add ~0.006% (with outlier
# columns), at the same speed at the AVX-512 level (the chunk needs 2 widening moves and 2 `vpdpwssd` instead of an
# XOR and one `vpdpbusd`). INT4 keeps int8 activations, as llama.cpp's q4_0 x q8_0 (its own error is ~10x larger).
# Where it costs: AVX2's `vpmaddwd` takes half as many int16 products an instruction as `vpmaddubsw` takes int8 ones, so
# long GEMMs (prefill, batched extraction) at that level are bound by it (figures: bench/results/kernel-notes.md).
INT8_ACTIVATION_BITS = 16
# Rows of x up to which QuantizedLinear's "auto" routes here in any case (decode, batched decode): there the kernel
# beats int8pack / int4pack (bench/kernels/int8dot_kernels.py `--rows`; figures: bench/results/kernel-notes.md), as
# each weight chunk is unpacked once for a tile of 4 rows of x (2 on AVX2).
MAX_ROWS = 32
# Beyond it (prefill, batched extraction) where no gradient flows through x, the kernel is chosen over the
# dequantizing GEMM at every length for INT4, for INT8 with fp32 x (the CPU default) and for INT8 with bf16 x where the
# CPU has no native bf16 GEMM (the AVX2 level: the dequant path's bf16 runs in fp32); where it has one, for INT8 with
# bf16 x up to this many rows only (native bf16 GEMMs run at about twice the rate of int16 dot products). Figures
# (same bench): bench/results/kernel-notes.md.
MAX_ROWS_INT8_BF16 = 64
# The formats "auto" routes here (INT8 with int16 activations, `INT8_ACTIVATION_BITS`).
AUTO_BITS = (4, 8)
ISAS = {"avx2": 1, "avx512vnni": 2}
# The interleaved layout (`pack`): chunks of CHUNK weight bytes, rows padded to whole blocks of BLOCK_ROWS, and per
# path the rows whose chunks alternate: as many as one pass of the kernel takes at batch 1 (AVX-512: a block of 8;
# AVX2: 4, its registers' budget), so that a pass reads one sequential stream.
CHUNK, BLOCK_ROWS = 64, 8
INTERLEAVE = {"avx2": 4, "avx512vnni": 8}
PACK_TILE_BYTES = 8 << 20  # what `pack` rearranges at a time (in place: its one temporary)
# QuantizedLinear holds every weight interleaved, in 2 MB pages where the system gives them (`heap.huge_pages_empty`):
# at batch 1, weights streamed from memory, the interleaved layout reads rows of 4096 columns faster than the official
# one and longer rows about as fast (on 2 MB pages faster too), near the copy bandwidth at 2 threads; with 2 or more
# rows of x it reads a little slower, which prefill and batched decoding can spare (bench/kernels/int8dot_kernels.py;
# figures: bench/results/kernel-notes.md).


@functools.cache
def _build() -> bool:
    """Compile and load the kernel (once per process; the build itself is cached on disk): int8dot_cpu.cpp (the
    matmuls, `quantize`, the op registrations) followed by int8dot_steps.cpp (the decode steps), one library."""
    here = Path(__file__).parent
    source = (here / "int8dot_cpu.cpp").read_text() + (here / "int8dot_steps.cpp").read_text()
    return inline_build.build("chatglm_int8dot_cpu", source, [], "the int8 dot-product kernel",
                              "keeping the previous CPU kernels")


_x86 = inline_build.x86


def supported_isas() -> list[str]:
    """The kernel's instruction sets this CPU runs (whatever PyTorch's capability), built if needed."""
    if not (_x86() and _build()):
        return []
    return [name for name, code in ISAS.items() if torch.ops.chatglm_int8dot_cpu.isa_supported(code)]


@functools.cache
def isa() -> str | None:
    """The path `matmul` takes by default: "avx512vnni" where the CPU has AVX-512 VNNI and PyTorch runs at its
    AVX512 level, "avx2" at the AVX2 level (so `ATEN_CPU_CAPABILITY=avx2` picks it), None where neither runs
    (not x86-64, below AVX2, or no build). Checked before building: other CPUs never compile it."""
    capability = torch.backends.cpu.get_cpu_capability()
    if not _x86() or capability not in ("AVX2", "AVX512"):
        return None
    have = supported_isas()
    if capability == "AVX512" and "avx512vnni" in have:
        return "avx512vnni"
    return "avx2" if "avx2" in have else None


def available() -> bool:
    """Whether QuantizedLinear can route to `matmul` on this machine."""
    return isa() is not None


def usable(in_features: int, out_features: int, bits: int, group_size: int) -> bool:
    """Whether a layer of this format can use `matmul`: per-row scales (INT8, or INT4 without groups)."""
    return bits in (4, 8) and group_size == 0 and in_features > 0 and out_features > 0


def routes(bits: int, rows: int, dtype: torch.dtype, needs_grad: bool) -> bool:
    """Whether QuantizedLinear's "auto" sends `rows` rows of x (of `dtype`) here (`MAX_ROWS`): the weight's `bits` in
    `AUTO_BITS`; at most MAX_ROWS rows, or more where no gradient flows through x and the kernel wins there."""
    if bits not in AUTO_BITS:
        return False
    if rows <= MAX_ROWS:
        return True
    return not needs_grad and (bits == 4 or dtype == torch.float32 or rows <= MAX_ROWS_INT8_BF16
                               or not cpu_matmul.native_bf16_gemm())


def act_bits(bits: int, act: int | None = None) -> int:
    """The activation width `matmul` uses for weights of `bits`: 8 for INT4, `INT8_ACTIVATION_BITS` for INT8."""
    return act or (8 if bits == 4 else INT8_ACTIVATION_BITS)


def packed_shape(rows: int, row_bytes: int, isa_name: str | None = None) -> tuple[int, int, int, int]:
    """The shape of `pack`'s layout of an official weight of `rows` rows of `row_bytes`: `[G, NC, il, CHUNK]`."""
    il = INTERLEAVE[isa_name or isa()]
    return -(-rows // BLOCK_ROWS) * BLOCK_ROWS // il, -(-row_bytes // CHUNK), il, CHUNK


def pack(weight: Tensor, isa_name: str | None = None, in_place: bool = False, out: Tensor | None = None) -> Tensor:
    """The official INT8 `[out, in]` / packed INT4 `[out, in/2]` weight in the interleaved layout `matmul` reads
    fastest on path `isa_name` (default `isa()`): `[G, NC, il, CHUNK]`, G * il = out rounded up to BLOCK_ROWS,
    NC = chunks of a row, chunk c of row n at `[n // il, c, n % il]`, zero-padded (`unpack` reads it back).

    `out`: a tensor of `packed_shape` to write it into (e.g. one in 2 MB pages), in tiles of PACK_TILE_BYTES.
    `in_place`: where no padding is needed (out a multiple of 8, a row whole chunks; the usual model shapes) and the
    weight is contiguous, its own bytes are rearranged (in tiles of PACK_TILE_BYTES) and the result is a view of
    them: no second copy of the layer exists at any time, so loading a model does not raise its peak memory. `weight`
    is then no longer the official weight; its caller drops it."""
    rows, row_bytes = weight.shape
    groups, chunks, il, _ = packed_shape(rows, row_bytes, isa_name)
    if (rows, row_bytes) != (groups * il, chunks * CHUNK):
        padded = torch.nn.functional.pad(weight, (0, chunks * CHUNK - row_bytes, 0, groups * il - rows))
        packed = padded.view(groups, il, chunks, CHUNK).transpose(1, 2)
        return packed.contiguous() if out is None else out.copy_(packed)
    grouped = weight.view(groups, il, chunks, CHUNK)  # each group's il rows hold its bytes, in either layout
    step = max(1, PACK_TILE_BYTES // (il * row_bytes))
    if out is not None:
        for g in range(0, groups, step):
            out[g : g + step] = grouped[g : g + step].transpose(1, 2)
        return out
    if not (in_place and weight.is_contiguous()):
        return grouped.transpose(1, 2).contiguous()
    packed = weight.view(groups, chunks, il, CHUNK)
    with torch.no_grad():
        for g in range(0, groups, step):
            packed[g : g + step] = grouped[g : g + step].transpose(1, 2).clone()  # read the tile before overwriting it
    return packed


def unpack(packed: Tensor, start: int, stop: int, row_bytes: int) -> Tensor:
    """Rows start .. stop - 1 of the official weight (`row_bytes` a row) from `pack`'s layout: a new tensor."""
    groups, chunks, il, _ = packed.shape
    first = start // il
    rows = packed[first : -(-stop // il)].transpose(1, 2).reshape(-1, chunks * CHUNK)
    return rows[start - first * il : stop - first * il, :row_bytes].contiguous()


def matmul(x2d: Tensor, weight: Tensor, weight_scale: Tensor, bits: int, isa_name: str | None = None,
           act: int | None = None, bias: Tensor | None = None) -> Tensor:
    """(M, in) @ dequant(W).T (+ bias) -> (M, out) in x's dtype, with x quantized (`reference`), for the official
    INT8 / INT4 `weight` (or the same in `pack`'s layout, read faster) and per-row `weight_scale` (check `available()`
    and `usable` first). The product is computed in fp32 and rounded to x's dtype; `bias` is added after, in that
    dtype, as to the output of a Linear without one. `isa_name` forces a path ("avx2", "avx512vnni"; default `isa()`),
    `act` the activation width (8, or 16 for INT8; default `act_bits`)."""
    code = ISAS[isa_name or isa()]
    _build()  # cached: a no-op once built (a forced `isa_name` may come first)
    return torch.ops.chatglm_int8dot_cpu.mm(x2d, weight.contiguous(), weight_scale, bits, code,
                                            act_bits(bits, act), bias)


def matmul_multi(x: Tensor, weights: list[Tensor], weight_scales: list[Tensor], bits: int, isa_name: str | None = None,
                 act: int | None = None) -> Tensor:
    """G products in one call: x (G, M, in), group g's rows times dequant(weights[g]).T -> (G, M, out) in x's dtype,
    each as `matmul` computes it (bit for bit); the weights of one format and shape (official or `pack`'s layout).
    Scales in float32 are read as they are (fp16 ones are converted at every call)."""
    code = ISAS[isa_name or isa()]
    _build()
    return torch.ops.chatglm_int8dot_cpu.mm_multi(x, [w.contiguous() for w in weights], list(weight_scales), bits, code,
                                                  act_bits(bits, act))


def matmul_groups(x2d: Tensor, starts: list[int], counts: list[int], weights: list[Tensor], weight_scales: list[Tensor],
                  bits: int, isa_name: str | None = None, act: int | None = None) -> Tensor:
    """Groups of rows in one call: group g's rows `starts[g]` .. `starts[g] + counts[g] - 1` of x2d (in) times
    dequant(weights[g]).T -> (sum of counts, out) in x's dtype, the groups' rows one after another, each group's as
    `matmul` computes them (bit for bit); the weights of one format and shape. Groups may share rows."""
    code = ISAS[isa_name or isa()]
    _build()
    return torch.ops.chatglm_int8dot_cpu.mm_groups(x2d, list(starts), list(counts), [w.contiguous() for w in weights],
                                                   list(weight_scales), bits, code, act_bits(bits, act))


def latent_scores(q: Tensor, q_rot: Tensor, keys: Tensor, shared: Tensor) -> Tensor:
    """Latent attention's scores before scaling: q keys^T + q_rot shared^T [b, M, L] in float32, from q [b, M, R],
    q_rot [b, M, r], keys [b, L, R], shared [b, L, r] on the CPU. The entries are split over PyTorch's threads, each
    score summed whole by one thread: the same bits at any thread count (the C++ source's `latent_scores`)."""
    _build()
    return torch.ops.chatglm_int8dot_cpu.latent_scores(q, q_rot, keys, shared)


def latent_mix(p: Tensor, keys: Tensor) -> Tensor:
    """p keys [b, M, R] in float32 (p [b, M, L], keys [b, L, R], on the CPU): the latent's columns split over the
    threads, each sum taken whole over the entries in order by one thread."""
    _build()
    return torch.ops.chatglm_int8dot_cpu.latent_mix(p, keys)


def moe_decoder(weights: list[Tensor], scales: list[Tensor], experts: int, router: Tensor, bias: Tensor, top_k: int,
                norm: bool, factor: float, bits: int, isa_name: str | None = None):
    """A mixture-of-experts layer's decode step held in C++ (`.step(x)`: x [1, H] -> [1, H]): `weights` / `scales` per
    expert gate, up, down (`pack`'s layout or official; float32 scales), the `experts` routed ones then, where given,
    the shared one; the router's `router` weight, `bias` (its score correction), `top_k`, `norm` and `factor` as
    transformers' GLM routers hold them (one group of experts). The same arithmetic as the Python step, bit for bit:
    the C++ source's `MoeDecoder`."""
    code = ISAS[isa_name or isa()]
    _build()
    return torch.classes.chatglm_int8dot_cpu.MoeDecoder([w.contiguous() for w in weights], list(scales),
                                                        experts, router, bias, top_k, norm, factor, bits, code,
                                                        act_bits(bits))


def latent_layer(linears: list[tuple[Tensor, Tensor, int]], norms: list[tuple[Tensor, float]],
                 absorbed: tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], int],
                 dims: tuple[int, int, int, int, int], scaling: float, interleave: bool, moe,
                 isa_name: str | None = None):
    """A GLM-4.7-Flash decoder layer's one-token decode step held in C++ (`.begin(x, cos, sin)`, then the cache's
    update, then `.finish(x, query, q_rot, latents, k_rots, mask)`): `linears` q_a_proj, q_b_proj, kv_a_proj_with_mqa,
    o_proj as (weight in `pack`'s layout or official, float32 scale, bits); `norms` the input, q_a, kv_a and
    post-attention norms as (weight, eps); `absorbed` kv_b_proj's INT8 key weights and scales per head, its value
    weights and scales per head and their bits; `dims` heads, no-rotary key, rotary, value and latent widths; the
    attention's `scaling` and rotary layout; `moe` the layer's `moe_decoder`. The same arithmetic as the Python step,
    bit for bit: the C++ source's `LatentLayer`."""
    code = ISAS[isa_name or isa()]
    _build()
    key_w, key_s, value_w, value_s, value_bits = absorbed
    bits = [b for _, _, layer_bits in linears for b in (layer_bits, act_bits(layer_bits))]
    bits += [8, act_bits(8), value_bits, act_bits(value_bits)]
    return torch.classes.chatglm_int8dot_cpu.LatentLayer(
        [w.contiguous() for w, _, _ in linears], [s for _, s, _ in linears], bits, [w for w, _ in norms],
        [float(eps) for _, eps in norms], key_w, key_s, value_w, value_s, [*dims, code], float(scaling),
        interleave, moe)


def quantize_activations(x2d: Tensor, act: int = 8) -> tuple[Tensor, Tensor]:
    """The kernel's own activation quantization of fp32 (M, K): int8 (M, K) and fp32 scales (M, ceil(K/32)), or for
    `act` 16 int16 (M, K) and (M, ceil(K/64))."""
    return torch.ops.chatglm_int8dot_cpu.quantize(x2d.float().contiguous(), act)


def reference_quantize(x2d: Tensor, act: int = 8) -> tuple[Tensor, Tensor]:
    """`quantize_activations` in PyTorch: per block of 32 columns (64 for int16; the last one partial), d = absmax / Q
    and q = round(x * (Q / absmax)), half to even, 0 where absmax is 0, Q = 127 (32767 for int16)."""
    block, qmax = ACT_BLOCKS[act], 2 ** (act - 1) - 1
    x = x2d.float()
    M, K = x.shape
    nb = -(-K // block)
    xb = torch.nn.functional.pad(x, (0, nb * block - K)).view(M, nb, block)
    amax = xb.abs().amax(-1)
    # a true fp32 division (`qmax / amax` would be `amax.reciprocal() * qmax`, an ulp off at times)
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))
    q = (xb * inv[..., None]).round().clamp(-qmax, qmax).to(torch.int8 if act == 8 else torch.int16)
    return q.view(M, -1)[:, :K].contiguous(), amax / qmax


def reference(x2d: Tensor, weight: Tensor, weight_scale: Tensor, bits: int, act: int | None = None) -> Tensor:
    """The same arithmetic as `matmul`, in PyTorch (float64 at the end): quantized activations times the weight's
    integers, exact int64 sums per block, times the block scales, summed, times the row scale."""
    from chatglm_tune.quant.format import unpack_int4

    act = act_bits(bits, act)
    block = ACT_BLOCKS[act]
    q, d = reference_quantize(x2d, act)
    M, K = q.shape
    w = unpack_int4(weight) if bits == 4 else weight  # (N, K) integers
    nb = d.shape[1]
    pad = nb * block - K
    qb = torch.nn.functional.pad(q.long(), (0, pad)).view(M, nb, block)
    wb = torch.nn.functional.pad(w.long(), (0, pad)).view(w.shape[0], nb, block)
    dots = torch.einsum("mbk,nbk->mnb", qb, wb)  # exact
    return (dots.double() * d.double()[:, None, :]).sum(-1) * weight_scale.double().view(1, -1)
