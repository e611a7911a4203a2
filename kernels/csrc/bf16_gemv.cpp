// y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias) in bf16 for a few rows of x (decode steps), with AVX512-BF16.
//
// At one to a few rows a linear is a pass over its weight: the time is the weight's bytes over the memory
// bandwidth, and oneDNN's bf16 matmul reads a weight at one row well below what a plain two-thread pass
// reads (docs/benchmarks.md, cpu_tiers). Each thread takes blocks of 64 output rows and streams R weight rows
// at a time, 32 bf16 per load, `vdpbf16ps`-ing them pairwise with x rows (four at a time; later passes over the
// same R weight rows find them in L1) into fp32 accumulators; a masked load takes the tail of K. Up to 12 x rows
// R is 1: the weight is read in memory order, one stream, which at hidden 768 (rows of 1.5 KB) reads faster
// than 4-16 rows interleaved (as many short streams); past that R is 4 and the sixteen sums of a 4 x 4
// tile are reduced at once by a shuffle tree, after one pass of plain loads over the block in memory order so
// that the interleaved rows come from cache (faster than R = 4 from memory at 9-16 rows: docs/benchmarks.md,
// decode_steps); the bias added in
// fp32, the result rounded to bf16 (round to nearest even), as the matmul does. Every output sums its products
// in the same order whatever R, so the choice changes speed, not results. The inner loops are a file per ISA
// tier (kernels/cpu_isa.py): bf16_gemv_avx512bf16.h as above, bf16_gemv_avx2.h (bf16 widened to fp32 by a shift,
// FMA, R = 1); without AVX2 `supported()` is false and the Python side falls back to F.linear.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>
#include "panels.h"
#include "row_tiles.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include "avx512_reduce.h"
#define SLUICE_GEMV_TIER "avx512_bf16"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_GEMV_TIER "avx2"
#endif

namespace {

#ifdef SLUICE_GEMV_TIER

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The tier's inner loops (`tile`, `touch`, `int8_tile`, kWideR), one file per tier, read into this namespace.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "bf16_gemv_avx512bf16.h"
#define SLUICE_PANELS
#include "bf16_panels.h"
#else
#include "bf16_gemv_avx2.h"
#endif

constexpr int64_t kBlock = 64;  // output rows a thread sums before writing them (a multiple of every R)

// Outputs [n0, n0 + rows) of every x row into sums [M, kBlock]: R weight rows at a time, x rows four at a time
// against them (every pass after the first finds the R weight rows in L1).
template <int R>
inline void block_rows(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t K, int64_t rows,
                       float* sums) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    sluice_row_tiles<4>(0, M, [&](auto t, int64_t m) {
      tile<decltype(t)::value, R>(x + m * ldx, ldx, w + r * K, K, sums + m * kBlock + r, kBlock);
    });
  }
  for (; r < rows; ++r)
    for (int64_t m = 0; m < M; ++m) tile<1, 1>(x + m * ldx, ldx, w + r * K, K, sums + m * kBlock + r, kBlock);
}

// Blocks of kBlock output rows across the threads: f(n0, rows, sums), sums a task's scratch [M, kBlock].
template <typename F>
void for_row_blocks(int64_t M, int64_t N, F&& f) {
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buffer(M * kBlock);
    for (int64_t b = b0; b < b1; ++b) f(b * kBlock, std::min(kBlock, N - b * kBlock), buffer.data());
  });
}

// From how many x rows the tier's widened-x tiles serve (a tier without them: never); settable for benchmarks and
// tests, which compare the two paths (the same bits either way).
int64_t wide_min_rows = kWideMinRows;
// From how many x rows the tier's `gemm` (bf16_gemm_avx2.h) takes a call (a tier without it: never); settable for
// benchmarks and tests, which compare it with the tiles. Below it the widened-x tiles are as fast or faster; from
// 12 rows the GEMM is 1.4x them on Zen 3 (bench/cpu_tiers.py --paths).
int64_t gemm_min_rows = kGemmMaxRows > 0 ? 12 : INT64_MAX;

