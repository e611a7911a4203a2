// Weight-only quantized linears on CPU: the int4 tile-dequant matmul and the int8 dynamic-activation helpers.
//
// int4: the codes stay in torch's `_convert_weight_to_int4pack_for_cpu` layout (blocks of `block_n` output rows;
// a full block stores, per input column k, block_n / 2 bytes whose byte j holds row j (low nibble) and row
// j + block_n / 2 (high nibble); a shorter tail block stores rows 2i and 2i + 1 in byte i; `split` false means
// every block is stored in pairs). Each thread takes a run of output tiles, dequantizes a tile, w = (q - 8) *
// scale + zero in fp32 rounded to x's dtype, into a [K, tile] scratch that stays in its L2 and multiplies it
// with at::mm (oneDNN) straight into the output columns. Tiles of a few MB (L3): each at::mm call has a fixed
// cost, so L2-sized tiles spend more in calls than they save in cache misses.
//
// int8: per-row absmax quantization of the activations in one pass over each row, and the epilogue of
// `torch._int_mm` (int32 * row scale * column scale, cast, plus bias), rounding exactly as the torch ops did; the
// int8 matmul itself (`int8_mm`), exact int32 sums, by the tier's kernel (quant_linear_avx512.h: VNNI;
// int8_mm_avx2.h) where it serves, else torch._int_mm. int4 in our own layout (w4a8.h): the int8 x int4 product.
//
// The tiers are files: quant_linear_avx512.h (AVX512-VNNI, with w4a8_avx512.h), quant_linear_avx2.h (with
// int8_mm_avx2.h and w4a8_avx2.h), quant_linear_generic.h; each gives the `*_tier` hooks that this file's scalar
// code asks first, the tier's products, and its constants (kTierVnni, kTierW4A8, kTierInt8MaxRows).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__BMI2__)
#include <immintrin.h>
#include "avx512_reduce.h"
#define SLUICE_QUANT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_QUANT_AVX2 1
#endif
#include "panels.h"
#include "row_tiles.h"

std::vector<torch::Tensor> quantize_rows(torch::Tensor x);

namespace {

struct Int4Layout {
  const uint8_t* packed;
  int64_t K, block_n, n_padded;
  bool split;
};

// Codes of output rows [n0, n0 + rows) (inside one block) at column k, as q - 8 in dst[0..rows).
inline void block_codes(const Int4Layout& L, int64_t n0, int64_t rows, int64_t k, int32_t* dst) {
  const int64_t nb = n0 / L.block_n, first = nb * L.block_n;
  const int64_t size = std::min(L.block_n, L.n_padded - first);
  const uint8_t* col = L.packed + first * L.K / 2 + k * size / 2;
  const bool split = L.split && size == L.block_n;
  for (int64_t r = n0 - first; r < n0 - first + rows; ++r) {
    const int64_t half = L.block_n / 2;
    const uint8_t byte = split ? col[r % half] : col[r / 2];
    const bool high = split ? r >= half : (r & 1);
    *dst++ = (high ? byte >> 4 : byte & 15) - 8;
  }
}

// 127.0 / SCB as torch computes it (t.reciprocal() * 127), each step a volatile read: under this file's
// fast-math flags the compiler folds 127 * (1 / SCB) into 127 / SCB, which rounds differently (a factor one ulp
// higher: products of 63.499996 become 63.5, codes 63 become 64).
inline float bnb_factor(float amax) {
  const volatile float r = 1.f / amax;
  const volatile float f = 127.f * r;
  return f;
}

// Rows our int8 VNNI kernel takes: measured against oneDNN's (torch._int_mm) streaming a 125M model's int8
// weights, faster at 1-64 rows (docs/benchmarks.md, decode_steps); above, a GEMM's blocking (oneDNN) wins.
constexpr int64_t kVnniMaxRows = 64;

#include "w4a8.h"
#if defined(SLUICE_QUANT_AVX512)
#include "quant_linear_avx512.h"
#define SLUICE_INT8_PANELS 1
#include "int8_panels.h"
#elif defined(SLUICE_QUANT_AVX2)
#include "quant_linear_avx2.h"
#else
#include "quant_linear_generic.h"
#endif

// Fill scratch [K, cols] (row-major) with the dequantized weight rows [n0, n0 + cols), transposed.
template <typename T>
void dequant_tile(const Int4Layout& L, const T* sz, int64_t group, int64_t n0, int64_t cols, T* scratch) {
  std::vector<int32_t> q(L.block_n);
  std::vector<float> scale(L.block_n), zero(L.block_n);
  for (int64_t b0 = n0; b0 < n0 + cols; b0 += L.block_n) {
    const int64_t rows = std::min(L.block_n - b0 % L.block_n, n0 + cols - b0);
    for (int64_t k = 0; k < L.K; ++k) {
      if (k % group == 0) {
        const T* g = sz + ((k / group) * L.n_padded + b0) * 2;
        for (int64_t r = 0; r < rows; ++r) {
          scale[r] = static_cast<float>(g[2 * r]);
          zero[r] = static_cast<float>(g[2 * r + 1]);
        }
      }
      T* out = scratch + k * cols + (b0 - n0);
      if (dequant_block64_tier(L, b0, rows, k, scale.data(), zero.data(), out)) continue;
      block_codes(L, b0, rows, k, q.data());
      for (int64_t r = 0; r < rows; ++r) out[r] = static_cast<T>(std::fma(static_cast<float>(q[r]), scale[r], zero[r]));
    }
  }
}

}  // namespace

