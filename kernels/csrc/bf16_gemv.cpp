// y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias) in bf16 for a few rows of x (decode steps), with AVX512-BF16.
//
// At one to a few rows a linear is a pass over its weight: the time is the weight's bytes over the memory
// bandwidth. oneDNN's bf16 matmul reads a weight at ~16-28 GB/s at one row on this class of CPU, a plain
// two-thread pass reads ~35-47 GB/s. Here each thread takes blocks of 64 output rows and streams R weight rows
// at a time, 32 bf16 per load, `vdpbf16ps`-ing them pairwise with x rows (four at a time; later passes over the
// same R weight rows find them in L1) into fp32 accumulators; a masked load takes the tail of K. Up to 12 x rows
// R is 1: the weight is read in memory order, one stream, which at hidden 768 (rows of 1.5 KB) reads 1.1-1.5x
// faster than 4-16 rows interleaved (as many short streams); past that R is 4 and the sixteen sums of a 4 x 4
// tile are reduced at once by a shuffle tree, after one pass of plain loads over the block in memory order so
// that the interleaved rows come from cache (over a 125M model's 49 linears, against R = 4 from memory:
// 1.64/1.42/1.27x at 9/10/12 rows with R = 1, 1.28/1.23/1.25x at 13/14/16 with the pass); the bias added in
// fp32, the result rounded to bf16 (round to nearest even), as the matmul does. Every output sums its products
// in the same order whatever R, so the choice changes speed, not results. Built only where the compiler
// targets avx512_bf16 (`-march=native`); `supported()` says so, and the Python side falls back to F.linear.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include "avx512_reduce.h"
#define SLUICE_AVX512_BF16 1
#endif

namespace {

#ifdef SLUICE_AVX512_BF16

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Outputs [n, n + R) of M rows: out[m * ldo + r]. Every x row is loaded once per 32 columns of K, each weight
// row once and used at once (M x registers, M·R accumulators, one weight register).
template <int M, int R>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* out, int64_t ldo) {
  __m512 acc[M * R];
  for (int i = 0; i < M * R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], xv[m], wv);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ULL << (K - k)) - 1);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
      for (int m = 0; m < M; ++m) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], xv[m], wv);
    }
  }
  float sums[M * R];
  sluice_sums<M * R>(acc, sums);
  for (int i = 0; i < M * R; ++i) out[(i / R) * ldo + i % R] = sums[i];
}

// Reads n bf16 (a multiple of 32 or not: the tail is short of a load) in memory order, bringing them into cache.
inline void touch(const uint16_t* w, int64_t n) {
  __m512i any = _mm512_setzero_si512();
  for (int64_t i = 0; i + 32 <= n; i += 32) any = _mm512_or_si512(any, _mm512_loadu_si512(w + i));
  asm volatile("" : : "v"(any));  // the loads are the point: keep them
}

constexpr int64_t kBlock = 64;  // output rows a thread sums before writing them (a multiple of every R)

// Outputs [n0, n0 + rows) of every x row into sums [M, kBlock]: R weight rows at a time, x rows four at a time
// against them (every pass after the first finds the R weight rows in L1).
template <int R>
inline void block_rows(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t K, int64_t rows,
                       float* sums) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile<4, R>(x + m * ldx, ldx, w + r * K, K, sums + m * kBlock + r, kBlock);
    switch (M - m) {
      case 1: tile<1, R>(x + m * ldx, ldx, w + r * K, K, sums + m * kBlock + r, kBlock); break;
      case 2: tile<2, R>(x + m * ldx, ldx, w + r * K, K, sums + m * kBlock + r, kBlock); break;
      case 3: tile<3, R>(x + m * ldx, ldx, w + r * K, K, sums + m * kBlock + r, kBlock); break;
      default: break;
    }
  }
  for (; r < rows; ++r)
    for (int64_t m = 0; m < M; ++m) tile<1, 1>(x + m * ldx, ldx, w + r * K, K, sums + m * kBlock + r, kBlock);
}

void gemv(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t K, int64_t N, const uint16_t* bias,
          uint16_t* y) {
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buffer(M * kBlock);
    float* sums = buffer.data();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock, rows = std::min(kBlock, N - n0);
      const uint16_t* wb = w + n0 * K;
      if (M <= 12) {  // weight rows one by one, in memory order: a single stream the prefetcher runs ahead of
        block_rows<1>(x, ldx, M, wb, K, rows, sums);
      } else {  // 4 weight rows against 4 x rows (16 accumulators): each weight line serves more x rows
        touch(wb, rows * K);
        block_rows<4>(x, ldx, M, wb, K, rows, sums);
      }
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t i = 0; i < rows; ++i) {
          float v = sums[m * kBlock + i];
          if (bias) v += bf16_to_float(bias[n0 + i]);
          y[m * N + n0 + i] = c10::BFloat16(v).x;  // round to nearest even
        }
      }
    }
  });
}

