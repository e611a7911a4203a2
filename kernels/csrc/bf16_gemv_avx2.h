// The AVX2 tier of bf16_gemv.cpp (AVX2 + FMA; Zen 2/3, Haswell on): bf16 widened to fp32 by a shift (a 32-bit
// lane's low bf16 shifted up 16 bits is the even element, the lane masked to its high half the odd one), products
// summed by FMA into fp32, even and odd elements in their own accumulators, the K tail (under 16) in scalar
// fp32. Sixteen ymm registers hold a 4 x 1 tile (8 accumulators), so weight rows go one at a time (kWideR = 1),
// in memory order. Included by bf16_gemv.cpp inside its namespace, after bf16_to_float.

constexpr int kWideR = 1;  // weight rows a tile takes past 12 x rows: one, as below 12

inline float sluice_hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 bf16 at p as fp32: the even elements and the odd ones.
inline void sluice_load_bf16x16(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Outputs [n, n + R) of M rows: out[m * ldo + r].
template <int M, int R>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* out, int64_t ldo) {
  __m256 acc[M * R][2];
  for (int i = 0; i < M * R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m256 we[R], wo[R];
    for (int r = 0; r < R; ++r) sluice_load_bf16x16(w + r * K + k, we[r], wo[r]);
    for (int m = 0; m < M; ++m) {
      __m256 xe, xo;
      sluice_load_bf16x16(x + m * ldx + k, xe, xo);
      for (int r = 0; r < R; ++r) {
        acc[m * R + r][0] = _mm256_fmadd_ps(xe, we[r], acc[m * R + r][0]);
        acc[m * R + r][1] = _mm256_fmadd_ps(xo, wo[r], acc[m * R + r][1]);
      }
    }
  }
  float tail[M * R] = {};
  for (; k < K; ++k)
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) tail[m * R + r] += bf16_to_float(x[m * ldx + k]) * bf16_to_float(w[r * K + k]);
  for (int i = 0; i < M * R; ++i)
    out[(i / R) * ldo + i % R] = sluice_hsum8(_mm256_add_ps(acc[i][0], acc[i][1])) + tail[i];
}

// From kWideMinRows x rows on: x widened to fp32 once per call (`widen_x`: each block of 16 as its 8 even then its
// 8 odd elements, the K tail left in bf16) and tiles of up to kWideM x rows against kWideR2 weight rows
// (`wide_tile`): the weight widened once per tile, not once per 4 x rows, and x loaded ready to FMA. The products,
// accumulators and final sums are `tile`'s, in its order, so either path gives the same bits.
#define SLUICE_GEMV_WIDE_X
constexpr int64_t kWideMinRows = 4;
constexpr int kWideM = 3;
constexpr int kWideR2 = 2;

// x [M, K] (row stride ldx) into xw [M, K16] fp32, K16 = K rounded down to 16.
inline void widen_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, float* xw) {
  const int64_t K16 = K / 16 * 16;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K16; k += 16) {
      __m256 even, odd;
      sluice_load_bf16x16(x + m * ldx + k, even, odd);
      _mm256_storeu_ps(xw + m * K16 + k, even);
      _mm256_storeu_ps(xw + m * K16 + k + 8, odd);
    }
}

// `tile<M, R>` with x already widened (xw [M, K16]; x for the K tail): outputs [n, n + R) of M rows.
template <int M, int R>
inline void wide_tile(const float* xw, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* out,
                      int64_t ldo) {
  const int64_t K16 = K / 16 * 16;
  __m256 acc[M * R][2];
  for (int i = 0; i < M * R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + k)), 16));
    for (int m = 0; m < M; ++m) {
      const __m256 xe = _mm256_loadu_ps(xw + m * K16 + k);
      for (int r = 0; r < R; ++r) acc[m * R + r][0] = _mm256_fmadd_ps(xe, wv[r], acc[m * R + r][0]);
    }
    for (int r = 0; r < R; ++r)
      wv[r] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + k)), high));
    for (int m = 0; m < M; ++m) {
      const __m256 xo = _mm256_loadu_ps(xw + m * K16 + k + 8);
      for (int r = 0; r < R; ++r) acc[m * R + r][1] = _mm256_fmadd_ps(xo, wv[r], acc[m * R + r][1]);
    }
  }
  float tail[M * R] = {};
  for (int64_t k = K16; k < K; ++k)
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) tail[m * R + r] += bf16_to_float(x[m * ldx + k]) * bf16_to_float(w[r * K + k]);
  for (int i = 0; i < M * R; ++i)
    out[(i / R) * ldo + i % R] = sluice_hsum8(_mm256_add_ps(acc[i][0], acc[i][1])) + tail[i];
}

#include "bf16_gemm_avx2.h"  // `gemm`: from 12 x rows (gemm_min_rows), any count

// Reads n bf16 in memory order, bringing them into cache.
inline void touch(const uint16_t* w, int64_t n) {
  __m256i any = _mm256_setzero_si256();
  for (int64_t i = 0; i + 16 <= n; i += 16)
    any = _mm256_or_si256(any, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
  asm volatile("" : : "x"(any));  // the loads are the point: keep them
}

// One int8 weight row against M fp32 x rows: 16 int8 widened to fp32 a pass, two accumulators a row.
template <int M>
inline void int8_tile(const float* xf, int64_t K, const int8_t* w, float* out, int64_t ldo) {
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m128i wb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(wb));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(wb, 8)));
    for (int m = 0; m < M; ++m) {
      acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + m * K + k), w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + m * K + k + 8), w1, acc[m][1]);
    }
  }
  float tail[M] = {};
  for (; k < K; ++k)
    for (int m = 0; m < M; ++m) tail[m] += xf[m * K + k] * static_cast<float>(w[k]);
  for (int m = 0; m < M; ++m) out[m * ldo] = sluice_hsum8(_mm256_add_ps(acc[m][0], acc[m][1])) + tail[m];
}