// x [M, K] times the int4 weight (n_out rows of n_padded) -> [M, n_out] in x's dtype.
torch::Tensor int4_tile_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros, int64_t group,
                           int64_t n_out, int64_t block_n, bool split, int64_t scratch_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous() && scales_zeros.is_contiguous(),
              "x [M, K], packed and scales_zeros must be contiguous");
  TORCH_CHECK(scales_zeros.scalar_type() == x.scalar_type(), "scales_zeros must be in x's dtype");
  const int64_t M = x.size(0), K = x.size(1), n_padded = scales_zeros.size(1);
  TORCH_CHECK(K % group == 0 && scales_zeros.size(0) == K / group && packed.numel() * 2 == n_padded * K,
              "packed codes and scales_zeros do not match x");
  TORCH_CHECK(n_padded % 16 == 0 && block_n % 16 == 0 && n_out <= n_padded, "bad int4 layout");
  auto y = torch::empty({M, n_out}, x.options());
  const Int4Layout L{packed.data_ptr<uint8_t>(), K, block_n, n_padded, split};
  // tiles of at most scratch_bytes, a multiple of the thread count so that every thread gets the same work
  const int64_t threads = at::get_num_threads(), blocks = (n_out + block_n - 1) / block_n;
  const int64_t wanted = (n_out * K * x.element_size() + scratch_bytes - 1) / scratch_bytes;
  const int64_t tiles_wanted = std::min(blocks, (wanted + threads - 1) / threads * threads);
  const int64_t per_tile = (blocks + tiles_wanted - 1) / tiles_wanted * block_n;
  const int64_t tiles = (n_out + per_tile - 1) / per_tile;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int4_tile_mm", [&] {
    const scalar_t* sz = scales_zeros.data_ptr<scalar_t>();
    const bool inference = c10::InferenceMode::is_enabled();  // worker threads do not inherit it
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      c10::InferenceMode guard(inference);
      static thread_local std::vector<scalar_t> scratch;  // kept between calls: no page faults, no zeroing
      if (scratch.size() < static_cast<size_t>(K * per_tile)) scratch.resize(K * per_tile);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * per_tile, cols = std::min(per_tile, n_out - n0);
        dequant_tile<scalar_t>(L, sz, group, n0, cols, scratch.data());
        auto w = torch::from_blob(scratch.data(), {K, cols}, x.options());
        auto out = y.narrow(1, n0, cols);
        at::mm_out(out, x, w);
      }
    });
  });
  return y;
}

// The codes q - 8 [n_out, K] (int32) as the tile kernel reads them: checks a layout against known codes.
torch::Tensor int4_codes(torch::Tensor packed, int64_t K, int64_t n_padded, int64_t block_n, bool split) {
  auto out = torch::empty({n_padded, K}, torch::kInt32);
  const Int4Layout L{packed.contiguous().data_ptr<uint8_t>(), K, block_n, n_padded, split};
  std::vector<int32_t> q(block_n);
  for (int64_t b0 = 0; b0 < n_padded; b0 += block_n) {
    const int64_t rows = std::min(block_n, n_padded - b0);
    for (int64_t k = 0; k < K; ++k) {
      block_codes(L, b0, rows, k, q.data());
      for (int64_t r = 0; r < rows; ++r) out[b0 + r][k] = q[r];
    }
  }
  return out;
}


