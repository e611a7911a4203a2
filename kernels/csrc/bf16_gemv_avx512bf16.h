// The AVX512-BF16 tier of bf16_gemv.cpp: `tile` (M x rows against R weight rows by `vdpbf16ps`), `touch`, and
// `int8_tile` (int8 weight rows against fp32 x rows). Included by bf16_gemv.cpp inside its namespace, after
// bf16_to_float (immintrin.h and avx512_reduce.h are included at its top).

constexpr int kWideR = 4;  // weight rows a tile takes past 12 x rows
constexpr int64_t kWideMinRows = INT64_MAX;  // x is never widened: `vdpbf16ps` takes bf16 pairs
constexpr int64_t kGemmMaxRows = 0;  // no separate product for more rows: the tiles above take every row count

#include "bf16_dp_tile.h"

// Outputs [n, n + R) of M rows: out[m * ldo + r] (bf16_dp_tile.h).
template <int M, int R>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* out, int64_t ldo) {
  bf16_dp_tile<M, R>(x, ldx, w, K, out, ldo);
}

// Reads n bf16 (a multiple of 32 or not: the tail is short of a load) in memory order, bringing them into cache.
inline void touch(const uint16_t* w, int64_t n) {
  __m512i any = _mm512_setzero_si512();
  for (int64_t i = 0; i + 32 <= n; i += 32) any = _mm512_or_si512(any, _mm512_loadu_si512(w + i));
  asm volatile("" : : "v"(any));  // the loads are the point: keep them
}

// y[M, N] = (x[M, K] · Q[N, K]ᵀ) * scale[N] for int8 Q (int8 weight-only linears), as torch's
// _weight_int8pack_mm computes it (fp32 sums, the row scale after, one rounding to bf16) with the bf16 GEMV's
// order of reading: weight rows one by one in memory order, x rows four at a time, x converted to fp32 once.
// Four accumulators a row (64 columns a pass) keep the FMAs independent.
template <int M>
inline void int8_tile(const float* xf, int64_t K, const int8_t* w, float* out, int64_t ldo) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int j = 0; j < 4; ++j) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(w + k + 16 * j))));
      for (int m = 0; m < M; ++m) acc[m][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + m * K + k + 16 * j), wv, acc[m][j]);
    }
  }
  for (; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + k)));
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, xf + m * K + k), wv, acc[m][0]);
  }
  for (int m = 0; m < M; ++m)
    out[m * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                                      _mm512_add_ps(acc[m][2], acc[m][3])));
}

