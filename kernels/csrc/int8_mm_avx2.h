// The int8 x int8 -> int32 product of quant_linear.cpp's `int8_mm` on tiers without VNNI (avx2, and avx512 on
// CPUs without it), exact: both operands widened to int16 and multiplied pairwise by `vpmaddwd` into int32 (each
// pair's sum fits: 2 x 128 x 128). oneDNN's int8 GEMM there (torch._int_mm) goes through `vpmaddubsw`, whose int16
// pair sums saturate, so it is not used on these tiers. x is widened to int16 once; each thread takes blocks of
// 64 weight rows, each weight row (read once, in memory order) against x rows four at a time; a K tail under 16
// is summed in scalar. Included by quant_linear_avx2.h inside quant_linear.cpp's namespace.

inline int32_t sluice_hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// One weight row w [K] against M x rows (int16, row stride K): out[m * ldo].
template <int M>
inline void int8_row_tile(const int16_t* x, int64_t K, const int8_t* w, int32_t* out, int64_t ldo) {
  __m256i acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
    for (int m = 0; m < M; ++m)
      acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K + k)), wv));
  }
  int32_t tail[M] = {};
  for (; k < K; ++k)
    for (int m = 0; m < M; ++m) tail[m] += static_cast<int32_t>(x[m * K + k]) * w[k];
  for (int m = 0; m < M; ++m) out[m * ldo] = sluice_hsum8_epi32(acc[m]) + tail[m];
}

// y [M, N] = x [M, K] · w [N, K]ᵀ in int32.
void int8_mm_avx2(const int8_t* x, int64_t M, const int8_t* w, int64_t K, int64_t N, int32_t* y) {
  std::vector<int16_t> wide(M * K);
  for (int64_t i = 0; i < M * K; ++i) wide[i] = x[i];
  const int16_t* xs = wide.data();
  constexpr int64_t kRows = 64;
  at::parallel_for(0, (N + kRows - 1) / kRows, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t n = b0 * kRows; n < std::min(N, b1 * kRows); ++n) {
      const int8_t* wr = w + n * K;
      sluice_row_tiles<4>(0, M, [&](auto r, int64_t m) {
        int8_row_tile<decltype(r)::value>(xs + m * K, K, wr, y + m * N + n, N);
      });
    }
  });
}