// rows [M, K] -> (int8 codes [M, K], fp32 scales [M, 1]): absmax / 127 per row (at least 1e-12 / 127).
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [M, K] must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({M, 1}, x.options().dtype(torch::kFloat32));
  int8_t* q = xq.data_ptr<int8_t>();
  float* s = scale.data_ptr<float>();
  if (quantize_rows_tier(x, q, s)) return {xq, scale};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / K), [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      for (int64_t m = begin; m < end; ++m) {
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) {
          row[k] = static_cast<float>(src[m * K + k]);
          amax = std::max(amax, std::abs(row[k]));
        }
        const float sc = std::max(amax, 1e-12f) / 127.f;
        s[m] = sc;
        int8_t* qm = q + m * K;
        for (int64_t k = 0; k < K; ++k) qm[k] = static_cast<int8_t>(std::nearbyint(row[k] / sc));
      }
    });
  });
  return {xq, scale};
}


// Weight rows [N, K] quantized exactly as bitsandbytes' int8_vectorwise_quant quantizes an fp16 copy of them
// (threshold 0, what a Linear8bitLt gets when it quantizes while loading): each value rounded to fp16 and back,
// SCB = the row's absmax of those (fp32), codes round(v * bnb_factor(SCB)) to nearest even (an fp16 inf makes the
// row's codes 0, as torch's cast of their NaN products does here). One pass per row where bitsandbytes' torch
// ops make seven over the whole weight (in fp16, which this CPU only converts; docs/benchmarks.md,
// coldstart). Finite weights.
std::vector<torch::Tensor> bnb_int8_rows(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "bnb_int8_rows: a contiguous CPU [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  auto cb = torch::empty({N, K}, w.options().dtype(torch::kInt8));
  auto scb = torch::empty({N}, w.options().dtype(torch::kFloat32));
  int8_t* q = cb.data_ptr<int8_t>();
  float* s = scb.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, K));
  if (bnb_int8_rows_tier(w, q, s, grain)) return {cb, scb};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "bnb_int8_rows", [&] {
    const scalar_t* src = w.data_ptr<scalar_t>();
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      for (int64_t n = begin; n < end; ++n) {
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) {
          row[k] = static_cast<float>(static_cast<at::Half>(static_cast<float>(src[n * K + k])));
          amax = std::max(amax, std::abs(row[k]));
        }
        s[n] = amax;
        const float f = bnb_factor(amax);
        for (int64_t k = 0; k < K; ++k) {
          const float v = std::nearbyint(row[k] * f);
          q[n * K + k] = std::isnan(v) ? 0 : static_cast<int8_t>(v);
        }
      }
    });
  });
  return {cb, scb};
}


// Activation rows [M, K] quantized exactly as bitsandbytes' int8_vectorwise_quant(x.half(), threshold) (LLM.int8()):
// each value rounded to fp16 and back; with threshold > 0, values whose magnitude reaches it (compared in fp16)
// are outliers, zeroed before the row's absmax and coded 0, and where M > 1 every column holding one codes 0 in
// every row; codes round(v * bnb_factor(absmax)) to nearest even (0 where that is NaN). Returns (codes int8
// [M, K], row absmax fp32 [M], the outlier columns int64 ascending, empty where none or threshold is 0).
std::vector<torch::Tensor> bnb_int8_act(torch::Tensor x, double threshold) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "bnb_int8_act: a contiguous CPU [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  auto cb = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto scb = torch::empty({M}, x.options().dtype(torch::kFloat32));
  const float thr = threshold > 0 ? static_cast<float>(static_cast<at::Half>(static_cast<float>(threshold))) : 0.f;
  std::vector<uint16_t> cols((K + 15) / 16, 0);  // a bit per outlier column
  int8_t* q = cb.data_ptr<int8_t>();
  float* s = scb.data_ptr<float>();
  if (!bnb_int8_act_tier(x, thr, M > 1, q, s, cols)) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bnb_int8_act", [&] {
      const scalar_t* src = x.data_ptr<scalar_t>();
      auto half = [&](int64_t i) { return static_cast<float>(static_cast<at::Half>(static_cast<float>(src[i]))); };
      auto outlier = [&](float v) { return thr > 0.f && std::abs(v) >= thr; };
      for (int64_t i = 0; i < M * K; ++i)
        if (outlier(half(i))) cols[(i % K) / 16] |= static_cast<uint16_t>(1u << (i % K % 16));
      for (int64_t m = 0; m < M; ++m) {
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, outlier(half(m * K + k)) ? 0.f : std::abs(half(m * K + k)));
        s[m] = amax;
        const float f = bnb_factor(amax);
        for (int64_t k = 0; k < K; ++k) {
          const float h = half(m * K + k);
          const float v = std::nearbyint((outlier(h) ? 0.f : h) * f);
          const bool col = M > 1 && (cols[k / 16] >> (k % 16) & 1);
          q[m * K + k] = std::isnan(v) || col ? 0 : static_cast<int8_t>(v);
        }
      }
    });
  }
  std::vector<int64_t> idx;
  for (int64_t k = 0; k < K; ++k)
    if (cols[k / 16] >> (k % 16) & 1) idx.push_back(k);
  auto out = torch::empty({static_cast<int64_t>(idx.size())}, x.options().dtype(torch::kInt64));
  std::copy(idx.begin(), idx.end(), out.data_ptr<int64_t>());
  return {cb, scb, out};
}

