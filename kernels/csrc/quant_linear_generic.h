// quant_linear.cpp on a host without AVX2 (or not x86): the scalar code and torch's products only. Included
// inside its namespace.
#include "quant_linear_novnni.h"

constexpr bool kTierW4A8 = false, kTierBnbEpilogue = false;

inline bool bnb_dequant_tier(const torch::Tensor&, const float*, const float*, const at::BFloat16*, torch::Tensor&) {
  return false;
}
inline bool bnb_outliers_tier(const float*, int64_t, const int64_t*, int64_t, const int8_t*, int64_t, const float*,
                              at::BFloat16*, int64_t) {
  return false;
}
constexpr int64_t kTierInt8MaxRows = 0;  // torch._int_mm serves every int8 product

inline void tier_int8_mm(const int8_t*, int64_t, const int8_t*, int64_t, int64_t, int32_t*) {}

inline void w4_quantize_row(const uint16_t*, int64_t, int64_t, const W4Acts&) {
  TORCH_CHECK(false, "int4_vnni_mm: built without AVX2");
}
inline void w4_rows(const W4Acts*, int64_t, int64_t, const uint8_t*, const uint16_t*, const at::BFloat16*, int64_t,
                    int64_t, at::BFloat16*, int64_t) {
  TORCH_CHECK(false, "int4_vnni_mm: built without AVX2");
}
