// The int8 x int8 -> int32 product of quant_linear.cpp's `int8_mm` on tiers without VNNI (avx2, and avx512 on
// CPUs without it), exact for every int8 value (-128 included): both operands widened to int16 and multiplied
// pairwise by `vpmaddwd` into int32 (each pair's sum fits: 2 x 128 x 128). oneDNN's int8 GEMM there
// (torch._int_mm) goes through `vpmaddubsw`, whose int16 pair sums saturate: not used on these tiers.
// (`vpmaddubsw` with llama.cpp's sign trick is exact for codes in [-127, 127] but needs a `vpmaddwd` by ones
// after it: as many multiplies per product as the int16 form, plus a `vpsignb` per pair of rows.)
//
// x is widened to int16 once per call. Each thread takes a run of weight rows and walks it in blocks that
// stay in L2 (kInt8BlockBytes); per block, tiles of 4 x rows (L1) by 3 weight rows keep twelve int32
// accumulators in registers over K (8 lanes each: one weight load and widening per 4 products, no spills),
// summed across lanes by `vphaddd` once per tile. Tiles of fewer x rows (decode) prefetch the weight rows two
// tiles ahead: each row is a short stream, which the hardware prefetchers pick up late. A K tail under 16 is
// summed in scalar. Included by quant_linear_avx2.h inside quant_linear.cpp's namespace.

inline int32_t sluice_hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

constexpr int kInt8TileRows = 4;        // x rows per tile
constexpr int kInt8TileCols = 3;        // weight rows per tile
constexpr int64_t kInt8BlockBytes = 128 << 10;  // int8 weight bytes per block (L2)
constexpr int kInt8Ahead = 6;  // weight rows ahead that the narrow tiles prefetch (short rows: K bytes each)

// The lane sums of up to four accumulators as lanes 0-3 (lanes past NR zero).
template <int NR>
inline __m128i int8_lane_sums(const __m256i* acc) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i a01 = _mm256_hadd_epi32(acc[0], NR > 1 ? acc[1] : zero);
  const __m256i a23 = _mm256_hadd_epi32(NR > 2 ? acc[2] : zero, NR > 3 ? acc[3] : zero);
  const __m256i s = _mm256_hadd_epi32(a01, a23);  // [s0 s1 s2 s3 | s0 s1 s2 s3] over each 128-bit half
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

inline __m256i int8_wide16(const int8_t* p) {  // 16 int8 as int16 lanes
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i int8_x16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The whole tile's sums over columns [0, k_end) (a multiple of 16) into acc: its twelve accumulators named
// one by one, which the compiler keeps in registers (as an array it spills most of them every step).
inline void int8_dot_4x3(const int16_t* x, int64_t ldx, const int8_t* w, int64_t K, int64_t k_end,
                         __m256i (&acc)[4][3]) {
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
  __m256i a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
  auto madd = [](__m256i& a, __m256i xv, __m256i wv) { a = _mm256_add_epi32(a, _mm256_madd_epi16(xv, wv)); };
  for (int64_t k = 0; k < k_end; k += 16) {
    const __m256i w0 = int8_wide16(w + k), w1 = int8_wide16(w + K + k), w2 = int8_wide16(w + 2 * K + k);
    __m256i xv = int8_x16(x + k);
    madd(a00, xv, w0), madd(a01, xv, w1), madd(a02, xv, w2);
    xv = int8_x16(x + ldx + k);
    madd(a10, xv, w0), madd(a11, xv, w1), madd(a12, xv, w2);
    xv = int8_x16(x + 2 * ldx + k);
    madd(a20, xv, w0), madd(a21, xv, w1), madd(a22, xv, w2);
    xv = int8_x16(x + 3 * ldx + k);
    madd(a30, xv, w0), madd(a31, xv, w1), madd(a32, xv, w2);
  }
  acc[0][0] = a00, acc[0][1] = a01, acc[0][2] = a02, acc[1][0] = a10, acc[1][1] = a11, acc[1][2] = a12;
  acc[2][0] = a20, acc[2][1] = a21, acc[2][2] = a22, acc[3][0] = a30, acc[3][1] = a31, acc[3][2] = a32;
}

// y[i * ldy + j] = x row i (int16, stride ldx) · weight row j (int8, stride K), i < MR, j < NR.
template <int MR, int NR>
inline void int8_tile(const int16_t* x, int64_t ldx, const int8_t* w, int64_t K, int32_t* y, int64_t ldy) {
  __m256i acc[MR][NR];
  int64_t k = 0;
  if constexpr (MR == 4 && NR == 3) {
    k = K / 16 * 16;
    int8_dot_4x3(x, ldx, w, K, k, acc);
  } else {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_si256();
  }
  for (; k + 16 <= K; k += 16) {
    __m256i wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = int8_wide16(w + j * K + k);
    if constexpr (MR < kInt8TileRows)  // few x rows (decode): bound by the weight's memory reads
      for (int j = 0; j < NR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (j + kInt8Ahead) * K + k), _MM_HINT_T0);
    for (int i = 0; i < MR; ++i) {
      const __m256i xv = int8_x16(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(xv, wv[j]));
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(16) int32_t s[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(s), int8_lane_sums<NR>(acc[i]));
    for (int j = 0; j < NR; ++j) {
      int32_t v = s[j];
      for (int64_t t = k; t < K; ++t) v += static_cast<int32_t>(x[i * ldx + t]) * w[j * K + t];
      y[i * ldy + j] = v;
    }
  }
}

// Weight rows [n0, n1) against x rows [m0, m1): tiles of MR x rows by kInt8TileCols weight rows (fewer at the
// end of the run).
template <int MR>
inline void int8_tile_row(const int16_t* x, int64_t K, const int8_t* w, int64_t n0, int64_t n1, int32_t* y,
                          int64_t N) {
  int64_t n = n0;
  for (; n + kInt8TileCols <= n1; n += kInt8TileCols)
    int8_tile<MR, kInt8TileCols>(x, K, w + n * K, K, y + n, N);
  if (n1 - n == 1) int8_tile<MR, 1>(x, K, w + n * K, K, y + n, N);
  if (n1 - n == 2) int8_tile<MR, 2>(x, K, w + n * K, K, y + n, N);
}

// y [M, N] = x [M, K] · w [N, K]ᵀ in int32.
void int8_mm_avx2(const int8_t* x, int64_t M, const int8_t* w, int64_t K, int64_t N, int32_t* y) {
  std::vector<int16_t> wide(M * K);
  for (int64_t i = 0; i < M * K; ++i) wide[i] = x[i];
  const int16_t* xs = wide.data();
  const int64_t tiles = (N + kInt8TileCols - 1) / kInt8TileCols;
  const int64_t block = std::max<int64_t>(1, kInt8BlockBytes / (kInt8TileCols * K)) * kInt8TileCols;
  // at least a few hundred thousand products a task: a thread's start costs more than fewer
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, M * K * kInt8TileCols));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    const int64_t end = std::min(N, t1 * kInt8TileCols);
    for (int64_t b0 = t0 * kInt8TileCols; b0 < end; b0 += block) {
      const int64_t b1 = std::min(end, b0 + block);
      sluice_row_tiles<kInt8TileRows>(0, M, [&](auto r, int64_t m) {
        int8_tile_row<decltype(r)::value>(xs + m * K, K, w, b0, b1, y + m * N, N);
      });
    }
  });
}