// bitsandbytes' int8_mm_dequant of acc [M, N] int32 with row absmax [M] and SCB [N] (fp32), plus bias, into bf16,
// bit for bit (the tier's lanes); None where the tier has no such pass (the caller runs bitsandbytes' torch ops).
c10::optional<torch::Tensor> bnb_int8_dequant(torch::Tensor acc, torch::Tensor row, torch::Tensor col,
                                              c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kInt, "acc: contiguous int32 [M, N]");
  TORCH_CHECK(row.numel() == acc.size(0) && col.numel() == acc.size(1) && row.scalar_type() == at::kFloat &&
              col.scalar_type() == at::kFloat, "bnb_int8_dequant: fp32 row [M] and col [N] scales");
  auto r = row.contiguous(), c = col.contiguous();
  torch::Tensor b = bias.has_value() ? bias->contiguous().to(at::kBFloat16) : torch::Tensor();
  auto y = torch::empty(acc.sizes(), acc.options().dtype(at::kBFloat16));
  if (!bnb_dequant_tier(acc, r.data_ptr<float>(), c.data_ptr<float>(),
                        b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, y))
    return c10::nullopt;
  return y;
}

// LLM.int8()'s outlier columns (cols int64, from bnb_int8_act) of x [M, K] (bf16) times cb's same columns
// dequantized (cb int8 [N, K], scb fp32 [N]; as bitsandbytes' int8_vectorwise_dequant, rounded to bf16) added to
// out [M, N] (bf16, in place): the products summed in fp32 in column order, added to out in fp32, rounded once;
// false where the tier has no such pass (the caller adds them with torch ops).
bool bnb_int8_outliers(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& cols, const torch::Tensor& cb,
                       const torch::Tensor& scb) {
  TORCH_CHECK(x.dim() == 2 && cb.dim() == 2 && x.size(1) == cb.size(1) && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == cb.size(0) && scb.numel() == cb.size(0),
              "bnb_int8_outliers: out [M, N], x [M, K], cb [N, K], scb [N]");
  if (x.scalar_type() != at::kBFloat16 || out.scalar_type() != at::kBFloat16 || !x.is_contiguous() ||
      !out.is_contiguous() || cb.scalar_type() != at::kChar || !cb.is_contiguous() ||
      scb.scalar_type() != at::kFloat || !scb.is_contiguous() || cols.scalar_type() != at::kLong ||
      !cols.is_contiguous() || !x.device().is_cpu())
    return false;
  const int64_t M = x.size(0), K = x.size(1), C = cols.numel();
  if (C == 0) return true;  // nothing to add
  if (!kTierBnbEpilogue) return false;
  std::vector<float> xs(M * C);  // the outlier inputs, [M, C] in fp32 (exact): read once a column per row
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const int64_t* cp = cols.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < C; ++k) xs[m * C + k] = static_cast<float>(xp[m * K + cp[k]]);
  return bnb_outliers_tier(xs.data(), M, cp, C, cb.data_ptr<int8_t>(), K, scb.data_ptr<float>(),
                           out.data_ptr<at::BFloat16>(), out.size(1));
}

// Whether this tier has bitsandbytes' int8 epilogue passes (bnb_int8_dequant, bnb_int8_outliers) for bf16: AVX2 and
// up.
bool bnb_int8_epilogue_supported() { return kTierBnbEpilogue; }

