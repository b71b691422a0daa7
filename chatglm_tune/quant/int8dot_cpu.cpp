
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
