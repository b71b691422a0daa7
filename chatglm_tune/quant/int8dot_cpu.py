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
in blocks of 8 sharing each load of the activations (8 rather than 4: 12-20% faster at batch 1, one thread), each
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

Measured (bench/kernels/int8dot_kernels.py, bench/results/int8dot_kernels.json; a 2-core AVX-512 VNNI EPYC, quiet; weights
streamed from memory, 4 KB pages), ms at batch 1, 4096x4096 / 4608x4096 / 12288x4096 / 27392x4096 / 4096x13696,
interleaved but the last shape official, AVX512 level, one thread: INT4 0.43 / 0.41 / 1.07 /
2.37 / 1.65 against int4pack's 0.90 / 1.00 / 2.61 / 5.77 / 2.98 (1.8-2.4x), INT8 (int16 activations) 0.99 / 0.97 /
2.66 / 5.41 / 3.01 against int8pack's 1.44 / 1.51 / 4.06 / 8.73 / 3.91 (1.3-1.6x); two threads INT4 at 79-113% of
the copy bandwidth, INT8 at 80-103% (int8pack 64-80%). At the AVX2 level, one thread: INT4 0.41 / 0.39 / 1.12 /
2.40 / 1.83 against int4_cpu's 0.88 / 0.95 / 2.56 / 5.47 / 2.61, INT8 0.89 / 0.82 / 2.40 / 5.60 / 3.53 against
int8pack's 1.59 / 1.70 / 4.50 / 10.03 / 4.11 (on 2 MB pages: the note below `INTERLEAVE`). Rows of x: `MAX_ROWS`,
`MAX_ROWS_INT8_BF16`; the layout: `INTERLEAVE`. In cache INT4 runs at about 26 GB/s of weight bytes a core, near what two cores stream from
memory: unpacking two nibbles a byte is more arithmetic a byte than INT8's.

The decode steps the GLM mixture-of-experts models hold in C++ (`moe_decoder`, `latent_layer`) and latent attention's
float32 products (`latent_scores`, `latent_mix`) are C++ of their own, int8dot_steps.cpp, built into the same library
after this kernel.

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
# columns), at the same speed in side-by-side runs (the chunk needs 2 widening moves and 2 `vpdpwssd` instead of an
# XOR and one `vpdpbusd`). INT4 keeps int8 activations, as llama.cpp's q4_0 x q8_0 (its own error is ~10x larger).
# Where it costs: AVX2's `vpmaddwd` takes half as many int16 products an instruction as `vpmaddubsw` takes int8 ones, so
# long GEMMs at that level are bound by it (ChatGLM3-6B, 2 threads: a 512-token INT8 prefill 0.96x llama.cpp's q8_0 speed,
# batch-32 extraction 0.74x, where INT4 with int8 activations extracts 2.1x as fast as INT8).
INT8_ACTIVATION_BITS = 16
# Rows of x up to which QuantizedLinear's "auto" routes here in any case (decode, batched decode): bench/kernels/int8dot_kernels.py
# `--rows` (12288x4096, results/int8dot_kernels.json) measured it 1.4-2.8x faster than int8pack / int4pack from 4
# to 32 rows (1 thread, AVX-512 level: INT8 24 ms at 32 rows against int8pack's 48, INT4 13 against int4pack's 37):
# each weight chunk is unpacked once for a tile of 4 rows of x (2 on AVX2).
MAX_ROWS = 32
# Beyond it (prefill, batched extraction) where no gradient flows through x, against the dequantizing GEMM (same
# bench, 2 threads, AVX-512 level): INT4 won at every length (512 rows: 116 ms against 336 with fp32 x, 165 with
# bf16), INT8 with fp32 x (the CPU default: 196 against 319) and with bf16 x up to 64 rows (24 against 26; at 128
# rows 50 against 41, at 512 196 against 149: native bf16 GEMMs run at about twice the rate of int16 dot products).
# Without native bf16 GEMMs (the AVX2 level: the dequant path's bf16 runs in fp32) it won at every length.
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
# QuantizedLinear holds every weight interleaved, in 2 MB pages where the system gives them (`heap.huge_pages_empty`).
# Measured side by side at batch 1, weights streamed from memory (2-core AVX-512 EPYC): on 4 KB pages INT4 with 4096
# columns (2048-byte rows: ChatGLM2/3's and GLM-4's qkv, dense and h_to_4h) ran 1.1-1.8x faster interleaved (2
# threads: 90-113% of the copy bandwidth, against 65-73% on the official layout; AVX2 level 1.4-2.0x), INT8 with 4096
# columns 1.0-1.4x, while rows of 6848 bytes (INT4 4096x13696) and more ran within a few percent either way
# (bench/kernels/int8dot_kernels.py, bench/results/int8dot_kernels.json). On 2 MB pages the long rows gain too: 4096x13696 INT4
# 0.83 ms against 0.89 official at 2 threads, 1.27 against 1.50 at one (AVX2 level 1.59 against 1.72), INT8 1.62
# against 1.74 and 2.52 against 2.86. The kernel bench's `-2m` candidates (bench/results/int8dot_kernels-2m.json): at 2 threads
# 88-104% of the copy bandwidth on 2 MB pages (37.2 GB/s; 31.0 on 4 KB pages), INT4 27392x4096 1.20 ms (46.7 GB/s
# read); at one thread INT4 79-81% and INT8 65-68% of it (31.9 GB/s): there a core's arithmetic limits, not memory.
# With 2 or more rows of x the interleaved layout reads a little slower (12288x4096: 0.75-0.96x from 2 to 512 rows),
# which prefill and batched decoding can spare.

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QB = 32;            // activation columns per scale (int8 activations)
constexpr int64_t QB16 = 64;          // the same for int16 activations (INT8 weights): one 64-byte weight chunk
constexpr int64_t CH = 64;            // weight bytes per chunk: one 512-bit vector, two 256-bit ones
constexpr int64_t R = 8;              // weight rows per block: they share each load of the activations
constexpr int64_t PF = 2 * R;         // official layout: each row prefetches the same bytes this many rows ahead
constexpr int64_t PF_PACKED = 2048;   // interleaved layout: each row prefetches this many bytes ahead in its stream
constexpr int MT_MAX = 4;             // rows of x per tile: each unpacked weight chunk serves this many
constexpr int MT_MAX_AVX2 = 2;        // the same with AVX2's 16 registers
constexpr int ACC512 = 16;            // accumulators (rows of W x rows of x) per pass: 16 of the 32 zmm registers
constexpr int ACC256 = 8;             // the same of AVX2's 16 ymm registers

