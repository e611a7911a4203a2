// The AVX2 tier of nf4.cpp: chunks of 16 columns (8 bytes) widened to 8 int32 lanes; a code looks up the block's
// scaled table in two halves of 8 (`vpermps` reads the low 3 bits) blended on its bit 3; fp32 FMAs into one sum
// per x row and weight row. Included by nf4.cpp.
#pragma once

constexpr int64_t kNf4Chunk = 16;
constexpr const char* kNf4Tier = "avx2";

// Weight rows a call takes for MT x rows (16 ymm registers: sums, two scaled half-tables a row, the codes).
constexpr int kNf4MaxTileRows = 2;  // x rows a pass takes: more spill the sums

template <int MT>
constexpr int nf4_rows_for() { return MT == 1 ? 4 : 2; }

struct Nf4Table {
  __m256 lo, hi;  // codes 0-7 and 8-15
};

inline Nf4Table nf4_scaled(const float* table, float s) {
  const __m256 sv = _mm256_set1_ps(s);
  return {_mm256_mul_ps(_mm256_loadu_ps(table), sv), _mm256_mul_ps(_mm256_loadu_ps(table + 8), sv)};
}

// table[idx & 15] per lane.
inline __m256 nf4_lookup(const Nf4Table& t, __m256i idx) {
  const __m256 lo = _mm256_permutevar8x32_ps(t.lo, idx), hi = _mm256_permutevar8x32_ps(t.hi, idx);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

inline __m256i nf4_bytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// R weight rows (codes with row stride ldw, absmax with row stride lda) over `len` columns against MT rows of xp
// (row stride ldx, chunk order): out[m * ldo + r] += sum over those columns of table[code] * absmax * x.
template <int R, int MT>
inline void nf4_dots(const uint8_t* w, int64_t ldw, const at::BFloat16* am, int64_t lda, const float* table,
                     const float* xp, int64_t ldx, int64_t len, float* out,
                     int64_t ldo) {
  __m256 acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < len / kNf4Block; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const Nf4Table t = nf4_scaled(table, bf16_to_float(am[r * lda + b]));
      for (int64_t k = b * kNf4Block; k < (b + 1) * kNf4Block; k += kNf4Chunk) {
        const __m256i v = nf4_bytes(w + r * ldw + k / 2);
        const __m256 even = nf4_lookup(t, _mm256_srli_epi32(v, 4)), odd = nf4_lookup(t, v);
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) {
          acc[m][r] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xp + m * ldx + k), acc[m][r]);
          acc[m][r] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xp + m * ldx + k + 8), acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) {
      const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m][r]), _mm256_extractf128_ps(acc[m][r], 1));
      const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
      out[m * ldo + r] += _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    }
}

// 8 fp32 to bf16 bits (in int32 lanes), rounded to nearest even (finite values).
inline __m256i nf4_bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}

inline void nf4_store(float* out, __m256 a, __m256 b) {
  _mm256_storeu_ps(out, a);
  _mm256_storeu_ps(out + 8, b);
}

inline void nf4_store(at::BFloat16* out, __m256 a, __m256 b) {
  const __m256i packed = _mm256_packus_epi32(nf4_bf16_bits(a), nf4_bf16_bits(b));  // lanes a0-3 b0-3 a4-7 b4-7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(packed, 0xD8));
}

// One weight row [K] dequantized into out (fp32, or bf16 rounded once).
template <typename T>
inline void nf4_dequant_row(const uint8_t* codes, const at::BFloat16* am, const float* table, int64_t K, T* out) {
  for (int64_t b = 0; b < K / kNf4Block; ++b) {
    const Nf4Table t = nf4_scaled(table, bf16_to_float(am[b]));
    for (int64_t k = b * kNf4Block; k < (b + 1) * kNf4Block; k += kNf4Chunk) {
      const __m256i v = nf4_bytes(codes + k / 2);
      const __m256 even = nf4_lookup(t, _mm256_srli_epi32(v, 4)), odd = nf4_lookup(t, v);
      const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
      nf4_store(out + k, _mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
    }
  }
}