#ifdef SLUICE_GEMV_WIDE_X
// Outputs [n0, n0 + rows) of every x row from x widened once (xw [M, K16]): x rows kWideM at a time, each tile's
// x staying in L1 while the block's weight rows (in L2 after the first tile) pass kWideR2 at a time.
inline void wide_block_rows(const float* xw, const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t K,
                            int64_t rows, float* sums) {
  const int64_t K16 = K / 16 * 16;
  sluice_row_tiles<kWideM>(0, M, [&](auto t, int64_t m) {
    constexpr int T = decltype(t)::value;
    int64_t r = 0;
    for (; r + kWideR2 <= rows; r += kWideR2)
      wide_tile<T, kWideR2>(xw + m * K16, x + m * ldx, ldx, w + r * K, K, sums + m * kBlock + r, kBlock);
    for (; r < rows; ++r) wide_tile<T, 1>(xw + m * K16, x + m * ldx, ldx, w + r * K, K, sums + m * kBlock + r, kBlock);
  });
}
#endif

void gemv(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t K, int64_t N, const uint16_t* bias,
          uint16_t* y) {
#ifdef SLUICE_GEMM
  if (M >= gemm_min_rows) return gemm(x, ldx, M, w, K, N, bias, y);
#endif
#ifdef SLUICE_GEMV_WIDE_X
  std::vector<float> xw;
  if (M >= wide_min_rows) {
    xw.resize(M * (K / 16 * 16));
    widen_x(x, ldx, M, K, xw.data());
  }
#endif
  for_row_blocks(M, N, [&](int64_t n0, int64_t rows, float* sums) {
    const uint16_t* wb = w + n0 * K;
#ifdef SLUICE_GEMV_WIDE_X
    if (M >= wide_min_rows) {
      wide_block_rows(xw.data(), x, ldx, M, wb, K, rows, sums);
    } else
#endif
    if (M <= 12 || kWideR == 1) {  // weight rows one by one, in memory order: a single stream the prefetcher runs ahead of
      block_rows<1>(x, ldx, M, wb, K, rows, sums);
    } else {  // 4 weight rows against 4 x rows (16 accumulators): each weight line serves more x rows
      touch(wb, rows * K);
      block_rows<kWideR>(x, ldx, M, wb, K, rows, sums);
    }
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t i = 0; i < rows; ++i) {
        float v = sums[m * kBlock + i];
        if (bias) v += bf16_to_float(bias[n0 + i]);
        y[m * N + n0 + i] = c10::BFloat16(v).x;  // round to nearest even
      }
    }
  });
}

void int8_gemv(const float* xf, int64_t M, const int8_t* w, int64_t K, int64_t N, const uint16_t* scale,
               uint16_t* y) {
  for_row_blocks(M, N, [&](int64_t n0, int64_t rows, float* sums) {
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* wr = w + (n0 + r) * K;
      sluice_row_tiles<4>(0, M, [&](auto t, int64_t m) {
        int8_tile<decltype(t)::value>(xf + m * K, K, wr, sums + m * kBlock + r, kBlock);
      });
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < rows; ++i)
        y[m * N + n0 + i] = c10::BFloat16(sums[m * kBlock + i] * bf16_to_float(scale[n0 + i])).x;
  });
}

#endif

bool supported() {
#ifdef SLUICE_GEMV_TIER
  return true;
#else
  return false;
#endif
}

torch::Tensor bf16_gemv(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(supported(), "bf16_gemv: built without AVX2 or AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "bf16_gemv: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16_gemv: bf16 only");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "bf16_gemv: x rows and the weight must be contiguous");
#ifdef SLUICE_GEMM
  const bool by_gemm = x.size(0) >= gemm_min_rows;  // the tier's GEMM takes any row count
#else
  const bool by_gemm = false;
#endif
  TORCH_CHECK(x.size(0) >= 1 && (x.size(0) <= 64 || by_gemm),
              "bf16_gemv: 1 to 64 rows, or more where the tier's GEMM takes them");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const uint16_t* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "bf16_gemv: bias bf16 [N]");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  auto y = torch::empty({M, N}, x.options());
#ifdef SLUICE_GEMV_TIER
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ldx = x.stride(0);
  gemv(xp, ldx, M, wp, K, N, b, yp);
#endif
  return y;
}

// y = x · Wᵀ (+ bias) from W packed by pack_panels (bf16_panels.h), any row count; W had out_features rows.
torch::Tensor panels_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(0) >= 1,
              "panels_linear: x bf16 [M, K], rows contiguous");
