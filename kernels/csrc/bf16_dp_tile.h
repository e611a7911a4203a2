// The `vdpbf16ps` tile shared by bf16_gemv.cpp's AVX512-BF16 tier and moe.cpp's bf16 experts: out[m * ldo + r] =
// x[m] . w[r] over K for M bf16 rows of x (stride ldx) and R bf16 weight rows (stride K). Every x row is loaded once
// per 32 columns of K, each weight row once and used at once (M x registers, M·R accumulators, one weight register).
// Needs immintrin.h and avx512_reduce.h included first (it may be read inside a namespace).
#pragma once

template <int M, int R>
inline void bf16_dp_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* out, int64_t ldo) {
  __m512 acc[M * R];
  for (int i = 0; i < M * R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], xv[m], wv);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ULL << (K - k)) - 1);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
      for (int m = 0; m < M; ++m) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], xv[m], wv);
    }
  }
  float sums[M * R];
  sluice_sums<M * R>(acc, sums);
  for (int i = 0; i < M * R; ++i) out[(i / R) * ldo + i % R] = sums[i];
}
