// Few-row float matmuls on CPU: y = x @ W.T (+ b) for a few rows of x (decode steps, the rows of a speculative check,
// small batches), fp32 or bf16 W [N, K] read once from memory for every row of x (fewrow_cpu.py says why and when).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

constexpr int RN = 4;        // weight rows a pass streams side by side
constexpr int MT = 3;        // rows of x a pass takes: RN * MT accumulators, 12 of AVX2's 16 registers
constexpr int64_t GRAIN = 16;  // blocks of RN weight rows a thread takes at least

#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {  // bf16 -> fp32: the 16 bits are the float's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float value(float v) { return v; }
inline float value(at::BFloat16 v) { return static_cast<float>(v); }

// Rows n .. n + NR of W times rows m .. m + MR of x (fp32, [M, K]) into y (fp32, [M, N]). Every output is one
// accumulator over K in steps of 8 columns, summed across its lanes, plus the columns past the last whole 8 in
// order: the same arithmetic for a row of x whatever the other rows, tiles or threads.
template <int NR, int MR, typename W>
inline void tile(const float* x, int64_t K, const W* w, float* y, int64_t N, int64_t n, int64_t m) {
  __m256 acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t whole = K / 8 * 8;
  for (int64_t k = 0; k < whole; k += 8) {
    for (int r = 0; r < NR; ++r) {
      const __m256 wv = load8(w + (n + r) * K + k);
      for (int i = 0; i < MR; ++i) acc[i * NR + r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (m + i) * K + k), acc[i * NR + r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) {
      float s = hsum(acc[i * NR + r]);
      for (int64_t k = whole; k < K; ++k) s += value(w[(n + r) * K + k]) * x[(m + i) * K + k];
      y[(m + i) * N + n + r] = s;
    }
}

template <int NR, typename W>
void block(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + MT <= M; m += MT) tile<NR, MT>(x, K, w, y, N, n, m);
  if (M - m == 2) tile<NR, 2>(x, K, w, y, N, n, m);
  if (M - m == 1) tile<NR, 1>(x, K, w, y, N, n, m);
}

template <typename W>
void rows(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N) {
  const int64_t blocks = N / RN;
  at::parallel_for(0, blocks, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) block<RN>(x, M, K, w, y, N, b * RN);
  });
  for (int64_t n = blocks * RN; n < N; ++n) block<1>(x, M, K, w, y, N, n);  // the last N % RN rows
}

#pragma GCC pop_options

at::Tensor mm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "fewrow mm: x [M, K] and W [N, K]");
  TORCH_CHECK(w.is_contiguous() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "fewrow mm: a contiguous fp32 or bf16 weight");
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x32.options());
  if (w.scalar_type() == at::kFloat)
    rows(x32.data_ptr<float>(), M, K, w.data_ptr<float>(), y.data_ptr<float>(), N);
  else
    rows(x32.data_ptr<float>(), M, K, w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), N);
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

bool supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

TORCH_LIBRARY(chatglm_fewrow_cpu, lib) {
  lib.def("mm(Tensor x, Tensor w, Tensor? bias) -> Tensor");  // a CPU kernel: fewrow_cpu.py registers its shapes
  lib.def("supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(chatglm_fewrow_cpu, CPU, lib) { lib.impl("mm", &mm); }