// the activations, prepared once per call
struct Act {
  const int8_t* q;   // [M, KP], in chunk order (INT4: per 128 columns, the 64 even ones then the 64 odd ones)
  const float* dv;   // [M, NC * 16]: per chunk, the block scale of each of 16 int32 lanes
  const float* off;  // [M]: offset * sum_b d_b * sum(q of block b), subtracted from every output of row m
  int64_t KP, NC;
};

// q8_0: per block of 32 columns d = absmax / 127, q = round_half_even(x * (127 / absmax)) (0 where absmax is 0);
// AVX2 (every path needs it): `vcvtps2dq` rounds half to even as nearbyint does (a libm call per value here, which
// made the quantization of 4096 columns cost ~40 us a call). A partial last block goes through a zeroed buffer.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
// q: rows of `ldq` bytes (>= K)
// Block b of 8 * V columns of row xr (K columns; a partial last block through a zeroed buffer) into v; returns its
// absmax, NaN where the block holds NaN / inf (a NaN scale: the outputs of the row are NaN, as the float math's).
template <int V>
inline float load_block(const float* xr, int64_t K, int64_t b, __m256 (&v)[V]) {
  alignas(32) float buf[8 * V];
  const float* xb = xr + b * 8 * V;
  const int64_t len = std::min<int64_t>(8 * V, K - b * 8 * V);
  if (len < 8 * V) {
    std::memset(buf, 0, sizeof(buf));
    std::memcpy(buf, xb, len * sizeof(float));
    xb = buf;
  }
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int i = 0; i < V; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 a = _mm256_andnot_ps(sign, v[i]);
    amax = _mm256_max_ps(amax, a);
    total = _mm256_add_ps(total, a);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float am = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  alignas(32) float t[8];
  _mm256_store_ps(t, total);
  float tot = 0.f;
  for (int i = 0; i < 8; ++i) tot += t[i];
  return std::isfinite(tot) ? am : NAN;
}

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, int64_t ldq, float* d, int32_t* bsum) {
  const int64_t nb = (K + QB - 1) / QB;
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  alignas(32) int8_t out[QB];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t len = std::min(QB, K - b * QB);
      __m256 v[4];
      const float am = load_block(x + m * K, K, b, v);
      const __m256 id = _mm256_set1_ps(am > 0.f ? 127.f / am : 0.f);
      __m256i r[4];
      for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // |.| <= 127 (+ rounding)
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
      const __m256i qv = _mm256_max_epi8(_mm256_permutevar8x32_epi32(p, order), _mm256_set1_epi8(-127));
      // the block's sum (finite x: the same integers; the padding is 0)
      const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
      __m128i s1 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
      s1 = _mm_add_epi32(s1, _mm_shuffle_epi32(s1, 0x4E));
      s1 = _mm_add_epi32(s1, _mm_shuffle_epi32(s1, 0xB1));
      const int32_t sum = _mm_cvtsi128_si32(s1);
      if (len == QB) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * ldq + b * QB), qv);
      } else {
        _mm256_store_si256(reinterpret_cast<__m256i*>(out), qv);
        std::memcpy(q + m * ldq + b * QB, out, len);
      }
      d[m * nb + b] = am / 127.f;
      bsum[m * nb + b] = sum;
    }
}

