// What quant_linear.cpp asks of a tier without AVX512-VNNI (quant_linear_avx2.h, quant_linear_generic.h): the
// scalar paths serve (every `*_tier` hook declines, but the AVX2 tier's own int8 quantize and rescale), and
// the VNNI-only products refuse (their Python callers ask `VNNI` first). Included inside quant_linear.cpp's
// namespace.

constexpr bool kTierVnni = false;

template <typename T>
inline bool dequant_block64_tier(const Int4Layout&, int64_t, int64_t, int64_t, const float*, const float*, T*) {
  return false;
}
#if !defined(SLUICE_QUANT_AVX2)  // the AVX2 tier has its own (quant_linear_avx2.h)
inline bool quantize_rows_tier(const torch::Tensor&, int8_t*, float*) { return false; }
inline bool int8_rescale_tier(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                              const torch::Tensor&, torch::Tensor&) {
  return false;
}
#endif
inline bool bnb_int8_rows_tier(const torch::Tensor&, int8_t*, float*, int64_t) { return false; }
inline bool bnb_int8_act_tier(const torch::Tensor&, float, bool, int8_t*, float*, std::vector<uint16_t>&) {
  return false;
}
template <typename T>
inline int64_t bnb_4bit_codes_tier(const T*, int64_t, float, const float*, const uint8_t*, uint8_t*) { return 0; }

inline void vnni_mm(const int8_t*, int64_t, const int8_t*, int64_t, int64_t, int32_t*) {
  TORCH_CHECK(false, "built without avx512_vnni");
}

inline void w4_int8_mm(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                       const c10::optional<torch::Tensor>&, torch::Tensor&) {
  TORCH_CHECK(false, "built without avx512_vnni");
}