#ifdef SLUICE_PANELS
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && panels.dim() == 4 &&
              panels.size(0) == (N + kPanel - 1) / kPanel && panels.size(1) == (K + 1) / 2 && panels.size(2) == kPanel,
              "panels_linear: panels of a weight [out_features, K] (pack_panels)");
  const uint16_t* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "panels_linear: bias bf16 [N]");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  auto y = torch::empty({M, N}, x.options());
  panels_product(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M,
                 reinterpret_cast<const uint16_t*>(panels.data_ptr()), K, N, b, reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
#else
  TORCH_CHECK(false, "panels_linear: built without AVX512-BF16");
  return torch::Tensor();
#endif
}

torch::Tensor int8_gemv_op(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales) {
  TORCH_CHECK(supported(), "int8_gemv: built without AVX2 or AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && x.size(1) == qweight.size(1), "int8_gemv: x [M, K], qweight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && qweight.scalar_type() == at::kChar &&
              scales.scalar_type() == at::kBFloat16, "int8_gemv: bf16 x and scales, int8 weight");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && scales.numel() == qweight.size(0),
              "int8_gemv: contiguous weight, scales [N]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 64, "int8_gemv: 1 to 64 rows");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const torch::Tensor xf = x.to(at::kFloat).contiguous();  // exact: bf16 widens to fp32
  auto y = torch::empty({M, N}, x.options());
#ifdef SLUICE_GEMV_TIER
  int8_gemv(xf.data_ptr<float>(), M, qweight.data_ptr<int8_t>(), K, N,
            reinterpret_cast<const uint16_t*>(scales.data_ptr()), reinterpret_cast<uint16_t*>(y.data_ptr()));
#endif
  return y;
}

}  // namespace

// This file's Python functions, on the module `m` (its own library's, or cpu_kernels.cpp's submodule "bf16_gemv").
inline void bind_bf16_gemv(py::module_& m) {
  m.def("supported", &supported, "True when built for a tier with a GEMV (avx2 or avx512_bf16)");
  m.attr("TIER") =
#ifdef SLUICE_GEMV_TIER
      SLUICE_GEMV_TIER;
#else
      "none";
#endif
  m.attr("SUPPORTED") = supported();
#ifdef SLUICE_GEMV_TIER
  m.attr("WIDE_MIN_ROWS") = kWideMinRows;
  m.def("set_wide_min_rows", [](int64_t rows) { wide_min_rows = rows; },
        "From how many rows the tier's widened-x tiles serve (benchmarks and tests compare the paths)");
  m.attr("GEMM_MAX_ROWS") = kGemmMaxRows;
  m.attr("GEMM_MIN_ROWS") = gemm_min_rows;
  m.def("set_gemm_min_rows", [](int64_t rows) { gemm_min_rows = rows; },
        "From how many rows the tier's GEMM serves (benchmarks and tests compare it with the tiles)");
#else
  m.attr("WIDE_MIN_ROWS") = INT64_MAX;  // no widened-x tiles without a tier
  m.attr("GEMM_MAX_ROWS") = 0;
#endif
  m.def("bf16_gemv", &bf16_gemv, "x [M, K] (M <= 64; any M on the avx2 GEMM) · weight [N, K]ᵀ (+ bias) in bf16", py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none());
#ifdef SLUICE_PANELS
  m.attr("PANELS") = true;  // weights packed into panels (bf16_panels.h) serve every row count
  m.def("pack_panels", &pack_panels, "weight [N, K] bf16 packed into panels of 64 outputs in K pairs", py::arg("weight"));
#else
  m.attr("PANELS") = false;
#endif
  m.def("panels_linear", &panels_linear, "x [M, K] · W [N, K]ᵀ (+ bias) in bf16 from W's panels (pack_panels)",
        py::arg("x"), py::arg("panels"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("int8_gemv", &int8_gemv_op, "(x [M<=64, K] · qweight [N, K]ᵀ) * scales [N], int8 weights, bf16 x",
        py::arg("x"), py::arg("qweight"), py::arg("scales"));
}

#ifndef SLUICE_NO_MODULE  // built alone (decode_stack.cpp and cpu_kernels.cpp include it without its module)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bind_bf16_gemv(m); }
#endif