// For INT8 weights: int16 activations in blocks of 64 columns, d = absmax / 32767, q = round_half_even(x * (32767 /
// absmax)); q: rows of `ldq` int16 (>= K, the padding left as it is)
void quantize_rows16(const float* x, int64_t M, int64_t K, int16_t* q, int64_t ldq, float* d) {
  const int64_t nb = (K + QB16 - 1) / QB16;
  alignas(32) int16_t out[QB16];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t len = std::min(QB16, K - b * QB16);
      __m256 v[8];
      const float am = load_block(x + m * K, K, b, v);
      const __m256 id = _mm256_set1_ps(am > 0.f ? 32767.f / am : 0.f);
      for (int i = 0; i < 4; ++i) {
        const __m256i r0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * i], id));
        const __m256i r1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * i + 1], id));
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(r0, r1), 0xD8);  // 16 int16 in column order
        p = _mm256_max_epi16(p, _mm256_set1_epi16(-32767));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 16 * i), p);
      }
      std::memcpy(q + m * ldq + b * QB16, out, len * sizeof(int16_t));
      d[m * nb + b] = am / 32767.f;
    }
}
#pragma GCC pop_options

// the chunk order and lane scales of `Act` (see the Python docstring); `offset`: 8 (INT4), 128 (INT8 on VNNI), 0.
// q: [M, KP] natural order, zero beyond K; INT4 rows are written to qp in chunk order, INT8 ones are q itself.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
void layout(const int8_t* q, const float* d, const int32_t* bsum, int64_t M, int64_t K, int bits, float offset,
            int8_t* qp, float* dv, float* off, int64_t KP, int64_t NC) {
  const int64_t nb = (K + QB - 1) / QB;
  // per 128-bit lane: the 8 even bytes, then the 8 odd ones
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* qm = q + m * KP;
    int8_t* pm = qp + m * KP;
    if (bits == 4) {
      for (int64_t c = 0; c < NC; ++c)
        for (int64_t j = 0; j < 4; ++j) {  // columns c * 128 + 32 j .. + 31: 16 even ones, 16 odd ones
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qm + c * 128 + 32 * j));
          const __m256i e = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0xD8);  // [16 even | 16 odd]
          _mm_storeu_si128(reinterpret_cast<__m128i*>(pm + c * 128 + 16 * j), _mm256_castsi256_si128(e));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(pm + c * 128 + 64 + 16 * j), _mm256_extracti128_si256(e, 1));
        }
    }
    const int64_t lane_blocks = bits == 4 ? 4 : 8;  // int32 lanes per block: a lane holds 8 (INT4) or 4 (INT8) columns
    const int64_t chunk_blocks = bits == 4 ? 4 : 2;
    for (int64_t c = 0; c < NC; ++c)
      for (int64_t l = 0; l < 16; ++l) {
        const int64_t b = c * chunk_blocks + l / lane_blocks;
        dv[(m * NC + c) * 16 + l] = b < nb ? d[m * nb + b] : 0.f;
      }
    float o = 0.f;
    for (int64_t b = 0; b < nb; ++b) o += d[m * nb + b] * static_cast<float>(bsum[m * nb + b]);
    off[m] = offset * o;
  }
}
#pragma GCC pop_options

// The weight as the kernel reads it: chunk c (64 bytes) of row n at
//   w + (n / il) * il * row_bytes + (c * il + n % il) * CH.
// The official layout [N, KB] is il 1, row_bytes KB (a partial last chunk where KB % 64 != 0); the interleaved
// one (`pack`) [ceil(N / R) * R / il, NC, il, CH], zero-padded, is il rows (4 or 8) whose chunks alternate,
// row_bytes NC * CH: one sequential stream per group of il rows.
struct Weight {
  const int8_t* w;
  int64_t row_bytes;  // KB, or NC * CH interleaved
  int64_t il;         // rows interleaved: 1 (official), 4 or 8
  int64_t ahead;      // bytes each row prefetches ahead of the chunk it reads
};

// The rows n .. n + RR - 1 of a block and, where a row is not a whole number of chunks (official layout only),
// its last partial chunk copied into tb, zero-padded (facing zero activations).
template <int RR>
inline void block_rows(const Weight& wt, int64_t n, const int8_t* (&rows)[RR], int8_t (&tb)[RR][CH]) {
  for (int r = 0; r < RR; ++r) rows[r] = wt.w + (n + r) / wt.il * wt.il * wt.row_bytes + (n + r) % wt.il * CH;
  if (wt.row_bytes % CH) {
    for (int r = 0; r < RR; ++r) {
      std::memset(tb[r], 0, CH);
      std::memcpy(tb[r], rows[r] + wt.row_bytes / CH * CH, wt.row_bytes % CH);
    }
  }
}

// Weight rows per pass over a tile of mt rows of x: the largest power of two, at most rr, whose mt * rows
// accumulators fit in acc registers.
constexpr int rows_per_pass(int rr, int mt, int acc) {
  int rows = 1;
  while (rows * 2 <= rr && rows * 2 * mt <= acc) rows *= 2;
  return rows;
}

