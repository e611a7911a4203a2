// bitsandbytes' 4-bit weights (NF4 / FP4: blocks of 64 values along a row, an absmax per block) on CPU, read in
// bitsandbytes' own serialized layout, so loading keeps the checkpoint's bytes: codes [N, K / 2] uint8, two a byte,
// the even column in the high nibble; absmax [N, K / 64] bf16; the code table (quant_map, 16 fp32 values). A
// weight is w[n, k] = table[code] * absmax[n, k / 64] (fp32, as bitsandbytes dequantizes it).
//
// The GEMV (any row count, x rows in passes of the tier's tile) is the tier's product (nf4_avx512.h, nf4_avx2.h, nf4_generic.h): x converted once a call
// to fp32 in the tier's chunk order (per chunk of C columns the even columns, then the odd ones: the order a
// chunk's bytes unpack in, high nibbles then low), each weight block's table scaled by its absmax, every code
// looked up in it (`vpermps`) and multiplied into fp32 sums with every x row. The tiles (kernels/nf4.py says from
// how many rows) dequantize each tile of weight rows to x's dtype (rounded once from the fp32 value) and multiply
// it with at::mm (oneDNN), as quant_linear.cpp's int4 tiles do.
#pragma once
#include "cpu_capability.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kNf4Block = 64;

inline float bf16_to_float(at::BFloat16 v) { return static_cast<float>(v); }

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#include "nf4_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "nf4_avx2.h"
#else
#include "nf4_generic.h"
#endif

namespace {

struct Nf4Weight {
  const uint8_t* codes;
  const at::BFloat16* absmax;
  int64_t N, K;
};

Nf4Weight checked(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& table, int64_t K) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2, "codes [N, K / 2] uint8");
  TORCH_CHECK(absmax.scalar_type() == at::kBFloat16 && absmax.is_contiguous(), "absmax [N, K / 64] bf16");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.numel() == 16 && table.is_contiguous(), "16 fp32 codes");
  TORCH_CHECK(K % kNf4Block == 0 && codes.size(1) * 2 == K, "K must be a multiple of 64 and match the codes");
  TORCH_CHECK(absmax.numel() == codes.size(0) * (K / kNf4Block), "absmax must hold one value per block of 64");
  return {codes.data_ptr<uint8_t>(), absmax.data_ptr<at::BFloat16>(), codes.size(0), K};
}

// x [M, K] -> fp32 in the tier's chunk order (per kNf4Chunk columns: the even ones, then the odd ones).
template <typename T>
std::vector<float> chunk_order(const T* x, int64_t M, int64_t K) {
  std::vector<float> xp(M * K);
  constexpr int64_t half = kNf4Chunk / 2;
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * K;
    float* out = xp.data() + m * K;
    for (int64_t c = 0; c < K; c += kNf4Chunk) {
      for (int64_t i = 0; i < half; ++i) {
        out[c + i] = static_cast<float>(row[c + 2 * i]);
        out[c + half + i] = static_cast<float>(row[c + 2 * i + 1]);
      }
    }
  }
  return xp;
}

// Weight rows [n0, n1) against the MT rows of xp: y[m, n] (+ bias) in T. Blocks of kRowBlock weight rows, each
// swept in column slices whose MT x rows (fp32) fit the L1 cache, R weight rows at a time: every x slice is read
// from L1 by the rows of its block instead of from L2 by every row.
template <int MT, typename T>
void gemv_rows(const Nf4Weight& W, const float* table, const float* xp, const T* bias, int64_t n0, int64_t n1,
               T* y) {
  constexpr int R = nf4_rows_for<MT>();
  constexpr int64_t kRowBlock = 64;
  const int64_t slice = std::max<int64_t>(kNf4Block, std::min<int64_t>(W.K, (8192 / MT) / kNf4Block * kNf4Block));
  const int64_t kb = W.K / kNf4Block;
  float acc[MT * kRowBlock];
  for (int64_t nb = n0; nb < n1; nb += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, n1 - nb);
    std::fill(acc, acc + MT * kRowBlock, 0.f);
    for (int64_t k = 0; k < W.K; k += slice) {
      const int64_t len = std::min(slice, W.K - k);
      auto dots = [&](auto r_tile, int64_t n) {
        constexpr int RT = decltype(r_tile)::value;
        nf4_dots<RT, MT>(W.codes + n * W.K / 2 + k / 2, W.K / 2, W.absmax + n * kb + k / kNf4Block, kb, table, xp + k,
                         W.K, len, acc + (n - nb), kRowBlock);
      };
      int64_t n = nb;
      for (; n + R <= nb + rows; n += R) dots(std::integral_constant<int, R>{}, n);
      for (; n < nb + rows; ++n) dots(std::integral_constant<int, 1>{}, n);
    }
    for (int m = 0; m < MT; ++m)
      for (int64_t r = 0; r < rows; ++r) {
        const float b = bias ? static_cast<float>(bias[nb + r]) : 0.f;
        y[m * W.N + nb + r] = static_cast<T>(acc[m * kRowBlock + r] + b);
      }
  }
}

template <int MT, typename T>
void gemv(const Nf4Weight& W, const float* table, const float* xp, const T* bias, T* y) {
  const int64_t grain = std::max<int64_t>(16, 4096 * 64 / W.K);
  at::parallel_for(0, W.N, grain, [&](int64_t n0, int64_t n1) { gemv_rows<MT, T>(W, table, xp, bias, n0, n1, y); });
}

template <typename T, int MT = 1>
void gemv_tile(int64_t M, const Nf4Weight& W, const float* table, const float* xp, const T* bias, T* y) {
  if constexpr (MT <= kNf4MaxTileRows) {
    if (M == MT) return gemv<MT, T>(W, table, xp, bias, y);
    gemv_tile<T, MT + 1>(M, W, table, xp, bias, y);
  }
}

