// Shared AVX-512 helpers of the CPU kernels (header only; cpp_build hashes csrc/*.h into every build name).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

// Sixteen fp32 vectors to their sixteen sums in one vector (a shuffle/add tree, not 16 horizontal reductions):
// lane 4l + p of the result is the sum of v[4p + l]. `sluice_lane_of(i)` is the lane that v[i]'s sum lands in.
inline __m512 sluice_reduce16(const __m512* v) {
  __m512 s1[8], s2[4], s3[2];
  for (int j = 0; j < 8; ++j)  // 256-bit halves: [v2j 8 | v2j+1 8]
    s1[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                          _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // 128-bit lane l: v[4j + l], 4 partials each
    s2[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * j], s1[2 * j + 1], 0x88),
                          _mm512_shuffle_f32x4(s1[2 * j], s1[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)
    s3[j] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * j], s2[2 * j + 1], 0x44),
                          _mm512_shuffle_ps(s2[2 * j], s2[2 * j + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
}

constexpr int sluice_lane_of(int i) { return (i % 4) * 4 + i / 4; }

// The same tree for int32 lanes (the shuffles move bits only; the adds are integer, so the sums are exact).
inline __m512i sluice_reduce16_epi32(const __m512i* v) {
  auto f = [](__m512i a) { return _mm512_castsi512_ps(a); };
  auto i = [](__m512 a) { return _mm512_castps_si512(a); };
  __m512i s1[8], s2[4], s3[2];
  for (int j = 0; j < 8; ++j)
    s1[j] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    s2[j] = _mm512_add_epi32(_mm512_shuffle_i32x4(s1[2 * j], s1[2 * j + 1], 0x88),
                             _mm512_shuffle_i32x4(s1[2 * j], s1[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)
    s3[j] = _mm512_add_epi32(i(_mm512_shuffle_ps(f(s2[2 * j]), f(s2[2 * j + 1]), 0x44)),
                             i(_mm512_shuffle_ps(f(s2[2 * j]), f(s2[2 * j + 1]), 0xEE)));
  return _mm512_add_epi32(i(_mm512_shuffle_ps(f(s3[0]), f(s3[1]), 0x88)),
                          i(_mm512_shuffle_ps(f(s3[0]), f(s3[1]), 0xDD)));
}
#if defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 bf16 values (p) as fp32 lanes, lanes off `mask` 0.
inline __m512 sluice_load_bf16(const void* p, __mmask16 mask = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
#endif

// The lanes of a 16-lane step that `left` elements fill.
inline __mmask16 sluice_tail16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}
#endif
