// The AVX2 tier of quant_linear.cpp (avx2, and avx512 on CPUs without VNNI): our exact int8 x int8 product
// (int8_mm_avx2.h; oneDNN's saturates without VNNI) at every row count, the int8 x int4 product (w4a8_avx2.h) and
// LLM.int8()'s bf16 epilogue 8 lanes at a time (bnb_epilogue_avx2.h), the dynamic int8 path's row
// quantization and rescale of bf16 8 lanes at a time (below); the rest is quant_linear.cpp's scalar code.
// Included inside its namespace.
#include "quant_linear_novnni.h"
#include "int8_mm_avx2.h"
#include "w4a8_avx2.h"
#include "bnb_epilogue_avx2.h"

constexpr bool kTierW4A8 = true, kTierBnbEpilogue = true;
constexpr int64_t kTierInt8MaxRows = std::numeric_limits<int64_t>::max();

// int8_mm's product (every row count: torch's is not exact here).
inline void tier_int8_mm(const int8_t* x, int64_t M, const int8_t* w, int64_t K, int64_t N, int32_t* y) {
  int8_mm_avx2(x, M, w, K, N, y);
}

// quantize_rows of bf16 rows, 8 lanes at a time: the scalar code's operations (absmax, a division, round to
// nearest even), the same codes; false for other dtypes.
inline bool quantize_rows_tier(const torch::Tensor& x, int8_t* q, float* s) {
  if (x.scalar_type() != at::kBFloat16) return false;
  const int64_t M = x.size(0), K = x.size(1), K8 = K / 8 * 8;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / K), [&](int64_t begin, int64_t end) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t m = begin; m < end; ++m) {
      const uint16_t* xm = src + m * K;
      __m256 top = _mm256_setzero_ps();
      for (int64_t k = 0; k < K8; k += 8)
        top = _mm256_max_ps(top, _mm256_and_ps(sluice_bf16x8_ps(xm + k), absmask));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, top);
      float amax = *std::max_element(lanes, lanes + 8);
      for (int64_t k = K8; k < K; ++k) amax = std::max(amax, std::abs(sluice_bf16_to_float(xm[k])));
      const float sc = std::max(amax, 1e-12f) / 127.f;
      s[m] = sc;
      const __m256 vs = _mm256_set1_ps(sc);
      int8_t* qm = q + m * K;
      for (int64_t k = 0; k < K8; k += 8) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_div_ps(sluice_bf16x8_ps(xm + k), vs));  // nearest even
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(qm + k), _mm_packs_epi16(w, w));
      }
      for (int64_t k = K8; k < K; ++k)
        qm[k] = static_cast<int8_t>(std::nearbyint(sluice_bf16_to_float(xm[k]) / sc));
    }
  });
  return true;
}

// int8_rescale into bf16, 8 lanes at a time: (acc * row) * col in fp32, rounded to bf16 (nearest even),
// then + bias in fp32 and rounded again, as the scalar code; a short last block on a zero-padded copy. False
// for other dtypes.
inline bool int8_rescale_tier(const torch::Tensor& acc, const torch::Tensor& rs,
                              const torch::Tensor& col_scale, const torch::Tensor& b, torch::Tensor& y) {
  if (col_scale.scalar_type() != at::kBFloat16) return false;
  const int64_t M = acc.size(0), N = acc.size(1);
  const int32_t* a = acc.data_ptr<int32_t>();
  const float* r = rs.data_ptr<float>();
  const at::BFloat16* cs = col_scale.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / N), [&](int64_t begin, int64_t end) {
    alignas(32) int32_t ta[8];
    alignas(32) at::BFloat16 tc[8], tb[8];
    for (int64_t m = begin; m < end; ++m) {
      const __m256 rm = _mm256_set1_ps(r[m]);
      for (int64_t n = 0; n < N; n += 8) {
        const int64_t left = std::min<int64_t>(8, N - n);
        const int32_t* ap = a + m * N + n;
        const at::BFloat16* cp = cs + n;
        const at::BFloat16* bq = bp == nullptr ? nullptr : bp + n;
        if (left < 8) {
          for (int j = 0; j < 8; ++j) {
            ta[j] = j < left ? ap[j] : 0;
            tc[j] = j < left ? cp[j] : at::BFloat16(0.f);
            if (bq != nullptr) tb[j] = j < left ? bq[j] : at::BFloat16(0.f);
          }
          ap = ta, cp = tc, bq = bq == nullptr ? nullptr : tb;
        }
        const __m256i acc8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ap));
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc8), rm);
        asm("" : "+x"(v));
        __m256i h = sluice_round_bf16x8(_mm256_mul_ps(v, bnb_load_bf16x8(cp)));
        if (bq != nullptr)
          h = sluice_round_bf16x8(
              _mm256_add_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), bnb_load_bf16x8(bq)));
        bnb_store_bf16x8(out + m * N + n, h, left);
      }
    }
  });
  return true;
}