using BlockFn = void (*)(const Weight& wt, const Act& a, int64_t M, const float* ws, float* y, int64_t N, int64_t n);

// ---------------------------------------------------------------------------------------------- AVX-512 VNNI
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")

// One 64-byte chunk of RR weight rows times MT rows of x: each row's chunk is unpacked once for all MT rows
// (acc[m * RR + r]); the activations come from L1 (memory operands).
template <int RR, int MT, int BITS>
__attribute__((always_inline)) inline void chunk512(const int8_t* const* src, const int8_t* xq, int64_t xld,
                                                    const float* dv, int64_t dld, __m512* acc) {
  if (BITS == 4) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(0x08);
    for (int r = 0; r < RR; ++r) {
      const __m512i b = _mm512_loadu_si512(src[r]);
      // (nibble & 0xF) ^ 8: the signed nibble plus 8 (offset binary), one ternary-logic op each
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), m4, eight, 0x6A);
      const __m512i lo = _mm512_ternarylogic_epi32(b, m4, eight, 0x6A);
      for (int m = 0; m < MT; ++m) {
        const int8_t* x = xq + m * xld;
        const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(x)),
                                              lo, _mm512_loadu_si512(x + 64));
        acc[m * RR + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(dv + m * dld), acc[m * RR + r]);
      }
    }
  } else if (BITS == 16) {  // INT8 weights widened to int16 times int16 activations (vpdpwssd), one block a chunk
    for (int r = 0; r < RR; ++r) {
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[r])));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[r] + 32)));
      for (int m = 0; m < MT; ++m) {
        const int8_t* x = xq + m * xld;
        const __m512i s = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(x)),
                                              w1, _mm512_loadu_si512(x + 64));
        acc[m * RR + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(dv + m * dld), acc[m * RR + r]);
      }
    }
  } else {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int r = 0; r < RR; ++r) {
      const __m512i b = _mm512_xor_si512(_mm512_loadu_si512(src[r]), flip);  // weight + 128
      for (int m = 0; m < MT; ++m) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b, _mm512_loadu_si512(xq + m * xld));
        acc[m * RR + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(dv + m * dld), acc[m * RR + r]);
      }
    }
  }
}

// Weight rows n .. n + RR - 1 times rows m0 .. m0 + MT - 1 of x; the first tile (m0 == 0) prefetches the weight.
template <int RR, int MT, int BITS>
void tile512(const int8_t* const* rows, const int8_t (*tb)[CH], const Weight& wt, const Act& a, int64_t m0,
             const float* ws, float* y, int64_t N, int64_t n) {
  const int64_t full = wt.row_bytes / CH, tail = wt.row_bytes % CH, step = wt.il * CH;
  const int64_t xstep = BITS == 8 ? CH : 2 * CH;  // activation bytes per chunk (int16 ones for BITS 16)
  const int8_t* xq = a.q + m0 * a.KP;
  const float* dv = a.dv + m0 * a.NC * 16;
  __m512 acc[MT * RR];
  for (int i = 0; i < MT * RR; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* src[RR];
  for (int64_t c = 0; c < full; ++c) {
    for (int r = 0; r < RR; ++r) {
      src[r] = rows[r] + c * step;
      if (m0 == 0) _mm_prefetch(reinterpret_cast<const char*>(src[r] + wt.ahead), _MM_HINT_T0);
    }
    chunk512<RR, MT, BITS>(src, xq + c * xstep, a.KP, dv + c * 16, a.NC * 16, acc);
  }
  if (tail) {
    for (int r = 0; r < RR; ++r) src[r] = tb[r];
    chunk512<RR, MT, BITS>(src, xq + full * xstep, a.KP, dv + full * 16, a.NC * 16, acc);
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < RR; ++r)
      if (n + r < N) y[(m0 + m) * N + n + r] = (_mm512_reduce_add_ps(acc[m * RR + r]) - a.off[m0 + m]) * ws[n + r];
}

// The RR rows of a block for one tile of MT rows of x, in passes of `rows_per_pass` rows: the accumulators stay in
// registers.
template <int RR, int MT, int BITS>
inline void rows512(const int8_t* const* rows, const int8_t (*tb)[CH], const Weight& wt, const Act& a, int64_t m0,
                    const float* ws, float* y, int64_t N, int64_t n) {
  constexpr int SUB = rows_per_pass(RR, MT, ACC512);
  for (int r0 = 0; r0 < RR; r0 += SUB) tile512<SUB, MT, BITS>(rows + r0, tb + r0, wt, a, m0, ws, y, N, n + r0);
}

// MT: rows of x per tile (MT_MAX, or 2 where a pass must take all 8 rows of an interleaved group)
template <int RR, int BITS, int MT>
void block512(const Weight& wt, const Act& a, int64_t M, const float* ws, float* y, int64_t N, int64_t n) {
  alignas(64) int8_t tb[RR][CH];
  const int8_t* rows[RR];
  block_rows(wt, n, rows, tb);
  int64_t m = 0;
  for (; m + MT <= M; m += MT) rows512<RR, MT, BITS>(rows, tb, wt, a, m, ws, y, N, n);
  switch (M - m) {
    case 3: rows512<RR, 3, BITS>(rows, tb, wt, a, m, ws, y, N, n); break;
    case 2: rows512<RR, 2, BITS>(rows, tb, wt, a, m, ws, y, N, n); break;
    case 1: rows512<RR, 1, BITS>(rows, tb, wt, a, m, ws, y, N, n); break;
    default: break;
  }
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline float hsum256(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// One 32-byte half `h` of a chunk of RR weight rows times MT rows of x (acc[m * RR + r]), each row's half
// unpacked once for all MT rows.
template <int RR, int MT, int BITS>
__attribute__((always_inline)) inline void half256(const int8_t* const* src, int h, const int8_t* xq, int64_t xld,
                                                   const float* dv, int64_t dld, __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (BITS == 4) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x88));
    for (int r = 0; r < RR; ++r) {
      const __m256i b = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[r] + 32 * h)), flip);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4), lo = _mm256_and_si256(b, m4);
      for (int m = 0; m < MT; ++m) {
        const int8_t* x = xq + m * xld;
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * h));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64 + 32 * h));
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(hi, xe), _mm256_maddubs_epi16(lo, xo));
        acc[m * RR + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),
                                          _mm256_loadu_ps(dv + m * dld + 8 * h), acc[m * RR + r]);
      }
    }
  } else if (BITS == 16) {  // 32 INT8 weights widened to int16 times int16 activations (vpmaddwd)
    for (int r = 0; r < RR; ++r) {
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[r] + 32 * h)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[r] + 32 * h + 16)));
      for (int m = 0; m < MT; ++m) {
        const int16_t* x16 = reinterpret_cast<const int16_t*>(xq + m * xld) + 32 * h;
        const __m256i s = _mm256_add_epi32(
            _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16))),
            _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + 16))));
        acc[m * RR + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_loadu_ps(dv + m * dld + 8 * h), acc[m * RR + r]);
      }
    }
  } else {
    for (int r = 0; r < RR; ++r) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[r] + 32 * h));
      for (int m = 0; m < MT; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * xld + 32 * h));
        // |x| times the weight with x's sign
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(w, xv));
        acc[m * RR + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),
                                          _mm256_loadu_ps(dv + m * dld + 8 * h), acc[m * RR + r]);
      }
    }
  }
}

