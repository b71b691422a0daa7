
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
