// Shared AVX-512 helpers of the CPU kernels (header only; cpp_build hashes csrc/*.h into every build name).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#include <cstdint>
#include <cstring>

// For the small reductions below: called out of line, a caller would write its accumulators to memory.
#define SLUICE_INLINE inline __attribute__((always_inline))

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

#if defined(__AVX512DQ__)
// Four fp32 vectors to their four sums (lane i: the sum of a_i): 9 instructions where the tree above takes 45.
SLUICE_INLINE __m128 sluice_reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x01, x23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(x01, x23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 z = _mm256_add_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
  return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
}

// The same for int32 lanes (exact sums).
SLUICE_INLINE __m128i sluice_reduce4_epi32(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  auto f = [](__m512i a) { return _mm512_castsi512_ps(a); };
  const __m512i x01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i x23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  const __m512i y = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(f(x01), f(x23), _MM_SHUFFLE(1, 0, 1, 0))),
                                     _mm512_castps_si512(_mm512_shuffle_ps(f(x01), f(x23), _MM_SHUFFLE(3, 2, 3, 2))));
  const __m256i z = _mm256_add_epi32(_mm512_castsi512_si256(y), _mm512_extracti32x8_epi32(y, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(z), _mm256_extracti128_si256(z, 1));
}

// One vector's lanes summed, for each lane type.
SLUICE_INLINE float sluice_hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
SLUICE_INLINE int32_t sluice_hsum(__m512i v) { return _mm512_reduce_add_epi32(v); }
SLUICE_INLINE __m128 sluice_reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float) {
  return sluice_reduce4(a0, a1, a2, a3);
}
SLUICE_INLINE __m128i sluice_reduce4(__m512i a0, __m512i a1, __m512i a2, __m512i a3, int32_t) {
  return sluice_reduce4_epi32(a0, a1, a2, a3);
}
inline __m512 sluice_reduce16(const __m512* v, float) { return sluice_reduce16(v); }
inline __m512i sluice_reduce16(const __m512i* v, int32_t) { return sluice_reduce16_epi32(v); }

// out[i] = the sum of v[i]'s lanes for i < N (N <= 16; fp32 or int32 lanes), by what measured fastest for N:
// each vector on its own below four, four at once to eight, else all sixteen.
template <int N, typename V, typename T>
SLUICE_INLINE void sluice_sums(const V* v, T* out) {
  static_assert(N >= 1 && N <= 16, "one to sixteen vectors");
  const V zero{};
  if constexpr (N < 4) {  // independent reductions measured faster than a tree padded with zeros
    for (int i = 0; i < N; ++i) out[i] = sluice_hsum(v[i]);
  } else if constexpr (N <= 8) {
    T lanes[8];
    const auto lo = sluice_reduce4(v[0], v[1], v[2], v[3], T{});
    std::memcpy(lanes, &lo, sizeof(lo));
    if constexpr (N > 4) {
      const auto hi = sluice_reduce4(v[4], N > 5 ? v[5] : zero, N > 6 ? v[6] : zero, N > 7 ? v[7] : zero, T{});
      std::memcpy(lanes + 4, &hi, sizeof(hi));
    }
    for (int i = 0; i < N; ++i) out[i] = lanes[i];
  } else {
    V all[16];
    for (int i = 0; i < 16; ++i) all[i] = i < N ? v[i] : zero;
    const auto tree = sluice_reduce16(N == 16 ? v : all, T{});
    T lanes[16];
    std::memcpy(lanes, &tree, sizeof(tree));
    for (int i = 0; i < N; ++i) out[i] = lanes[sluice_lane_of(i)];
  }
}
#endif

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
