"""A batch-1 INT4 matmul for CPUs without AVX-512, reading the official packed INT4 weight as it is.

On an AVX2-only AMD EPYC PyTorch's `_weight_int4pack_mm_for_cpu` is compute-bound, slower than int8pack for
half the bytes: INT4 decoded slower than INT8 there (bench/results/scale.json).
`matmul` computes `x @ dequant(W).T` for official per-row-scale INT4 (`weight` int8 `[out, in/2]`,
even column in the high nibble; `weight_scale` fp16 `[out]`) with a small C++ kernel (AVX2 + FMA
intrinsics, PyTorch's intra-op thread pool): per 8 bytes of a row, zero-extend to 8 int32 lanes and XOR
0x88 (each signed nibble q becomes q + 8, offset binary), take the high nibble by a shift and the low one
by a mask, convert to fp32 and FMA with the even and odd columns of x, kept in fp32; the row's sum less
8 * sum(x), times its scale, is the dequantized math (`q * scale` is exact in fp32), fp32 throughout, so
more exact than the bf16 kernels. Four rows share each load of x, and each row prefetches the weight two
blocks ahead (rows of 2 KB, as most of ChatGLM's are, defeat the hardware prefetcher: the prefetch made the
kernel 1.7-1.9x faster at 4096 columns). With more than `DIRECT_ROWS` rows of x, each 4-row x 512-column
chunk of the weight is unpacked once (less 8) into an fp32 buffer (8 KB, L1) that every row of x then reads.

Measured (bench/kernels/int4_kernels.py, bench/results/int4_kernels.json; an AVX-512 Xeon with PyTorch at the AVX2 level,
2 threads, batch 1, weights streamed from memory): 0.66 / 1.71 / 2.17 / 2.01 ms at ChatGLM-6B's 4096x4096 /
12288x4096 / 16384x4096 / 4096x16384 against 1.13 / 2.77 / 3.53 / 3.39 for int8pack (1.6-1.7x faster) and
0.89 / 2.53 / 3.26 / 3.19 for int4pack; one thread: 1.24 / 3.16 / 4.35 / 3.89 against 2.25 / 5.36 / 6.32 /
6.46 and 1.68 / 4.82 / 6.22 / 6.08 (an AMD EPYC, before the prefetch: 1.06 / 2.96 / 4.65 / 7.63 against
int8pack's 1.67 / 4.33 / 5.24 / 9.42). Exact to fp32 rounding (relative error ~1e-6, where the bf16 kernels
give ~2e-3). ChatGLM-6B at full size (bench/peer/peer.py, `--capability avx2`) decodes INT4 at 1.40x INT8. At the
AVX-512 level it beats PyTorch's int4pack too (0.62 / 1.66 / 2.07 / 2.09 against 0.68 / 1.94 / 2.50 / 2.47 ms;
decode 232 against 250 ms a token), but prefill is then slower (6.6 against 4.8 s for 64 tokens: the
dequantizing path unpacks the official layout more slowly than it reads int4pack's back), so `available()`
is True only where PyTorch's CPU capability is AVX2. What limits it: at the AVX2 level the full model's INT4
decode reads 3.36 GB a token in 234 ms, 14.4 GB/s, 56% of the 25.8 GB/s that two threads read here; the rest is
arithmetic, 5 of the 8 instructions per 16 weights needing the two vector ports that convert and multiply (int8pack
reads twice the bytes at 70-77% of that bandwidth). No repacking: the official weight is the only copy, and
nothing ISA-dependent is built from it.

Rows of the weight are split over PyTorch's intra-op threads by `at::parallel_for`, which is OpenMP inside
this extension too: it is built with `-fopenmp` (without it the same code compiles and runs on one thread:
the kernel was 1.9x slower at 2 threads, and INT4 decoded at 0.54x INT8 on an AVX2-level run of a Xeon).

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

import torch
from torch import Tensor

from chatglm_tune.quant import inline_build

# Rows of x up to which each row unpacks the weight in registers; above, chunks are unpacked once into
# an fp32 buffer shared by every row (crossover measured at 16384x4096 by bench/kernels/int4_kernels.py `--rows`:
# the buffer wins from 4 rows on). QuantizedLinear routes up to its `max_kernel_rows` (32) rows here.
DIRECT_ROWS = 2

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace {

constexpr int64_t R = 4;    // weight rows per block: they share each load of x
constexpr int64_t C = 256;  // packed bytes (512 columns) per buffered chunk
constexpr int64_t PREFETCH_ROWS = 2 * R;  // each row prefetches the weight this many rows ahead (the block after next)

inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// 8 packed bytes -> (high nibbles, low nibbles) + 8 as 8 fp32 each: the bytes XOR 0x88 hold the signed nibbles
// in offset binary, so a shift and a mask give them (2 of the 4 instructions run on any vector port, not only the
// two that also convert and multiply); `block_direct` subtracts 8 * sum(x) once per row, `block_buffered` 8 per value
inline void unpack8_biased(const int8_t* p, __m256& hi, __m256& lo) {
  const __m256i b = _mm256_xor_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
                                     _mm256_set1_epi32(0x88));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
}

// `unpack8_biased` of weight row `row` at packed byte `j` (of `K2` per row), prefetching the same bytes
// PREFETCH_ROWS rows ahead once per 64-byte line
inline void load8(const int8_t* w, int64_t K2, int64_t row, int64_t j, __m256& hi, __m256& lo) {
  const int8_t* p = w + row * K2 + j;
  if ((j & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_ROWS * K2), _MM_HINT_T0);
  unpack8_biased(p, hi, lo);
}

// sums[r] = the dot product of columns [0, len) of x's even and odd halves e, o with weight row r of a
// block, for r < R: `load(r, j, hi, lo)` gives that row's 8 (high, low) nibble pairs at column j; each
// load of x serves the R rows. Both blocks below accumulate here (inlined: one loop, two weight sources).
template <typename Load>
__attribute__((always_inline)) inline void dot_rows(const float* e, const float* o, int64_t len, Load load,
                                                    float* sums) {
  __m256 ae[R], ao[R];
  for (int r = 0; r < R; ++r) ae[r] = ao[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; j += 8) {
    const __m256 ve = _mm256_loadu_ps(e + j), vo = _mm256_loadu_ps(o + j);
    for (int r = 0; r < R; ++r) {
      __m256 hi, lo;
      load(r, j, hi, lo);
      ae[r] = _mm256_fmadd_ps(ve, hi, ae[r]);
      ao[r] = _mm256_fmadd_ps(vo, lo, ao[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = hsum(_mm256_add_ps(ae[r], ao[r]));
}

// rows [n, n + R) for every row m of x: unpacked in registers, once per row of x
void block_direct(const float* xe, const float* xo, const int8_t* w, const float* scale, float* y,
                  int64_t M, int64_t K2, int64_t N, int64_t n, const float* xsum) {
  const auto unpacked = [&](int r, int64_t j, __m256& hi, __m256& lo) { load8(w, K2, n + r, j, hi, lo); };
  for (int64_t m = 0; m < M; ++m) {
    float sums[R];
    dot_rows(xe + m * K2, xo + m * K2, K2, unpacked, sums);
    for (int r = 0; r < R; ++r) y[m * N + n + r] = (sums[r] - 8.f * xsum[m]) * scale[n + r];
  }
}

// rows [n, n + R) for every row m of x: each chunk unpacked once into an fp32 buffer
void block_buffered(const float* xe, const float* xo, const int8_t* w, const float* scale, float* y,
                    int64_t M, int64_t K2, int64_t N, int64_t n, float* acc) {
  alignas(32) float bh[R][C], bl[R][C];
  for (int64_t i = 0; i < M * R; ++i) acc[i] = 0.f;
  for (int64_t j0 = 0; j0 < K2; j0 += C) {
    const int64_t len = std::min(C, K2 - j0);
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < len; j += 8) {
        __m256 hi, lo;
        load8(w, K2, n + r, j0 + j, hi, lo);
        _mm256_store_ps(bh[r] + j, _mm256_sub_ps(hi, _mm256_set1_ps(8.f)));
        _mm256_store_ps(bl[r] + j, _mm256_sub_ps(lo, _mm256_set1_ps(8.f)));
      }
    const auto buffered = [&](int r, int64_t j, __m256& hi, __m256& lo) {
      hi = _mm256_load_ps(bh[r] + j);
      lo = _mm256_load_ps(bl[r] + j);
    };
    for (int64_t m = 0; m < M; ++m) {
      float sums[R];
      dot_rows(xe + m * K2 + j0, xo + m * K2 + j0, len, buffered, sums);
      for (int r = 0; r < R; ++r) acc[m * R + r] += sums[r];
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n + r] = acc[m * R + r] * scale[n + r];
}

// xe, xo: fp32 [M, K/2] (the even and odd columns of x); w: int8 [N, K/2] (official INT4);
// scale: fp32 [N] -> fp32 [M, N]
at::Tensor rows_mm(const at::Tensor& xe, const at::Tensor& xo, const at::Tensor& w, const at::Tensor& scale,
                   int64_t direct_rows) {
  TORCH_CHECK(xe.scalar_type() == at::kFloat && xo.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat
              && w.scalar_type() == at::kChar, "rows_mm: fp32 x halves and scale, int8 weight");
  TORCH_CHECK(xe.is_contiguous() && xo.is_contiguous() && w.is_contiguous() && scale.is_contiguous(), "rows_mm: contiguous");
  const int64_t M = xe.size(0), K2 = xe.size(1), N = w.size(0);
  TORCH_CHECK(xo.size(0) == M && xo.size(1) == K2 && w.size(1) == K2 && scale.numel() == N, "rows_mm: shapes");
  TORCH_CHECK(K2 % 8 == 0 && N % R == 0, "rows_mm: in/2 % 8 and out % 4 must be 0");
  at::Tensor y = at::empty({M, N}, xe.options());
  const float* pe = xe.data_ptr<float>();
  const float* po = xo.data_ptr<float>();
  const int8_t* pw = w.data_ptr<int8_t>();
  const float* ps = scale.data_ptr<float>();
  float* py = y.data_ptr<float>();
  std::vector<float> xsum(M <= direct_rows ? M : 0);  // sum(x) per row, for the offset of `unpack8_biased`
  for (size_t m = 0; m < xsum.size(); ++m)
    for (int64_t j = 0; j < K2; ++j) xsum[m] += pe[m * K2 + j] + po[m * K2 + j];
  at::parallel_for(0, N / R, 8, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M <= direct_rows ? 0 : M * R);
    for (int64_t b = b0; b < b1; ++b) {
      if (M <= direct_rows) block_direct(pe, po, pw, ps, py, M, K2, N, b * R, xsum.data());
      else block_buffered(pe, po, pw, ps, py, M, K2, N, b * R, acc.data());
    }
  });
  return y;
}

// the chunks at::parallel_for splits a range into here: PyTorch's thread count where the build has OpenMP, 1 where
// it silently runs serially (a build without -fopenmp)
int64_t parallel_chunks() {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) { chunks += 1; });
  return chunks.load();
}

}  // namespace

TORCH_LIBRARY(chatglm_int4_cpu, lib) {
  lib.def("rows_mm(Tensor xe, Tensor xo, Tensor w, Tensor scale, int direct_rows) -> Tensor", &rows_mm);
  lib.def("parallel_chunks() -> int", &parallel_chunks);
}
"""


@functools.cache
def _build() -> bool:
    """Compile and load the kernel (once per process; the build itself is cached on disk)."""
    return inline_build.build("chatglm_int4_cpu", _SOURCE, ["-mavx2", "-mfma"], "the AVX2 INT4 kernel",
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
