// The AVX2 tier of quant_linear.cpp's int8 x int4 product (`int4_vnni_mm`; AVX2 + FMA, no VNNI: Zen 2/3, Haswell
// on), on the same weight layout and the same quantized activations (w4a8.h) as the AVX-512 VNNI kernel. Per chunk
// of 128 columns one weight row's 64 bytes are two ymm loads; low and high nibbles (u8 codes 0..15) times the int8
// activations by `vpmaddubsw` (a pair sums to at most 2 x 15 x 128: no int16 saturation, and the low and high
// halves' sum at most twice that), widened to int32 by `vpmaddwd` with ones and folded by `vphaddd` to one lane per
// group. A block of four chunks leaves its 16 group sums in the order unpacklo/unpackhi of the block's scales puts
// them (position 4 g + c holds group 4 c + g), so the per-group s x d multiply is two FMAs per block. The group
// offsets (- 8 d sum a) and zeros (z sum x) are added per row at the end. Included by quant_linear.cpp inside its
// namespace (through quant_linear_avx2.h), after w4a8.h.

inline float sluice_hsum8_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline __m256 sluice_bf16x8_ps(const uint16_t* p) {  // 8 bf16 as fp32 (a shift: exact)
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

struct W4Chunk {  // one weight row's codes of a chunk: groups 0-1 and 2-3, low and high nibbles
  __m256i lo01, hi01, lo23, hi23;
};

inline W4Chunk w4_load_chunk(const uint8_t* q) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i v01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i v23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
  return {_mm256_and_si256(v01, low4), _mm256_and_si256(_mm256_srli_epi16(v01, 4), low4),
          _mm256_and_si256(v23, low4), _mm256_and_si256(_mm256_srli_epi16(v23, 4), low4)};
}

// A chunk's int32 sums of codes x activations (a: the chunk's 128 activation bytes), two lanes a group:
// [g0, g0, g2, g2 | g1, g1, g3, g3].
inline __m256i w4_chunk_dot(const W4Chunk& w, const int8_t* a) {
  auto ld = [a](int off) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + off)); };
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo01, ld(0)), _mm256_maddubs_epi16(w.hi01, ld(64)));
  const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo23, ld(32)), _mm256_maddubs_epi16(w.hi23, ld(96)));
  return _mm256_hadd_epi32(_mm256_madd_epi16(s01, ones), _mm256_madd_epi16(s23, ones));
}

// R activation rows' fp32 sums over a whole block b of four chunks (16 groups) of one weight row, into acc.
template <int R>
inline void w4_block_avx2(const W4Acts* acts, const uint8_t* qj, const uint16_t* sj, int64_t b, __m256* acc) {
  const __m256 s_lo = sluice_bf16x8_ps(sj + 16 * b), s_hi = sluice_bf16x8_ps(sj + 16 * b + 8);
  for (int pair = 0; pair < 2; ++pair) {  // chunks 4b + 2 pair and the next: block groups in unpack order
    const int64_t c = 4 * b + 2 * pair;
    const W4Chunk w0 = w4_load_chunk(qj + c * 64), w1 = w4_load_chunk(qj + c * 64 + 64);
    for (int m = 0; m < R; ++m) {
      const int8_t* am = acts[m].a + c * kW4Chunk;
      const __m256i sums = _mm256_hadd_epi32(w4_chunk_dot(w0, am), w4_chunk_dot(w1, am + kW4Chunk));
      const __m256 d_lo = _mm256_mul_ps(s_lo, _mm256_loadu_ps(acts[m].d + 64 * b));
      const __m256 d_hi = _mm256_mul_ps(s_hi, _mm256_loadu_ps(acts[m].d + 64 * b + 8));
      const __m256 ds = pair == 0 ? _mm256_unpacklo_ps(d_lo, d_hi) : _mm256_unpackhi_ps(d_lo, d_hi);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), ds, acc[m]);
    }
  }
}