template <int RR, int MT, int BITS>
void tile256(const int8_t* const* rows, const int8_t (*tb)[CH], const Weight& wt, const Act& a, int64_t m0,
             const float* ws, float* y, int64_t N, int64_t n) {
  const int64_t full = wt.row_bytes / CH, tail = wt.row_bytes % CH, step = wt.il * CH;
  const int64_t xstep = BITS == 8 ? CH : 2 * CH;  // activation bytes per chunk (int16 ones for BITS 16)
  const int8_t* xq = a.q + m0 * a.KP;
  const float* dv = a.dv + m0 * a.NC * 16;
  __m256 acc[MT * RR];
  for (int i = 0; i < MT * RR; ++i) acc[i] = _mm256_setzero_ps();
  const int8_t* src[RR];
  for (int64_t c = 0; c < full; ++c) {
    for (int r = 0; r < RR; ++r) {
      src[r] = rows[r] + c * step;
      if (m0 == 0) _mm_prefetch(reinterpret_cast<const char*>(src[r] + wt.ahead), _MM_HINT_T0);
    }
    half256<RR, MT, BITS>(src, 0, xq + c * xstep, a.KP, dv + c * 16, a.NC * 16, acc);
    half256<RR, MT, BITS>(src, 1, xq + c * xstep, a.KP, dv + c * 16, a.NC * 16, acc);
  }
  if (tail) {
    for (int r = 0; r < RR; ++r) src[r] = tb[r];
    half256<RR, MT, BITS>(src, 0, xq + full * xstep, a.KP, dv + full * 16, a.NC * 16, acc);
    half256<RR, MT, BITS>(src, 1, xq + full * xstep, a.KP, dv + full * 16, a.NC * 16, acc);
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < RR; ++r)
      if (n + r < N) y[(m0 + m) * N + n + r] = (hsum256(acc[m * RR + r]) - a.off[m0 + m]) * ws[n + r];
}

// `rows512` with AVX2's budget of accumulators
template <int RR, int MT, int BITS>
inline void rows256(const int8_t* const* rows, const int8_t (*tb)[CH], const Weight& wt, const Act& a, int64_t m0,
                    const float* ws, float* y, int64_t N, int64_t n) {
  constexpr int SUB = rows_per_pass(RR < 4 ? RR : 4, MT, ACC256);  // at most 4: the registers also hold the weights
  for (int r0 = 0; r0 < RR; r0 += SUB) tile256<SUB, MT, BITS>(rows + r0, tb + r0, wt, a, m0, ws, y, N, n + r0);
}

