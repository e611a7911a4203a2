// The AVX2 tier of quant_linear.cpp (avx2, and avx512 on CPUs without VNNI): our exact int8 x int8 product
// (int8_mm_avx2.h; oneDNN's saturates without VNNI) at every row count, the int8 x int4 product (w4a8_avx2.h) and
// LLM.int8()'s bf16 epilogue 8 lanes at a time (bnb_epilogue_avx2.h); the rest is quant_linear.cpp's scalar
// code. Included inside its namespace.
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