// The same for chunk c past the last whole block (its groups' scales in group order).
template <int R>
inline void w4_chunk_avx2(const W4Acts* acts, const uint8_t* qj, const uint16_t* sj, int64_t c, __m256* acc) {
  const W4Chunk w = w4_load_chunk(qj + c * 64);
  float s[4];
  for (int g = 0; g < 4; ++g) s[g] = sluice_bf16_to_float(sj[4 * c + g]);
  for (int m = 0; m < R; ++m) {
    const float* d = acts[m].d + c * 16;  // group 4 c + g's d at 4 g
    const __m256 ds = _mm256_setr_ps(s[0] * d[0], s[0] * d[0], s[2] * d[8], s[2] * d[8],
                                     s[1] * d[4], s[1] * d[4], s[3] * d[12], s[3] * d[12]);
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w4_chunk_dot(w, acts[m].a + c * kW4Chunk)), ds, acc[m]);
  }
}

// x row [K] (bf16 bits) -> the quantized activations: the scalar quantization (w4a8.h).
inline void w4_quantize_row(const uint16_t* x, int64_t K, int64_t Kp, const W4Acts& r) {
  w4_quantize_row_scalar(x, K, Kp, r);
}

// One weight row (codes qj, scales/zeros sj) against R activation rows: out[m * ldo] = the product + bias, bf16.
template <int R>
inline void w4_row_avx2(const W4Acts* acts, int64_t Kp, const uint8_t* qj, const uint16_t* sj, float bias,
                        at::BFloat16* out, int64_t ldo) {
  const int64_t Gp = Kp / kW4Group, chunks = Kp / kW4Chunk, blocks = chunks / 4;
  __m256 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) w4_block_avx2<R>(acts, qj, sj, b, acc);
  for (int64_t c = 4 * blocks; c < chunks; ++c) w4_chunk_avx2<R>(acts, qj, sj, c, acc);
  for (int64_t g = 0; g < Gp; g += 8) {  // Gp is a multiple of 4: a last half vector through a short copy
    uint16_t s8[8] = {}, z8[8] = {};
    const int64_t n = std::min<int64_t>(8, Gp - g);
    std::memcpy(s8, sj + g, n * 2);
    std::memcpy(z8, sj + Gp + g, n * 2);
    const __m256 s = sluice_bf16x8_ps(s8), z = sluice_bf16x8_ps(z8);
    for (int m = 0; m < R; ++m) {
      float off[8] = {}, sum[8] = {};
      std::memcpy(off, acts[m].off + g, n * 4);
      std::memcpy(sum, acts[m].sum + g, n * 4);
      acc[m] = _mm256_fmadd_ps(s, _mm256_loadu_ps(off), _mm256_fmadd_ps(z, _mm256_loadu_ps(sum), acc[m]));
    }
  }
  for (int m = 0; m < R; ++m) out[m * ldo] = static_cast<at::BFloat16>(sluice_hsum8_ps(acc[m]) + bias);
}

// Output rows [n0, n1) of y [M, N]: each weight row against the activation rows four at a time, the activations
// in blocks of kW4RowBlock rows (their scratch stays in L2 while the task's weight rows, in L1, pass over it).
constexpr int64_t kW4RowBlock = 64;

void w4_rows(const W4Acts* acts, int64_t M, int64_t Kp, const uint8_t* q, const uint16_t* sz,
             const at::BFloat16* bias, int64_t n0, int64_t n1, at::BFloat16* y, int64_t N) {
  const int64_t row = Kp / 2, Gp = Kp / kW4Group;
  for (int64_t m0 = 0; m0 < M; m0 += kW4RowBlock) {
    const int64_t m1 = std::min(M, m0 + kW4RowBlock);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qn = q + n * row;
      const uint16_t* sn = sz + n * 2 * Gp;
      const float b = bias != nullptr ? static_cast<float>(bias[n]) : 0.f;
      sluice_row_tiles<4>(m0, m1, [&](auto r, int64_t m) {
        w4_row_avx2<decltype(r)::value>(acts + m, Kp, qn, sn, b, y + m * N + n, N);
      });
    }
  }
}
