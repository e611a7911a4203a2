// The AVX2 tier of quant_linear.cpp's int8 x int4 product (`int4_vnni_mm`; AVX2 + FMA, no VNNI: Zen 2/3, Haswell
// on), on the same weight layout as the AVX-512 VNNI kernel (w4a8.h). Per chunk of 128 columns one weight row's 64
// bytes are two ymm loads; low and high nibbles (u8 codes 0..15) times the int8 activations by `vpmaddubsw` (a
// pair sums to at most 2 x 15 x 128: no int16 saturation, and the low and high halves' sum at most twice that),
// widened to int32 by `vpmaddwd` with ones and folded by two `vphaddd` to one lane per group for a pair of chunks:
// lane l of pair p holds group 4 (2 p + (l >> 1 & 1)) + (l & 1) * 2 + (l >> 2) (`w4_lane` is the inverse). The
// activations' d, codes' offset (- 8 sum a, exact in fp32) and x sums are stored in that lane order (this tier's
// own, W4Acts' arrays reused), the weight row's scales and zeros brought to it once per row (unpacklo/hi inside a
// block of four chunks, whose scales sit in w4_pos order; a permute for the chunks after the blocks, in group
// order), so each pair of chunks ends in s d (dot + off) + z sum: three FMAs per 8 groups, no per-row epilogue.
// Each parallel task's weight rows (L1) pass over the activation rows four at a time (L1 too). Included by
// quant_linear.cpp inside its namespace (through quant_linear_avx2.h), after w4a8.h.

inline float sluice_hsum8_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#include "bf16_avx2.h"  // sluice_bf16x8_ps

inline __m256 sluice_bf16x4_ps(const uint16_t* p) {  // 4 bf16 as fp32 lanes 0-3, lanes 4-7 zero
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Index of group g in this tier's lane order (d, off, sum of W4Acts).
inline int64_t w4_lane(int64_t g) {
  const int64_t c = g / 4, gi = g % 4;
  return 8 * (c / 2) + ((gi >> 1) | ((c & 1) << 1) | ((gi & 1) << 2));
}

inline int32_t sluice_hsum8_epi32_w4(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// Group g of x (32 bf16) quantized: codes into the chunk's low / high halves (a), d, off and sum at its lane.
inline void w4_quantize_group(const uint16_t* x, int64_t g, const W4Acts& r) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = sluice_bf16x8_ps(x + 8 * i);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
  __m256 mn = _mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3]));
  mx = _mm256_and_ps(_mm256_max_ps(mx, _mm256_sub_ps(_mm256_setzero_ps(), mn)), absmask);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))), dg = amax / 127.f;
  const int64_t lane = w4_lane(g);
  r.d[lane] = dg;
  r.sum[lane] = sluice_hsum8_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  if (amax == 0.f) return;  // codes, off stay 0
  const __m256 dv = _mm256_set1_ps(dg);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], dv));  // nearest even, as nearbyint
  r.off[lane] = -8.f * static_cast<float>(sluice_hsum8_epi32_w4(
      _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]))));
  const __m256i bytes = _mm256_permutevar8x32_epi32(  // packs interleave the 128-bit lanes: put back in order
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  int8_t* at = r.a + (g / 4) * kW4Chunk + 16 * (g % 4);  // columns 0-15 into the low halves, 16-31 the high
  _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm256_castsi256_si128(bytes));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 64), _mm256_extracti128_si256(bytes, 1));
}