template <int RR, int BITS>
void block256(const Weight& wt, const Act& a, int64_t M, const float* ws, float* y, int64_t N, int64_t n) {
  alignas(64) int8_t tb[RR][CH];
  const int8_t* rows[RR];
  block_rows(wt, n, rows, tb);
  int64_t m = 0;
  for (; m + MT_MAX_AVX2 <= M; m += MT_MAX_AVX2) rows256<RR, MT_MAX_AVX2, BITS>(rows, tb, wt, a, m, ws, y, N, n);
  if (M - m == 1) rows256<RR, 1, BITS>(rows, tb, wt, a, m, ws, y, N, n);
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- ops

bool isa_supported(int64_t isa) {
  __builtin_cpu_init();
  if (isa == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == 2)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
           && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
  return false;
}

// x fp32 [M, K] -> (q int8 [M, K], d fp32 [M, ceil(K / 32)]): the activation quantization, for tests
std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, int64_t act_bits) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "quantize: contiguous fp32 [M, K]");
  if (act_bits == 16) {
    const int64_t M = x.size(0), K = x.size(1), nb = (K + QB16 - 1) / QB16;
    at::Tensor q = at::empty({M, K}, x.options().dtype(at::kShort)), d = at::empty({M, nb}, x.options());
    quantize_rows16(x.data_ptr<float>(), M, K, q.data_ptr<int16_t>(), K, d.data_ptr<float>());
    return {q, d};
  }
  const int64_t M = x.size(0), K = x.size(1), nb = (K + QB - 1) / QB;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar)), d = at::empty({M, nb}, x.options());
  std::vector<int32_t> bsum(M * nb);
  quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), K, d.data_ptr<float>(), bsum.data());
  return {q, d};
}

// The activations of x (fp32 [rows, K]) quantized and laid out for weights of `bits` (`act` points into the buffers).
struct Prepared {
  std::vector<int8_t> q, qp;
  std::vector<float> d, dv, off;
  std::vector<int32_t> bsum;
  Act act;
};

void prepare(const float* x, int64_t M, int64_t K, int64_t bits, int64_t isa, bool a16, Prepared& p) {
  const int64_t KB = bits == 4 ? K / 2 : K, nb = (K + QB - 1) / QB;
  const int64_t NC = (KB + CH - 1) / CH, KP = NC * (bits == 4 ? 2 * CH : CH);
  p.q.assign(M * KP * (a16 ? 2 : 1), 0);  // zero: the padding beyond K
  p.qp.assign(bits == 4 ? M * KP : 0, 0);
  p.d.assign(M * nb, 0.f), p.dv.assign(M * NC * 16, 0.f), p.off.assign(M, 0.f), p.bsum.assign(M * nb, 0);
  if (a16) {  // blocks of 64 = chunks: every lane of chunk c takes d[c]; no offset
    quantize_rows16(x, M, K, reinterpret_cast<int16_t*>(p.q.data()), KP, p.d.data());  // d: [M, NC]
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < NC; ++c)
        for (int64_t l = 0; l < 16; ++l) p.dv[(m * NC + c) * 16 + l] = p.d[m * NC + c];
  } else {
    quantize_rows(x, M, K, p.q.data(), KP, p.d.data(), p.bsum.data());
    const float offset = bits == 4 ? 8.f : (isa == 2 ? 128.f : 0.f);
    layout(p.q.data(), p.d.data(), p.bsum.data(), M, K, static_cast<int>(bits), offset, p.qp.data(), p.dv.data(),
           p.off.data(), KP, NC);
  }
  p.act = Act{bits == 4 ? p.qp.data() : p.q.data(), p.dv.data(), p.off.data(), KP * (a16 ? 2 : 1), NC};
}

// Rows m0 .. of the prepared activations: those of one group of a grouped call
Act rows_from(const Act& a, int64_t m0) { return Act{a.q + m0 * a.KP, a.dv + m0 * a.NC * 16, a.off + m0, a.KP, a.NC}; }

// The block functions for a weight of `bits` read on path `isa` (`pairs`: an interleaved group of all 8 rows)
std::pair<BlockFn, BlockFn> block_fns(int64_t bits, int64_t isa, bool a16, bool pairs) {
  if (a16)
    return {isa == 2 ? (pairs ? block512<R, 16, 2> : block512<R, 16, MT_MAX>) : block256<R, 16>,
            isa == 2 ? block512<1, 16, MT_MAX> : block256<1, 16>};
  if (isa == 2)
    return {bits == 4 ? (pairs ? block512<R, 4, 2> : block512<R, 4, MT_MAX>) : (pairs ? block512<R, 8, 2> : block512<R, 8, MT_MAX>),
            bits == 4 ? block512<1, 4, MT_MAX> : block512<1, 8, MT_MAX>};
  return {bits == 4 ? block256<R, 4> : block256<R, 8>, bits == 4 ? block256<1, 4> : block256<1, 8>};
}