// x (flattened) in blocks of `blocksize` values (the last may be short) quantized to 4-bit codes exactly as
// bitsandbytes' default quantize_4bit does with torch ops: a full block's values times the reciprocal of its
// absmax (at least 1e-38), a short last block's divided by its absmax, clamped to [-1, 1]; the code is the number
// of `bounds` (the 15 midpoints between the sorted NF4/FP4 levels) below the value, mapped through `order` where
// given (FP4); two codes a byte, the first in the high nibble (an odd count padded with the code of 0). Returns
// (packed uint8 [(n + 1) / 2], absmax fp32: each full block's own, the short block's clamped). Finite values.
std::vector<torch::Tensor> bnb_4bit_blocks(torch::Tensor x, int64_t blocksize, torch::Tensor bounds,
                                           c10::optional<torch::Tensor> order) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && blocksize > 0 && blocksize % 2 == 0, "bnb_4bit_blocks");
  TORCH_CHECK(bounds.scalar_type() == at::kFloat && bounds.numel() == 15 && bounds.is_contiguous(), "15 fp32 bounds");
  const int64_t n = x.numel(), rem = n % blocksize, full = n - rem, blocks = full / blocksize;
  auto packed = torch::empty({(n + 1) / 2}, x.options().dtype(torch::kUInt8));
  auto absmax = torch::empty({blocks + (rem ? 1 : 0)}, x.options().dtype(torch::kFloat32));
  float bnd[15];
  std::memcpy(bnd, bounds.data_ptr<float>(), sizeof(bnd));
  uint8_t map[16];
  for (int i = 0; i < 16; ++i) map[i] = order.has_value() ? static_cast<uint8_t>(order->data_ptr<int64_t>()[i]) : i;
  auto code = [&](float v) {
    v = std::min(1.f, std::max(-1.f, v));
    int c = 0;
    for (int i = 0; i < 15; ++i) c += bnd[i] < v;
    return map[c];
  };
  const uint8_t pad = code(0.f);  // an odd count's last low nibble
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* am = absmax.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bnb_4bit_blocks", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const int64_t tasks = blocks + (rem ? 1 : 0);
    at::parallel_for(0, tasks, std::max<int64_t>(1, 65536 / blocksize), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = b * blocksize, len = b < blocks ? blocksize : rem;
        const scalar_t* v = src + start;
        float top = 0.f;
        for (int64_t j = 0; j < len; ++j) top = std::max(top, std::abs(static_cast<float>(v[j])));
        float scale = std::max(top, 1e-38f);
        if (b < blocks) {  // times the reciprocal (torch's 1.0 / t), kept from being folded into a division
          const volatile float reciprocal = 1.f / scale;
          scale = reciprocal;
        }
        am[b] = b < blocks ? top : scale;
        int64_t j = 0;
        if (b < blocks) j = bnb_4bit_codes_tier(v, len, scale, bnd, map, out + start / 2);
        auto scaled = [&](int64_t i) {
          const float f = static_cast<float>(v[i]);
          return b < blocks ? f * scale : f / scale;
        };
        for (; j < len; j += 2) {
          const uint8_t lo = j + 1 < len ? code(scaled(j + 1)) : pad;
          out[(start + j) / 2] = static_cast<uint8_t>((code(scaled(j)) << 4) | lo);
        }
      }
    });
  });
  return {packed, absmax};
}

// acc [M, N] int32 * row_scale [M, 1] * col_scale [N] -> dtype of col_scale, then + bias (rounded as torch's add).
torch::Tensor int8_rescale(torch::Tensor acc, torch::Tensor row_scale, torch::Tensor col_scale,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && col_scale.is_contiguous(), "acc [M, N] must be contiguous");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(col_scale.numel() == N && row_scale.numel() == M, "scales must match acc");
  auto y = torch::empty({M, N}, acc.options().dtype(col_scale.scalar_type()));
  auto rs = row_scale.contiguous();
  torch::Tensor b = bias.has_value() ? bias->contiguous().to(col_scale.scalar_type()) : torch::Tensor();
  if (int8_rescale_tier(acc, rs, col_scale, b, y)) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, col_scale.scalar_type(), "int8_rescale", [&] {
    const int32_t* a = acc.data_ptr<int32_t>();
    const float* r = rs.data_ptr<float>();
    const scalar_t* cs = col_scale.data_ptr<scalar_t>();
    const scalar_t* bp = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    scalar_t* out = y.data_ptr<scalar_t>();
    at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / N), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const int32_t* am = a + m * N;
        scalar_t* om = out + m * N;
        const float rm = r[m];
        for (int64_t n = 0; n < N; ++n) {  // (acc * row) * col, in that order: the fast-math flags may reassociate
          float v = static_cast<float>(am[n]) * rm;
          asm("" : "+x"(v));
          om[n] = static_cast<scalar_t>(v * static_cast<float>(cs[n]));
        }
        if (bp != nullptr)
          for (int64_t n = 0; n < N; ++n) om[n] = static_cast<scalar_t>(static_cast<float>(om[n]) + static_cast<float>(bp[n]));
      }
    });
  });
  return y;
}




