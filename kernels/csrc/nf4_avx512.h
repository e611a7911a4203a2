// The AVX-512 tier of nf4.cpp (avx512 and up): chunks of 32 columns (16 bytes), widened to 16 int32 lanes whose
// low nibble indexes the block's scaled table by `vpermps` directly (it reads the low 4 bits) and whose high
// nibble does after a shift; fp32 FMAs into one sum per x row and weight row. Included by nf4.cpp.
#pragma once

constexpr int64_t kNf4Chunk = 32;
constexpr const char* kNf4Tier = "avx512";

// Weight rows a call takes for MT x rows (at most kNf4MaxTileRows): sums MT x R stay in registers.
constexpr int kNf4MaxTileRows = 4;  // x rows a pass takes: more spill the sums

template <int MT>
constexpr int nf4_rows_for() { return MT == 1 ? 8 : 4; }

// R weight rows (codes with row stride ldw, absmax with row stride lda) over `len` columns against MT rows of xp
// (row stride ldx, chunk order): out[m * ldo + r] += sum over those columns of table[code] * absmax * x.
template <int R, int MT>
inline void nf4_dots(const uint8_t* w, int64_t ldw, const at::BFloat16* am, int64_t lda, const float* table,
                     const float* xp, int64_t ldx, int64_t len, float* out,
                     int64_t ldo) {
  const __m512 lut = _mm512_loadu_ps(table);
  __m512 acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < len / kNf4Block; ++b) {
    __m512 scaled[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) scaled[r] = _mm512_mul_ps(lut, _mm512_set1_ps(bf16_to_float(am[r * lda + b])));
    for (int64_t k = b * kNf4Block; k < (b + 1) * kNf4Block; k += kNf4Chunk) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * ldw + k / 2)));
        const __m512 even = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), scaled[r]);
        const __m512 odd = _mm512_permutexvar_ps(v, scaled[r]);
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) {
          acc[m][r] = _mm512_fmadd_ps(even, _mm512_loadu_ps(xp + m * ldx + k), acc[m][r]);
          acc[m][r] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xp + m * ldx + k + 16), acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) out[m * ldo + r] += _mm512_reduce_add_ps(acc[m][r]);
}

// The 32 values of one chunk in column order (two fp32 vectors) from its 16 bytes and the block's scaled table.
inline void nf4_chunk_values(const uint8_t* bytes, __m512 scaled, __m512& first, __m512& second) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512 even = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), scaled);
  const __m512 odd = _mm512_permutexvar_ps(v, scaled);
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  first = _mm512_permutex2var_ps(even, lo, odd);
  second = _mm512_permutex2var_ps(even, hi, odd);
}

// 16 fp32 to bf16, rounded to nearest even (finite values).
inline __m256i nf4_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

inline void nf4_store(float* out, __m512 a, __m512 b) {
  _mm512_storeu_ps(out, a);
  _mm512_storeu_ps(out + 16, b);
}

inline void nf4_store(at::BFloat16* out, __m512 a, __m512 b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), nf4_to_bf16(a));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), nf4_to_bf16(b));
}

// One weight row [K] dequantized into out (fp32, or bf16 rounded once).
template <typename T>
inline void nf4_dequant_row(const uint8_t* codes, const at::BFloat16* am, const float* table, int64_t K, T* out) {
  const __m512 lut = _mm512_loadu_ps(table);
  for (int64_t b = 0; b < K / kNf4Block; ++b) {
    const __m512 scaled = _mm512_mul_ps(lut, _mm512_set1_ps(bf16_to_float(am[b])));
    for (int64_t k = b * kNf4Block; k < (b + 1) * kNf4Block; k += kNf4Chunk) {
      __m512 first, second;
      nf4_chunk_values(codes + k / 2, scaled, first, second);
      nf4_store(out + k, first, second);
    }
  }
}
