// bf16 <-> fp32, 8 lanes, for the AVX2 kernels (bf16_gemm_avx2.h, w4a8_avx2.h, bnb_epilogue_avx2.h): included
// inside the namespace of the file that includes it first.
#pragma once

inline __m256 sluice_bf16x8_ps(const uint16_t* p) {  // 8 bf16 as fp32 (a shift: exact)
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Eight fp32 to bf16, rounded to nearest even as c10::BFloat16 does (NaN to its quiet NaN), in the low 16 bits of
// each 32-bit lane.
inline __m256i sluice_round_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
