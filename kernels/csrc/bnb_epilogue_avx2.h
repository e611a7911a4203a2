// LLM.int8()'s bf16 epilogue on the AVX2 tier, 8 lanes at a time, each rounding as quant_linear_avx512.h's 16-lane
// versions (and the torch ops they stand for) make it: bitsandbytes' int8_mm_dequant and the outlier columns'
// product. An empty asm between the steps keeps torch's order under the fast-math flags. A short last block is
// computed on a zero-padded copy, so every lane takes the same arithmetic. Included by quant_linear_avx2.h inside
// quant_linear.cpp's namespace.

#include "bf16_avx2.h"  // sluice_bf16x8_ps, sluice_round_bf16x8

// 8 bf16 values as fp32 lanes.
inline __m256 bnb_load_bf16x8(const at::BFloat16* p) {
  return sluice_bf16x8_ps(reinterpret_cast<const uint16_t*>(p));
}

// sluice_round_bf16x8's lanes stored as 8 bf16 (the first `left` of them).
inline void bnb_store_bf16x8(at::BFloat16* dst, __m256i h, int64_t left) {
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  if (left >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
  } else {
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
    std::memcpy(dst, tmp, left * sizeof(uint16_t));
  }
}

// bitsandbytes' int8_mm_dequant of acc [M, N] into bf16: acc * (row[m] * col[n]) * 6.200124e-05, + bias, each an
// fp32 rounding in torch's order, then to bf16, nearest even (quant_linear_avx512.h's, 8 lanes).
inline bool bnb_dequant_tier(const torch::Tensor& acc, const float* r, const float* c, const at::BFloat16* bp,
                             torch::Tensor& y) {
  if (y.scalar_type() != at::kBFloat16) return false;
  const int64_t M = acc.size(0), N = acc.size(1);
  const int32_t* a = acc.data_ptr<int32_t>();
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  const __m256 k = _mm256_set1_ps(6.200124e-05f);
  at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / N), [&](int64_t begin, int64_t end) {
    alignas(32) int32_t ta[8];
    alignas(32) float tc[8];
    alignas(32) at::BFloat16 tb[8];
    for (int64_t m = begin; m < end; ++m) {
      const __m256 rm = _mm256_set1_ps(r[m]);
      for (int64_t n = 0; n < N; n += 8) {
        const int64_t left = std::min<int64_t>(8, N - n);
        const int32_t* ap = a + m * N + n;
        const float* cp = c + n;
        const at::BFloat16* bq = bp == nullptr ? nullptr : bp + n;
        if (left < 8) {  // a zero-padded copy of the short block
          for (int j = 0; j < 8; ++j) {
            ta[j] = j < left ? ap[j] : 0;
            tc[j] = j < left ? cp[j] : 0.f;
            if (bq != nullptr) tb[j] = j < left ? bq[j] : at::BFloat16(0.f);
          }
          ap = ta, cp = tc, bq = bq == nullptr ? nullptr : tb;
        }
        __m256 t = _mm256_mul_ps(rm, _mm256_loadu_ps(cp));
        asm("" : "+x"(t));
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ap))), t);
        asm("" : "+x"(v));
        v = _mm256_mul_ps(v, k);
        asm("" : "+x"(v));
        if (bq != nullptr) v = _mm256_add_ps(v, bnb_load_bf16x8(bq));
        bnb_store_bf16x8(out + m * N + n, sluice_round_bf16x8(v), left);
      }
    }
  });
  return true;
}

// LLM.int8()'s outlier columns added back to out [M, N] (bf16, in place), as quant_linear_avx512.h's: per output n
// each column's weight (cb[n][c_k] * scb[n]) * (1/127) in fp32, rounded to bf16; the products with the outlier
// inputs xs[m][k] (fp32 [M, C]; exact products, so one FMA each) summed from 0 in column order, added to out[m][n]
// in fp32, rounded to bf16 once. R rows at a time: R independent sums per column block.
template <int R>
inline void bnb_outlier_rows_avx2(const float* xs, int64_t C, const __m256* sub, at::BFloat16* out, int64_t N,
                                  int64_t left) {
  __m256 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < C; ++k) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(xs[r * C + k]), sub[k], acc[r]);  // the product is exact: one add
      asm("" : "+x"(acc[r]));
    }
  }
  alignas(32) at::BFloat16 prior[8];
  for (int r = 0; r < R; ++r) {
    at::BFloat16* o = out + r * N;
    const at::BFloat16* src = o;
    if (left < 8) {  // a zero-padded copy of the short block
      for (int j = 0; j < 8; ++j) prior[j] = j < left ? o[j] : at::BFloat16(0.f);
      src = prior;
    }
    bnb_store_bf16x8(o, sluice_round_bf16x8(_mm256_add_ps(bnb_load_bf16x8(src), acc[r])), left);
  }
}

inline bool bnb_outliers_tier(const float* xs, int64_t M, const int64_t* cols, int64_t C, const int8_t* cb, int64_t K,
                              const float* scb, at::BFloat16* out, int64_t N) {
  const __m256 inv127 = _mm256_set1_ps(7.874015718698502e-3f);
  at::parallel_for(0, (N + 7) / 8, std::max<int64_t>(1, at::internal::GRAIN_SIZE / (8 * C * (M + 1))),
                   [&](int64_t begin, int64_t end) {
    std::vector<__m256> sub(C);
    alignas(32) int32_t codes[8];
    alignas(32) float scale[8];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * 8, left = std::min<int64_t>(8, N - n0);
      for (int j = 0; j < 8; ++j) scale[j] = j < left ? scb[n0 + j] : 0.f;
      const __m256 s = _mm256_load_ps(scale);
      for (int64_t k = 0; k < C; ++k) {
        for (int j = 0; j < 8; ++j) codes[j] = j < left ? cb[(n0 + j) * K + cols[k]] : 0;
        __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(codes))), s);
        asm("" : "+x"(w));
        w = _mm256_mul_ps(w, inv127);
        asm("" : "+x"(w));
        sub[k] = _mm256_castsi256_ps(_mm256_slli_epi32(sluice_round_bf16x8(w), 16));
      }
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) bnb_outlier_rows_avx2<8>(xs + m * C, C, sub.data(), out + m * N + n0, N, left);
      for (; m < M; ++m) bnb_outlier_rows_avx2<1>(xs + m * C, C, sub.data(), out + m * N + n0, N, left);
    }
  });
  return true;
}