// y[M, N] = (x[M, K] · Q[N, K]ᵀ) * scale[N] for int8 Q (int8 weight-only linears), as torch's
// _weight_int8pack_mm computes it (fp32 sums, the row scale after, one rounding to bf16) with the bf16 GEMV's
// order of reading: weight rows one by one in memory order, x rows four at a time, x converted to fp32 once.
// Four accumulators a row (64 columns a pass) keep the FMAs independent.
template <int M>
inline void int8_tile(const float* xf, int64_t K, const int8_t* w, float* out, int64_t ldo) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int j = 0; j < 4; ++j) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(w + k + 16 * j))));
      for (int m = 0; m < M; ++m) acc[m][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + m * K + k + 16 * j), wv, acc[m][j]);
    }
  }
  for (; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + k)));
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, xf + m * K + k), wv, acc[m][0]);
  }
  for (int m = 0; m < M; ++m)
    out[m * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                                      _mm512_add_ps(acc[m][2], acc[m][3])));
}

void int8_gemv(const float* xf, int64_t M, const int8_t* w, int64_t K, int64_t N, const uint16_t* scale,
               uint16_t* y) {
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buffer(M * kBlock);
    float* sums = buffer.data();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock, rows = std::min(kBlock, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* wr = w + (n0 + r) * K;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) int8_tile<4>(xf + m * K, K, wr, sums + m * kBlock + r, kBlock);
        switch (M - m) {
          case 1: int8_tile<1>(xf + m * K, K, wr, sums + m * kBlock + r, kBlock); break;
          case 2: int8_tile<2>(xf + m * K, K, wr, sums + m * kBlock + r, kBlock); break;
          case 3: int8_tile<3>(xf + m * K, K, wr, sums + m * kBlock + r, kBlock); break;
          default: break;
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < rows; ++i)
          y[m * N + n0 + i] = c10::BFloat16(sums[m * kBlock + i] * bf16_to_float(scale[n0 + i])).x;
    }
  });
}

#endif

bool supported() {
#ifdef SLUICE_AVX512_BF16
  return true;
#else
  return false;
#endif
}

torch::Tensor bf16_gemv(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(supported(), "bf16_gemv: built without avx512_bf16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "bf16_gemv: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16_gemv: bf16 only");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "bf16_gemv: x rows and the weight must be contiguous");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 64, "bf16_gemv: 1 to 64 rows");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const uint16_t* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "bf16_gemv: bias bf16 [N]");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  auto y = torch::empty({M, N}, x.options());
#ifdef SLUICE_AVX512_BF16
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ldx = x.stride(0);
  gemv(xp, ldx, M, wp, K, N, b, yp);
#endif
  return y;
}

torch::Tensor int8_gemv_op(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales) {
  TORCH_CHECK(supported(), "int8_gemv: built without avx512_bf16");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && x.size(1) == qweight.size(1), "int8_gemv: x [M, K], qweight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && qweight.scalar_type() == at::kChar &&
              scales.scalar_type() == at::kBFloat16, "int8_gemv: bf16 x and scales, int8 weight");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && scales.numel() == qweight.size(0),
              "int8_gemv: contiguous weight, scales [N]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 64, "int8_gemv: 1 to 64 rows");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const torch::Tensor xf = x.to(at::kFloat).contiguous();  // exact: bf16 widens to fp32
  auto y = torch::empty({M, N}, x.options());
#ifdef SLUICE_AVX512_BF16
  int8_gemv(xf.data_ptr<float>(), M, qweight.data_ptr<int8_t>(), K, N,
            reinterpret_cast<const uint16_t*>(scales.data_ptr()), reinterpret_cast<uint16_t*>(y.data_ptr()));
#endif
  return y;
}

}  // namespace

#ifndef SLUICE_NO_MODULE  // decode_stack.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "True when built with avx512_bf16");
  m.attr("SUPPORTED") = supported();  // read on every call from Python: an attribute, not a call
  m.def("bf16_gemv", &bf16_gemv, "x [M<=64, K] · weight [N, K]ᵀ (+ bias) in bf16", py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none());
  m.def("int8_gemv", &int8_gemv_op, "(x [M<=64, K] · qweight [N, K]ᵀ) * scales [N], int8 weights, bf16 x",
        py::arg("x"), py::arg("qweight"), py::arg("scales"));
}
#endif