bool w4a8_supported() { return kTierW4A8; }  // int4_vnni_mm: AVX512-VNNI or AVX2

bool vnni_supported() { return kTierVnni; }

// Whether our int8 products take x [M, K] and w [N, K]: contiguous CPU int8, the same K.
bool int8_operands(const torch::Tensor& x, const torch::Tensor& w) {
  return x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.scalar_type() == at::kChar &&
         w.scalar_type() == at::kChar && x.is_contiguous() && w.is_contiguous() && x.device().is_cpu();
}

// torch._int_mm(x, w.t()) for int8 x [M, K] and a row-major int8 weight [N, K] by our VNNI kernel: the same
// exact int32 sums.
torch::Tensor int8_mm_vnni(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(vnni_supported(), "int8_mm_vnni: built without avx512_vnni");
  TORCH_CHECK(int8_operands(x, w), "int8_mm_vnni: contiguous CPU int8 x [M, K], w [N, K]");
  auto y = torch::empty({x.size(0), w.size(0)}, x.options().dtype(torch::kInt32));
  vnni_mm(x.data_ptr<int8_t>(), x.size(0), w.data_ptr<int8_t>(), x.size(1), w.size(0), y.data_ptr<int32_t>());
  return y;
}

// x · wᵀ in int32 [M, N], exact: the tier's product up to kTierInt8MaxRows rows (VNNI to kVnniMaxRows, where it
// is faster; without VNNI every row count: oneDNN's product saturates there), else torch._int_mm.
torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& w) {
  if (!int8_operands(x, w) || x.size(0) > kTierInt8MaxRows) return at::_int_mm(x, w.t());
  auto y = torch::empty({x.size(0), w.size(0)}, x.options().dtype(torch::kInt32));
  tier_int8_mm(x.data_ptr<int8_t>(), x.size(0), w.data_ptr<int8_t>(), x.size(1), w.size(0), y.data_ptr<int32_t>());
  return y;
}

// x · Wᵀ in exact int32 [M, N] (torch._int_mm's sums) from W [out_features, K] packed by pack_int8_panels
// (int8_panels.h), any row count.
torch::Tensor int8_panels_mm(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar && x.is_contiguous() && x.device().is_cpu() &&
              x.size(0) >= 1, "int8_panels_mm: contiguous CPU int8 x [M, K]");
#ifdef SLUICE_INT8_PANELS
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(panels.scalar_type() == at::kChar && panels.is_contiguous() && panels.dim() == 4 &&
              panels.size(0) == (N + kInt8Panel - 1) / kInt8Panel && panels.size(1) == (K + 3) / 4 &&
              panels.size(2) == kInt8Panel, "int8_panels_mm: panels of a weight [out_features, K] (pack_int8_panels)");
  auto y = torch::empty({M, N}, x.options().dtype(torch::kInt32));
  int8_panels_product(x.data_ptr<int8_t>(), M, panels.data_ptr<int8_t>(), K, N, y.data_ptr<int32_t>());
  return y;
#else
  TORCH_CHECK(false, "int8_panels_mm: built without AVX512-VNNI");
  return torch::Tensor();
#endif
}