// x row [K] (bf16 bits) -> the quantized activations in this tier's lane order (groups past K stay zero).
inline void w4_quantize_row(const uint16_t* x, int64_t K, int64_t Kp, const W4Acts& r) {
  w4_clear_row(r, Kp);
  for (int64_t g = 0; g < K / kW4Group; ++g) w4_quantize_group(x + kW4Group * g, g, r);
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

struct W4PairScales {  // a weight row's scales and zeros of a pair of chunks, in lane order
  __m256 s, z;
};

// Scales and zeros of pair p of weight row sj (Gp groups, `blocks` whole blocks of four chunks), lane order.
inline W4PairScales w4_pair_scales(const uint16_t* sj, int64_t Gp, int64_t blocks, int64_t p, int64_t chunks) {
  if (p < 2 * blocks) {  // positions 16 b .. 16 b + 15: unpacklo (pair 0) / unpackhi (pair 1) of the two halves
    const int64_t at = 16 * (p / 2);
    const __m256 s_lo = sluice_bf16x8_ps(sj + at), s_hi = sluice_bf16x8_ps(sj + at + 8);
    const __m256 z_lo = sluice_bf16x8_ps(sj + Gp + at), z_hi = sluice_bf16x8_ps(sj + Gp + at + 8);
    return p % 2 == 0 ? W4PairScales{_mm256_unpacklo_ps(s_lo, s_hi), _mm256_unpacklo_ps(z_lo, z_hi)}
                      : W4PairScales{_mm256_unpackhi_ps(s_lo, s_hi), _mm256_unpackhi_ps(z_lo, z_hi)};
  }
  const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // group order -> lane order
  const int64_t g = 8 * p;
  const bool whole = 2 * p + 1 < chunks;  // a last odd chunk: its four groups only (lanes of the absent chunk 0)
  const __m256 s = whole ? sluice_bf16x8_ps(sj + g) : sluice_bf16x4_ps(sj + g);
  const __m256 z = whole ? sluice_bf16x8_ps(sj + Gp + g) : sluice_bf16x4_ps(sj + Gp + g);
  return {_mm256_permutevar8x32_ps(s, idx), _mm256_permutevar8x32_ps(z, idx)};
}

// One weight row (codes qj, scales/zeros sj) against R activation rows: out[m * ldo] = the product + bias, bf16.
template <int R>
inline void w4_row_avx2(const W4Acts* acts, int64_t Kp, const uint8_t* qj, const uint16_t* sj, float bias,
                        at::BFloat16* out, int64_t ldo) {
  const int64_t Gp = Kp / kW4Group, chunks = Kp / kW4Chunk, blocks = chunks / 4;
  __m256 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t p = 0; 2 * p < chunks; ++p) {
    const W4PairScales sz = w4_pair_scales(sj, Gp, blocks, p, chunks);
    const int64_t c = 2 * p;
    const W4Chunk w0 = w4_load_chunk(qj + c * 64);
    const bool second = c + 1 < chunks;
    const W4Chunk w1 = second ? w4_load_chunk(qj + c * 64 + 64) : W4Chunk{};
    for (int m = 0; m < R; ++m) {
      const int8_t* am = acts[m].a + c * kW4Chunk;
      const __m256i d1 = second ? w4_chunk_dot(w1, am + kW4Chunk) : _mm256_setzero_si256();
      const __m256i sums = _mm256_hadd_epi32(w4_chunk_dot(w0, am), d1);
      const __m256 dot = _mm256_add_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(acts[m].off + 8 * p));
      const __m256 ds = _mm256_mul_ps(sz.s, _mm256_loadu_ps(acts[m].d + 8 * p));
      acc[m] = _mm256_fmadd_ps(sz.z, _mm256_loadu_ps(acts[m].sum + 8 * p), _mm256_fmadd_ps(dot, ds, acc[m]));
    }
  }
  for (int m = 0; m < R; ++m) out[m * ldo] = static_cast<at::BFloat16>(sluice_hsum8_ps(acc[m]) + bias);
}

// Output rows [n0, n1) of y [M, N]: the weight rows in runs that stay in L1 (kW4L1Bytes), each run passing over
// the activation rows four at a time.
constexpr int64_t kW4L1Bytes = 16 << 10;

void w4_rows(const W4Acts* acts, int64_t M, int64_t Kp, const uint8_t* q, const uint16_t* sz,
             const at::BFloat16* bias, int64_t n0, int64_t n1, at::BFloat16* y, int64_t N) {
  const int64_t row = Kp / 2, Gp = Kp / kW4Group;
  const int64_t run = std::max<int64_t>(1, kW4L1Bytes / (row + 4 * Gp));
  for (int64_t r0 = n0; r0 < n1; r0 += run) {
    const int64_t r1 = std::min(n1, r0 + run);
    sluice_row_tiles<4>(0, M, [&](auto r, int64_t m) {
      for (int64_t n = r0; n < r1; ++n) {
        const float b = bias != nullptr ? static_cast<float>(bias[n]) : 0.f;
        w4_row_avx2<decltype(r)::value>(acts + m, Kp, q + n * row, sz + n * 2 * Gp, b, y + m * N + n, N);
      }
    });
  }
}