// x rows in tiles of at most kNf4MaxTileRows (the most whose sums stay in registers), each a pass over the weight.
template <typename T>
void gemv_dispatch(int64_t M, const Nf4Weight& W, const float* table, const float* xp, const T* bias, T* y) {
  for (int64_t m = 0; m < M; m += kNf4MaxTileRows) {
    const int64_t rows = std::min<int64_t>(kNf4MaxTileRows, M - m);
    gemv_tile<T>(rows, W, table, xp + m * W.K, bias, y + m * W.N);
  }
}

// Weight rows [n0, n0 + rows) dequantized into out [rows, K] (T: float or bf16 rounded once; other types through
// fp32).
template <typename T>
void dequant_rows(const Nf4Weight& W, const float* table, int64_t n0, int64_t rows, T* out) {
  const int64_t kb = W.K / kNf4Block;
  std::vector<float> tmp;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* codes = W.codes + (n0 + r) * W.K / 2;
    const at::BFloat16* am = W.absmax + (n0 + r) * kb;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
      nf4_dequant_row(codes, am, table, W.K, out + r * W.K);
    } else {
      tmp.resize(W.K);
      nf4_dequant_row(codes, am, table, W.K, tmp.data());
      for (int64_t k = 0; k < W.K; ++k) out[r * W.K + k] = static_cast<T>(tmp[k]);
    }
  }
}

}  // namespace

// x [M, K] times the 4-bit weight [N, K], plus bias -> [M, N] in x's dtype.
torch::Tensor nf4_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor absmax, torch::Tensor table,
                       c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1, "x [M, K], M >= 1");
  const Nf4Weight W = checked(codes, absmax, table, x.size(1));
  const int64_t M = x.size(0);
  auto y = torch::empty({M, W.N}, x.options());
  torch::Tensor b = bias.has_value() ? bias->contiguous().to(x.scalar_type()) : torch::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "nf4_gemv", [&] {
    const std::vector<float> xp = chunk_order(x.data_ptr<scalar_t>(), M, W.K);
    const scalar_t* bp = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    gemv_dispatch<scalar_t>(M, W, table.data_ptr<float>(), xp.data(), bp, y.data_ptr<scalar_t>());
  });
  return y;
}

// x [M, K] times the 4-bit weight, tile by tile: each tile of weight rows (at most tile_bytes) dequantized to x's
// dtype by every thread into one scratch kept between calls, then multiplied by at::mm (oneDNN, its own threads)
// into its output columns, from this thread; plus bias.
torch::Tensor nf4_tile_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor absmax, torch::Tensor table,
                          c10::optional<torch::Tensor> bias, int64_t tile_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [M, K] must be contiguous");
  const Nf4Weight W = checked(codes, absmax, table, x.size(1));
  auto y = torch::empty({x.size(0), W.N}, x.options());
  const int64_t per_tile = std::max<int64_t>(1, std::min(W.N, tile_bytes / (W.K * x.element_size())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "nf4_tile_mm", [&] {
    static std::vector<scalar_t> scratch;  // kept between calls: no page faults, no zeroing
    if (scratch.size() < static_cast<size_t>(W.K * per_tile)) scratch.resize(W.K * per_tile);
    for (int64_t n0 = 0; n0 < W.N; n0 += per_tile) {
      const int64_t rows = std::min(per_tile, W.N - n0);
      at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
        dequant_rows<scalar_t>(W, table.data_ptr<float>(), n0 + r0, r1 - r0, scratch.data() + r0 * W.K);
      });
      auto w = torch::from_blob(scratch.data(), {rows, W.K}, x.options());
      auto out = y.narrow(1, n0, rows);
      at::mm_out(out, x, w.t());
    }
  });
  if (bias.has_value()) y.add_(bias->to(x.scalar_type()));
  return y;
}

// Weight rows [n0, n1) dequantized to `dtype` [n1 - n0, K] (the tiles' values: for tests and the reference).
torch::Tensor nf4_dequant(torch::Tensor codes, torch::Tensor absmax, torch::Tensor table, int64_t n0, int64_t n1,
                          at::ScalarType dtype) {
  const Nf4Weight W = checked(codes, absmax, table, codes.size(1) * 2);
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= W.N, "rows out of range");
  auto out = torch::empty({n1 - n0, W.K}, codes.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "nf4_dequant", [&] {
    dequant_rows<scalar_t>(W, table.data_ptr<float>(), n0, n1 - n0, out.data_ptr<scalar_t>());
  });
  return out;
}

// This file's Python functions, on the module `m` (its own library's, or cpu_kernels.cpp's submodule "nf4").
inline void bind_nf4(py::module_& m) {
  m.def("nf4_gemv", &nf4_gemv, "x times a bitsandbytes 4-bit weight, x rows a few at a time (CPU)", py::arg("x"),
        py::arg("codes"), py::arg("absmax"), py::arg("table"), py::arg("bias") = py::none());
  m.def("nf4_tile_mm", &nf4_tile_mm, "x times a bitsandbytes 4-bit weight dequantized tile by tile (CPU)",
        py::arg("x"), py::arg("codes"), py::arg("absmax"), py::arg("table"), py::arg("bias") = py::none(),
        py::arg("tile_bytes") = 4 << 20);
  m.def("nf4_dequant", &nf4_dequant, "rows of a bitsandbytes 4-bit weight dequantized (CPU)");
  m.attr("TIER") = kNf4Tier;
}

#ifndef SLUICE_NO_MODULE  // built alone (decode_stack.cpp and cpu_kernels.cpp include it without its module)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bind_nf4(m); }
#endif