// The arguments of both int4 VNNI-layout products: x contiguous CPU bf16 [M, K], packed uint8 [N, Kp / 2] with
// Kp the next multiple of 128 from K, scales_zeros bf16 [N, 2, Kp / 32].
void check_w4_args(const char* name, const torch::Tensor& x, const torch::Tensor& packed,
                   const torch::Tensor& scales_zeros, bool supported) {
  TORCH_CHECK(supported, name, ": not built for this tier");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu(), name,
              ": x must be a contiguous CPU bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(), name,
              ": packed must be contiguous uint8 [N, Kp / 2]");
  const int64_t K = x.size(1), N = packed.size(0), Kp = packed.size(1) * 2;
  TORCH_CHECK(K % 32 == 0 && Kp % 128 == 0 && Kp >= K && Kp < K + 128, name, ": packed does not match x");
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  scales_zeros.sizes() == at::IntArrayRef({N, 2, Kp / 32}),
              name, ": scales_zeros must be contiguous bf16 [N, 2, Kp / 32]");
}

// x [M, K] (bf16) times an int4 weight in our VNNI layout (packed [N, Kp / 2] u8, scales_zeros bf16
// [N, 2, Kp / 32]) + bias -> [M, N] bf16: activations quantized per group of 32, int8 x int4 products by
// `vpdpbusd`, scales in fp32, one rounding to bf16 (bias added in fp32 before it).
torch::Tensor int4_vnni_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales_zeros,
                           const c10::optional<torch::Tensor>& bias) {
  check_w4_args("int4_vnni_mm", x, packed, scales_zeros, w4a8_supported());
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), Kp = packed.size(1) * 2;
  auto y = torch::empty({M, N}, x.options());
  W4Acts* ap = w4_scratch(M, Kp);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {  // inline (no threads) up to 16 rows
    for (int64_t m = b; m < e; ++m) w4_quantize_row(xp + m * K, K, Kp, ap[m]);
  });
  torch::Tensor b = bias.has_value() ? bias->contiguous().to(at::kBFloat16) : torch::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "int4_vnni_mm: bias must have N values");
  const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  at::parallel_for(0, (N + kW4Block - 1) / kW4Block, 1, [&](int64_t b0, int64_t b1) {
    w4_rows(ap, M, Kp, q, sz, bp, b0 * kW4Block, std::min(N, b1 * kW4Block), yp, N);
  });
  return y;
}


// x [M, K] (bf16) times an int4 weight in our VNNI layout for more rows (large decode batches, prefill): x
// quantized per row to int8 (as the dynamic int8 path), each thread's block of 32 weight rows dequantized and
// requantized to int8 with one scale per row, the int8 product by our VNNI kernel (exact int32 sums), rescaled,
// bias added in fp32, one rounding to bf16. The int8 product does twice a bf16 dot product's work per
// instruction, which per-group int4 scales (the W4A8 kernel above) spend in conversions once x has many rows;
// faster than dequantizing to bf16 for oneDNN at 24-512 rows (docs/benchmarks.md, decode_steps).
torch::Tensor int4_vnni_int8_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales_zeros,
                                const c10::optional<torch::Tensor>& bias) {
  check_w4_args("int4_vnni_int8_mm", x, packed, scales_zeros, vnni_supported());
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), Kp = packed.size(1) * 2;
  auto y = torch::empty({M, N}, x.options());
  w4_int8_mm(x, packed, scales_zeros, bias, y);
  return y;
}

// Weight rows [n0, n1) of an int4 weight in our VNNI layout (packed [N, Kp / 2] u8, scales_zeros bf16
// [N, 2, Kp / 32]) dequantized to fp32 [n1 - n0, K]: a bounded slice of the weight for fp32 matmuls (prefill where
// oneDNN has no bf16 instructions; kernels/int4_weights.py).
torch::Tensor int4_vnni_dequant(const torch::Tensor& packed, const torch::Tensor& scales_zeros, int64_t K, int64_t n0,
                                int64_t n1) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.device().is_cpu(), "int4_vnni_dequant: packed must be contiguous CPU uint8 [N, Kp / 2]");
  const int64_t N = packed.size(0), Kp = packed.size(1) * 2;
  TORCH_CHECK(K % 32 == 0 && Kp % 128 == 0 && Kp >= K && Kp < K + 128 && 0 <= n0 && n0 <= n1 && n1 <= N,
              "int4_vnni_dequant: K or the rows do not match packed");
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  scales_zeros.sizes() == at::IntArrayRef({N, 2, Kp / 32}),
              "int4_vnni_dequant: scales_zeros must be contiguous bf16 [N, 2, Kp / 32]");
  auto out = torch::empty({n1 - n0, K}, packed.options().dtype(torch::kFloat32));
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  at::parallel_for(n0, n1, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) w4_dequant_row(q + n * (Kp / 2), sz + n * (Kp / 16), K, Kp, o + (n - n0) * K);
  });
  return out;
}