// w as the kernel reads it, checked against N rows of KB bytes: official [N, KB] or interleaved [G, NC, il, 64]
Weight weight_of(const at::Tensor& w, int64_t N, int64_t KB) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && (w.dim() == 2 || w.dim() == 4),
              "int8dot mm: a contiguous int8 2-d (official) or 4-d (interleaved) weight");
  const int64_t NC = (KB + CH - 1) / CH;
  const bool packed = w.dim() == 4;
  if (packed) {
    const int64_t il = w.size(2);
    TORCH_CHECK((il == 4 || il == 8) && w.size(3) == CH && w.size(1) == NC && w.size(0) * il == (N + R - 1) / R * R,
                "int8dot mm: an interleaved weight [ceil(N / 8) * 8 / il, ceil(KB / 64), il, 64], il 4 or 8");
  } else {
    TORCH_CHECK(w.size(0) == N && w.size(1) == KB, "int8dot mm: shapes");
  }
  return Weight{w.data_ptr<int8_t>(), packed ? NC * CH : KB, packed ? w.size(2) : 1, packed ? PF_PACKED : PF * KB};
}

// Blocks of R rows of a weight's N rows (official layout: N / R blocks, then the last rows one at a time;
// interleaved: whole blocks, the padding rows unwritten), and the tasks that cover them
int64_t whole_blocks(const Weight& wt, int64_t N) { return wt.il > 1 ? (N + R - 1) / R : N / R; }
int64_t tasks_of(const Weight& wt, int64_t N) { return wt.il > 1 ? whole_blocks(wt, N) : N / R + N % R; }

void run_task(const std::pair<BlockFn, BlockFn>& fns, const Weight& wt, const Act& a, int64_t M, const float* ws,
              float* y, int64_t N, int64_t t) {
  const int64_t blocks = whole_blocks(wt, N);
  if (t < blocks) fns.first(wt, a, M, ws, y, N, t * R);
  else fns.second(wt, a, M, ws, y, N, blocks * R + (t - blocks));
}

// t in float32, contiguous: itself where it is (scales kept in float32 cost no conversion a call)
at::Tensor as_float(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
}

void check_call(const at::Tensor& x, int64_t bits, int64_t isa, int64_t act_bits) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "int8dot mm: float x");
  TORCH_CHECK(bits == 4 || bits == 8, "int8dot mm: bits 4 or 8");
  TORCH_CHECK(isa_supported(isa), "int8dot mm: this CPU lacks the instructions of isa ", isa);
  TORCH_CHECK(act_bits == 8 || (act_bits == 16 && bits == 8), "int8dot mm: int16 activations are for INT8 weights");
  TORCH_CHECK(bits == 8 || x.size(-1) % 2 == 0, "int8dot mm: INT4 needs an even in");
}

// x float [M, K] (fp32, bf16 or fp16); w int8 [N, K] (bits 8) or [N, K/2] (bits 4, official packing), or either
// interleaved ([G, NC, il, 64], `Weight`); scale float [N]; bias [N] or none -> [M, N] in x's dtype:
// the fp32 product rounded to x's dtype, then plus the bias in that dtype (as `F.linear`'s caller adds it)
// act_bits 16 (INT8 weights only): int16 activations in blocks of 64, int16 dot products
at::Tensor mm(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale_in, int64_t bits, int64_t isa,
              int64_t act_bits, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && at::isFloatingType(scale_in.scalar_type()), "int8dot mm: 2-d x, float scale");
  check_call(x_in, bits, isa, act_bits);
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), scale = as_float(scale_in);
  const int64_t M = x.size(0), K = x.size(1), N = scale.numel();
  const Weight wt = weight_of(w, N, bits == 4 ? K / 2 : K);
  Prepared p;
  prepare(x.data_ptr<float>(), M, K, bits, isa, act_bits == 16, p);
  const auto fns = block_fns(bits, isa, act_bits == 16, wt.il == R);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* ps = scale.data_ptr<float>();
  float* py = y.data_ptr<float>();
  at::parallel_for(0, tasks_of(wt, N), 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) run_task(fns, wt, p.act, M, ps, py, N, t);
  });
  if (x_in.scalar_type() != at::kFloat) y = y.to(x_in.scalar_type());
  if (bias) {
    TORCH_CHECK(bias->numel() == N, "int8dot mm: a bias of out values");
    y.add_(bias->to(y.scalar_type()));
  }
  return y;
}