// This file's Python functions, on the module `m` (its own library's, or cpu_kernels.cpp's submodule "quant_linear").
inline void bind_quant_linear(py::module_& m) {
  m.def("int4_tile_mm", &int4_tile_mm, "x times an int4-packed weight, dequantized tile by tile (CPU)");
  m.def("int4_codes", &int4_codes, "codes of an int4-packed weight as the tile kernel reads them");
  m.def("quantize_rows", &quantize_rows, "per-row absmax int8 quantization (CPU)");
  m.def("bnb_4bit_blocks", &bnb_4bit_blocks, "blocks as bitsandbytes' default quantize_4bit codes them (CPU)",
        py::arg("x"), py::arg("blocksize"), py::arg("bounds"), py::arg("order") = py::none());
  m.def("bnb_int8_dequant", &bnb_int8_dequant, "bitsandbytes' int8_mm_dequant (+ bias) into bf16 (CPU), or None",
        py::arg("acc"), py::arg("row"), py::arg("col"), py::arg("bias") = py::none());
  m.def("bnb_int8_act", &bnb_int8_act, "activation rows as bitsandbytes' int8_vectorwise_quant(x.half(), threshold) (CPU)",
        py::arg("x"), py::arg("threshold"));
  m.def("bnb_int8_outliers", &bnb_int8_outliers, "LLM.int8()'s outlier columns' product added to out in place (bf16, "
        "CPU); False where the tier has no such pass", py::arg("out"), py::arg("x"), py::arg("cols"), py::arg("cb"),
        py::arg("scb"));
  m.attr("BNB_INT8_EPILOGUE") = bnb_int8_epilogue_supported();
  m.def("bnb_int8_rows", &bnb_int8_rows, "weight rows as bitsandbytes' int8_vectorwise_quant gives an fp16 copy (CPU)");
  m.def("int8_rescale", &int8_rescale, "int32 matmul result times row and column scales, plus bias (CPU)");
  m.attr("VNNI") = vnni_supported();
  m.attr("W4A8") = w4a8_supported();
  m.attr("VNNI_MAX_ROWS") = kVnniMaxRows;
#ifdef SLUICE_INT8_PANELS
  m.attr("INT8_PANELS") = true;  // int8 weights packed into panels (int8_panels.h) serve every row count
  m.def("pack_int8_panels", &pack_int8_panels, "int8 weight [N, K] packed into panels of 64 outputs in K quads",
        py::arg("w"));
#else
  m.attr("INT8_PANELS") = false;
#endif
  m.def("int8_panels_mm", &int8_panels_mm, "torch._int_mm(x, w.t()) from w's panels (pack_int8_panels)",
        py::arg("x"), py::arg("panels"), py::arg("out_features"));
  m.def("int8_mm", &int8_mm, "torch._int_mm(x, w.t()) for int8 x [M, K], w [N, K]: ours (VNNI) to VNNI_MAX_ROWS",
        py::arg("x"), py::arg("w"));
  m.def("int8_mm_vnni", &int8_mm_vnni, "torch._int_mm(x, w.t()) by our AVX512-VNNI kernel (CPU)", py::arg("x"),
        py::arg("w"));
  m.def("int4_vnni_mm", &int4_vnni_mm, "x (bf16) times an int4 weight in our VNNI layout, activations int8 per 32",
        py::arg("x"), py::arg("packed"), py::arg("scales_zeros"), py::arg("bias") = py::none());
  m.def("int4_vnni_dequant", &int4_vnni_dequant, "rows [n0, n1) of an int4 weight in our VNNI layout as fp32",
        py::arg("packed"), py::arg("scales_zeros"), py::arg("K"), py::arg("n0"), py::arg("n1"));
  m.def("int4_vnni_int8_mm", &int4_vnni_int8_mm, "x (bf16) times an int4 weight in our VNNI layout requantized "
        "to int8 per row, x quantized per row, the int8 product by VNNI", py::arg("x"), py::arg("packed"),
        py::arg("scales_zeros"), py::arg("bias") = py::none());
}

#ifndef SLUICE_NO_MODULE  // built alone (decode_stack.cpp and cpu_kernels.cpp include it without its module)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bind_quant_linear(m); }
#endif