// Groups of rows of x float [R, K] times one weight each, in one call: group g's rows starts[g] .. starts[g] +
// counts[g] - 1 times weight g (w[g], scale[g]: one format and shape, as `mm` takes them) -> [sum of counts, N] in
// x's dtype, the groups' rows one after another. A group's rows may be another's (a gate and an up weight over the
// same rows). Every row's activations are quantized once and every group's blocks split over the threads together:
// one parallel region for the products of many small groups (the experts of a mixture-of-experts prefill, each on
// the rows routed to it; `mm_multi`'s groups of equal rows). Each group's rows come out as `mm` gives them.
at::Tensor mm_groups(const at::Tensor& x_in, const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                     at::TensorList w, at::TensorList scale_in, int64_t bits, int64_t isa, int64_t act_bits) {
  TORCH_CHECK(x_in.dim() == 2, "int8dot mm_groups: x [R, K]");
  const int64_t G = static_cast<int64_t>(w.size()), rows = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(G > 0 && static_cast<int64_t>(scale_in.size()) == G && static_cast<int64_t>(starts.size()) == G &&
              static_cast<int64_t>(counts.size()) == G, "int8dot mm_groups: a weight, a scale, a start and a count per group");
  check_call(x_in, bits, isa, act_bits);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t N = scale_in[0].numel();
  std::vector<at::Tensor> scales;
  std::vector<Weight> wts;
  std::vector<int64_t> first_out(G);
  int64_t total = 0;
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(scale_in[g].numel() == N && w[g].dim() == w[0].dim(), "int8dot mm_groups: groups of one shape");
    TORCH_CHECK(starts[g] >= 0 && counts[g] >= 0 && starts[g] + counts[g] <= rows, "int8dot mm_groups: rows beyond x");
    scales.push_back(as_float(scale_in[g]));
    wts.push_back(weight_of(w[g], N, bits == 4 ? K / 2 : K));
    first_out[g] = total;
    total += counts[g];
  }
  Prepared p;
  prepare(x.data_ptr<float>(), rows, K, bits, isa, act_bits == 16, p);
  const auto fns = block_fns(bits, isa, act_bits == 16, wts[0].il == R);
  at::Tensor y = at::empty({total, N}, x.options());
  float* py = y.data_ptr<float>();
  const int64_t per = tasks_of(wts[0], N);
  at::parallel_for(0, G * per, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / per;
      if (counts[g] > 0)
        run_task(fns, wts[g], rows_from(p.act, starts[g]), counts[g], scales[g].data_ptr<float>(),
                 py + first_out[g] * N, N, t % per);
    }
  });
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// G products in one call: x float [G, M, K], group g's rows times weight g -> [G, M, N] in x's dtype (`mm_groups`
// with G groups of M rows): one parallel region for the G small products of a decode step (the chosen experts of a
// mixture-of-experts layer, the heads of latent attention).
at::Tensor mm_multi(const at::Tensor& x_in, at::TensorList w, at::TensorList scale_in, int64_t bits, int64_t isa,
                    int64_t act_bits) {
  TORCH_CHECK(x_in.dim() == 3, "int8dot mm_multi: x [G, M, K]");
  const int64_t G = x_in.size(0), M = x_in.size(1), K = x_in.size(2);
  TORCH_CHECK(G > 0 && static_cast<int64_t>(w.size()) == G, "int8dot mm_multi: a weight and a scale per group");
  std::vector<int64_t> starts(G), counts(G, M);
  for (int64_t g = 0; g < G; ++g) starts[g] = g * M;
  return mm_groups(x_in.reshape({G * M, K}), starts, counts, w, scale_in, bits, isa, act_bits).view({G, M, -1});
}

}  // namespace

TORCH_LIBRARY(chatglm_int8dot_cpu, lib) {
  lib.def("mm(Tensor x, Tensor w, Tensor scale, int bits, int isa, int act_bits=8, Tensor? bias=None) -> Tensor", &mm);
  lib.def("mm_multi(Tensor x, Tensor[] w, Tensor[] scale, int bits, int isa, int act_bits=8) -> Tensor", &mm_multi);
  lib.def("mm_groups(Tensor x, int[] starts, int[] counts, Tensor[] w, Tensor[] scale, int bits, int isa, int act_bits=8) -> Tensor",
          &mm_groups);
  lib.def("quantize(Tensor x, int act_bits=8) -> (Tensor, Tensor)", &quantize);
  lib.def("isa_supported(int isa) -> bool", &isa_supported);
}
"""


@functools.cache
def _build() -> bool:
    """Compile and load the kernel (once per process; the build itself is cached on disk)."""
    source = _SOURCE + (Path(__file__).parent / "int8dot_steps.cpp").read_text()
    return inline_build.build("chatglm_int8dot_cpu", source, [], "the int8 dot-product kernel", "keeping the previous CPU kernels")


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
    return torch.ops.chatglm_int8dot_cpu.mm(x2d, weight.contiguous(), weight_scale, bits, code, act_bits(bits, act), bias)


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
    return torch.classes.chatglm_int8dot_cpu.MoeDecoder([w.contiguous() for w in weights], list(scales), experts, router,
                                                        bias, top_k, norm, factor, bits, code, act_bits(bits))


def latent_layer(linears: list[tuple[Tensor, Tensor, int]], norms: list[tuple[Tensor, float]],
                 absorbed: tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], int],
                 dims: tuple[int, int, int, int, int], scaling: float, interleave: bool, moe, isa_name: str | None = None):
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
        [float(eps) for _, eps in norms], key_w, key_s, value_w, value_s, [*dims, code], float(scaling), interleave, moe)


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
