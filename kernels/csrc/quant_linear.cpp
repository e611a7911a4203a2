// Weight-only quantized linears on CPU: the int4 tile-dequant matmul and the int8 dynamic-activation helpers.
//
// int4: the codes stay in torch's `_convert_weight_to_int4pack_for_cpu` layout (blocks of `block_n` output rows;
// a full block stores, per input column k, block_n / 2 bytes whose byte j holds row j (low nibble) and row
// j + block_n / 2 (high nibble); a shorter tail block stores rows 2i and 2i + 1 in byte i; `split` false means
// every block is stored in pairs). Each thread takes a run of output tiles, dequantizes a tile, w = (q - 8) *
// scale + zero in fp32 rounded to x's dtype, into a [K, tile] scratch that stays in its L2 and multiplies it
// with at::mm (oneDNN) straight into the output columns. Tiles of a few MB (L3): each at::mm call costs a fixed
// ~12 us, so L2-sized tiles spend more in calls than they save in cache misses.
//
// int8: per-row absmax quantization of the activations in one pass over each row, and the epilogue of
// `torch._int_mm` (int32 * row scale * column scale, cast, plus bias), rounding exactly as the torch ops did;
// with AVX512-VNNI the int8 matmul itself (`int8_mm`): weight rows read once each in memory order, every
// activation row against each, `vpdpbusd` (u8 x s8, int32 sums) on the codes + 128 less 128 x the row sums of
// the weight, so the int32 result is exactly torch._int_mm's. oneDNN's (behind torch._int_mm) reorders the
// weight on each call, which costs as much as the product itself at a few rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SLUICE_AVX512_BF16 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__BMI2__)
#include <immintrin.h>
#include "avx512_reduce.h"
#define SLUICE_AVX512_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define SLUICE_INT8_MM_AVX2 1  // no VNNI: our exact int16 product instead of oneDNN's saturating one
#endif
#if defined(SLUICE_AVX512_VNNI) || defined(SLUICE_INT8_MM_AVX2)
#define SLUICE_W4A8 1  // the int8 x int4 product: w4_quantize_row and w4_rows from the tier's file
#endif

namespace {

#include "w4a8.h"
#ifdef SLUICE_INT8_MM_AVX2
#include "int8_mm_avx2.h"
#include "w4a8_avx2.h"
#endif

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
#ifdef SLUICE_AVX512_BF16
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (L.split && rows == 64 && L.block_n == 64 && b0 % 64 == 0 && b0 + 64 <= L.n_padded) {
          const uint8_t* col = L.packed + b0 * L.K / 2 + k * 32;
          const __m512i low4 = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
          for (int h = 0; h < 2; ++h) {  // bytes 16h..16h+15: rows 16h + j (low) and 32 + 16h + j (high)
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 16 * h)));
            const __m512i parts[2] = {_mm512_and_si512(b, low4), _mm512_srli_epi32(b, 4)};
            for (int p = 0; p < 2; ++p) {
              const int r = 16 * h + 32 * p;
              const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(parts[p], eight));
              const __m512 w = _mm512_fmadd_ps(v, _mm512_loadu_ps(&scale[r]), _mm512_loadu_ps(&zero[r]));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r), (__m256i)_mm512_cvtneps_pbh(w));
            }
          }
          continue;
        }
      }
#endif
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

#ifdef SLUICE_AVX512_VNNI
// fp32 -> bf16 bits; the rounding is c10::BFloat16's (nearest even; the values here are never NaN).
inline __m512i sluice_round_bf16(__m512 v) {  // the bf16 bits in the low half of each lane
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}
#endif

// rows [M, K] -> (int8 codes [M, K], fp32 scales [M, 1]): absmax / 127 per row (at least 1e-12 / 127).
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [M, K] must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({M, 1}, x.options().dtype(torch::kFloat32));
  int8_t* q = xq.data_ptr<int8_t>();
  float* s = scale.data_ptr<float>();
#ifdef SLUICE_AVX512_VNNI
  if (x.scalar_type() == at::kBFloat16) {  // the same operations 16 lanes at a time (division, round to even)
    const at::BFloat16* src = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / K), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const at::BFloat16* xm = src + m * K;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
          amax = _mm512_max_ps(amax, _mm512_abs_ps(sluice_load_bf16(xm + k, sluice_tail16(K - k))));
        const float sc = std::max(_mm512_reduce_max_ps(amax), 1e-12f) / 127.f;
        s[m] = sc;
        const __m512 vs = _mm512_set1_ps(sc);
        for (int64_t k = 0; k < K; k += 16) {
          const __mmask16 mask = sluice_tail16(K - k);
          const __m512i qv = _mm512_cvtps_epi32(_mm512_div_ps(sluice_load_bf16(xm + k, mask), vs));
          _mm_mask_storeu_epi8(q + m * K + k, mask, _mm512_cvtepi32_epi8(qv));
        }
      }
    });
    return {xq, scale};
  }
#endif
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

// 127.0 / SCB as torch computes it (t.reciprocal() * 127), each step a volatile read: under this file's
// fast-math flags the compiler folds 127 * (1 / SCB) into 127 / SCB, which rounds differently (a factor one ulp
// higher: products of 63.499996 become 63.5, codes 63 become 64).
inline float bnb_factor(float amax) {
  const volatile float r = 1.f / amax;
  const volatile float f = 127.f * r;
  return f;
}

// Weight rows [N, K] quantized exactly as bitsandbytes' int8_vectorwise_quant quantizes an fp16 copy of them
// (threshold 0, what a Linear8bitLt gets when it quantizes while loading): each value rounded to fp16 and back,
// SCB = the row's absmax of those (fp32), codes round(v * bnb_factor(SCB)) to nearest even (an fp16 inf makes the
// row's codes 0, as torch's cast of their NaN products does here). One pass per row where bitsandbytes' torch
// ops make seven over the whole weight (in fp16, which this CPU only converts): 1.8 vs 72 ms a 5632 x 2048
// weight. Finite weights.
std::vector<torch::Tensor> bnb_int8_rows(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "bnb_int8_rows: a contiguous CPU [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  auto cb = torch::empty({N, K}, w.options().dtype(torch::kInt8));
  auto scb = torch::empty({N}, w.options().dtype(torch::kFloat32));
  int8_t* q = cb.data_ptr<int8_t>();
  float* s = scb.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, K));
#ifdef SLUICE_AVX512_VNNI
  if (w.scalar_type() == at::kBFloat16) {
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    auto as_half = [](__m512 x) { return _mm512_cvtph_ps(_mm512_cvtps_ph(x, kNearest)); };
    const at::BFloat16* src = w.data_ptr<at::BFloat16>();
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const at::BFloat16* row = src + n * K;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
          amax = _mm512_max_ps(amax, _mm512_abs_ps(as_half(sluice_load_bf16(row + k, sluice_tail16(K - k)))));
        const float a = _mm512_reduce_max_ps(amax);
        s[n] = a;
        const __m512 f = _mm512_set1_ps(bnb_factor(a));
        for (int64_t k = 0; k < K; k += 16) {  // cvtps_epi32 rounds to even; a NaN lane becomes INT_MIN, byte 0
          const __mmask16 mask = sluice_tail16(K - k);
          const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(as_half(sluice_load_bf16(row + k, mask)), f));
          _mm_mask_storeu_epi8(q + n * K + k, mask, _mm512_cvtepi32_epi8(v));
        }
      }
    });
    return {cb, scb};
  }
#endif
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

#ifdef SLUICE_AVX512_VNNI
// bnb_4bit_blocks' codes of a full block, 16 values at a time (the same comparisons and clamp, in lanes): the
// count of bounds below each value, mapped, two codes a byte. Returns the values done (len rounded down to 16).
template <typename T>
int64_t bnb_4bit_codes16(const T* v, int64_t len, float scale, const float* bnd, const uint8_t* map, uint8_t* out) {
  __m512 bounds[15];
  for (int i = 0; i < 15; ++i) bounds[i] = _mm512_set1_ps(bnd[i]);
  alignas(64) int32_t order[16];
  for (int i = 0; i < 16; ++i) order[i] = map[i];
  const __m512i ordered = _mm512_load_si512(order), one = _mm512_set1_epi32(1);
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-1.f), hi = _mm512_set1_ps(1.f);
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) {
    __m512 x;
    if constexpr (std::is_same_v<T, float>) x = _mm512_loadu_ps(v + j);
    else x = sluice_load_bf16(v + j);
    x = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x, s), lo), hi);
    __m512i c = _mm512_setzero_si512();
    for (int i = 0; i < 15; ++i) c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(bounds[i], x, _CMP_LT_OQ), c, one);
    const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(c, ordered));  // code k in byte k
    const __m128i pairs = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x00FF)), 4),
                                       _mm_srli_epi16(bytes, 8));  // (code 2i << 4) | code 2i + 1, 16-bit lanes
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j / 2), _mm_packus_epi16(pairs, pairs));
  }
  return j;
}
#endif

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
#ifdef SLUICE_AVX512_VNNI
        if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, float>) {
          if (b < blocks) j = bnb_4bit_codes16(v, len, scale, bnd, map, out + start / 2);
        }
#endif
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
#ifdef SLUICE_AVX512_VNNI
  if (col_scale.scalar_type() == at::kBFloat16) {  // the same roundings 16 lanes at a time
    const int32_t* a = acc.data_ptr<int32_t>();
    const float* r = rs.data_ptr<float>();
    const at::BFloat16* cs = col_scale.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
    at::BFloat16* out = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / N), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const __m512 rm = _mm512_set1_ps(r[m]);
        for (int64_t n = 0; n < N; n += 16) {
          const __mmask16 mask = sluice_tail16(N - n);
          const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, a + m * N + n)),
                                                       rm), sluice_load_bf16(cs + n, mask));
          __m512i h = sluice_round_bf16(v);
          if (bp != nullptr)
            h = sluice_round_bf16(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16)),
                                                sluice_load_bf16(bp + n, mask)));
          _mm256_mask_storeu_epi16(out + m * N + n, mask, _mm512_cvtepi32_epi16(h));
        }
      }
    });
    return y;
  }
#endif
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
        for (int64_t n = 0; n < N; ++n) om[n] = static_cast<scalar_t>(static_cast<float>(am[n]) * rm * static_cast<float>(cs[n]));
        if (bp != nullptr)
          for (int64_t n = 0; n < N; ++n) om[n] = static_cast<scalar_t>(static_cast<float>(om[n]) + static_cast<float>(bp[n]));
      }
    });
  });
  return y;
}


#ifdef SLUICE_AVX512_VNNI
constexpr int64_t kVnniBlock = 32;  // output rows per parallel task (a multiple of every W)

// 128 * sum_k w[k] of one weight row: what the + 128 on the activation codes adds to each of its dot products.
inline int32_t vnni_comp(const int8_t* w, int64_t K) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i c = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64)
    c = _mm512_dpbusd_epi32(c, ones, _mm512_maskz_loadu_epi8(_bzhi_u64(~0ULL, std::min<int64_t>(64, K - k)), w + k));
  return 128 * _mm512_reduce_add_epi32(c);
}

// W consecutive weight rows (w, K apart) against R activation rows (u8 codes + 128, ldx apart, readable to K
// rounded up to 64): out[m * ldo + j] = sum_k x[m][k] * w[j][k]. The W rows are one contiguous run of memory.
template <int W, int R>
inline void vnni_tile(const uint8_t* xu, int64_t ldx, int64_t K, const int8_t* w, const int32_t* comp,
                      int32_t* out, int64_t ldo) {
  static_assert(W * R <= 16, "one reduction tree");
  __m512i acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {  // every block but a short last one loads unmasked
    const __mmask64 mask = k + 64 <= K ? ~0ULL : _bzhi_u64(~0ULL, K - k);
    __m512i wv[W];
#pragma GCC unroll 16
    for (int j = 0; j < W; ++j) wv[j] = _mm512_maskz_loadu_epi8(mask, w + j * K + k);
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
      const __m512i xv = _mm512_loadu_si512(xu + m * ldx + k);
#pragma GCC unroll 16
      for (int j = 0; j < W; ++j) acc[j * R + m] = _mm512_dpbusd_epi32(acc[j * R + m], xv, wv[j]);
    }
  }
  __m512i done[16];  // a copy: acc's address never escapes, so it stays in registers through the loop
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) done[i] = acc[i];
  int32_t sums[W * R];
  sluice_sums<W * R>(done, sums);
  for (int j = 0; j < W; ++j)
    for (int m = 0; m < R; ++m) out[m * ldo + j] = sums[j * R + m] - comp[j];
}

// Output rows [n0, n1) of y [1, N] for one activation row, weight rows one after another in memory order (one
// stream the hardware prefetcher runs ahead of; interleaved rows are as many short streams, read at about half
// the bandwidth), four accumulators per row so that the `vpdpbusd`s do not wait on one another.
inline void vnni_rows_one(const uint8_t* xu, const int8_t* w, int64_t K, const int32_t* comp, int64_t n0, int64_t n1,
                          int32_t* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 256 <= K; k += 256) {
      a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(xu + k), _mm512_loadu_si512(wn + k));
      a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(xu + k + 64), _mm512_loadu_si512(wn + k + 64));
      a2 = _mm512_dpbusd_epi32(a2, _mm512_loadu_si512(xu + k + 128), _mm512_loadu_si512(wn + k + 128));
      a3 = _mm512_dpbusd_epi32(a3, _mm512_loadu_si512(xu + k + 192), _mm512_loadu_si512(wn + k + 192));
    }
    for (; k < K; k += 64)  // the activation codes are readable (and 0) to K rounded up to 64
      a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(xu + k),
                               _mm512_maskz_loadu_epi8(_bzhi_u64(~0ULL, std::min<int64_t>(64, K - k)), wn + k));
    y[n] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3))) - comp[n];
  }
}

// Output rows [n0, n1) of y [M, N] for activation rows [0, M): tiles of W weight rows x R activation rows.
template <int W>
void vnni_rows(const uint8_t* xu, int64_t ldx, int64_t M, const int8_t* w, int64_t K, int64_t N, const int32_t* comp,
               int64_t n0, int64_t n1, int32_t* y) {
  constexpr int R = 16 / W > 4 ? 4 : 16 / W;
  int64_t n = n0;
  for (; n + W <= n1; n += W) {
    int64_t m = 0;
    for (; m + R <= M; m += R) vnni_tile<W, R>(xu + m * ldx, ldx, K, w + n * K, comp + n, y + m * N + n, N);
    switch (M - m) {  // fewer than R rows left
      case 1: vnni_tile<W, 1>(xu + m * ldx, ldx, K, w + n * K, comp + n, y + m * N + n, N); break;
      case 2: if constexpr (R > 2) vnni_tile<W, 2>(xu + m * ldx, ldx, K, w + n * K, comp + n, y + m * N + n, N); break;
      case 3: if constexpr (R > 3) vnni_tile<W, 3>(xu + m * ldx, ldx, K, w + n * K, comp + n, y + m * N + n, N); break;
      default: break;
    }
  }
  for (; n < n1; ++n)  // the last N % W rows one at a time
    for (int64_t m = 0; m < M; ++m) vnni_tile<1, 1>(xu + m * ldx, ldx, K, w + n * K, comp + n, y + m * N + n, N);
}

// Activation codes x [M, K] as the kernel reads them: + 128 as u8, rows Kp apart (K rounded up to 64), the
// padding 0 (it meets weight lanes loaded as 0).
std::vector<uint8_t> vnni_activations(const int8_t* x, int64_t M, int64_t K, int64_t Kp) {
  std::vector<uint8_t> xu(M * Kp);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < Kp; k += 64) {
      const __mmask64 mask = k + 64 <= K ? ~0ULL : (k < K ? _bzhi_u64(~0ULL, K - k) : 0ULL);
      _mm512_storeu_si512(xu.data() + m * Kp + k,
                          _mm512_maskz_mov_epi8(mask, _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, x + m * K + k), flip)));
    }
  return xu;
}

// comp_in: the weight rows' vnni_comp, kept by the caller (a linear's weights do not change), or null. One
// activation row with comp_in: the weight rows one by one in memory order. Otherwise block by block (32 rows):
// first one pass over the block in memory order computing its comp (the rows then sit in cache), then the tiles,
// which interleave 4-8 rows (as many short streams: from memory they read at about half the bandwidth). Measured
// over the bench model's 49 linears at one row: 4.6-5.0 ms a step with comp per call over a thread's whole
// range (the weight read twice from memory), 3.4-3.8 block by block, 2.7-3.4 with comp kept (one stream).
void vnni_mm(const int8_t* x, int64_t M, const int8_t* w, int64_t K, int64_t N, int32_t* y,
             const int32_t* comp_in = nullptr) {
  const int64_t Kp = (K + 63) / 64 * 64;
  const std::vector<uint8_t> xu = vnni_activations(x, M, K, Kp);
  const bool one = M == 1 && comp_in != nullptr;
  std::vector<int32_t> own(one ? 0 : N);
  const uint8_t* xp = xu.data();
  at::parallel_for(0, (N + kVnniBlock - 1) / kVnniBlock, 1, [&](int64_t b0, int64_t b1) {
    if (one) {
      vnni_rows_one(xp, w, K, comp_in, b0 * kVnniBlock, std::min(N, b1 * kVnniBlock), y);
      return;
    }
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kVnniBlock, n1 = std::min(N, n0 + kVnniBlock);
      for (int64_t n = n0; n < n1; ++n) own[n] = vnni_comp(w + n * K, K);
      if (M <= 2) vnni_rows<8>(xp, Kp, M, w, K, N, own.data(), n0, n1, y);  // 8 x 1-2: more weight rows in flight
      else vnni_rows<4>(xp, Kp, M, w, K, N, own.data(), n0, n1, y);
    }
  });
}
#endif

#ifdef SLUICE_AVX512_VNNI
// x row [K] (bf16 bits) -> the quantized activations (groups past K: a = 0, d = 0, sum = 0).
inline void w4_quantize_row(const uint16_t* x, int64_t K, int64_t Kp, const W4Acts& r) {
  w4_clear_row(r, Kp);
  int8_t* a = r.a;
  float *d = r.d, *sum = r.sum, *off = r.off;
  const int64_t block_chunks = Kp / kW4Chunk / 4 * 4;
  for (int64_t g = 0; g < K / kW4Group; ++g) {
    const int64_t pos = w4_pos(g, block_chunks);
    const __m512 lo = sluice_load_bf16(x + 32 * g), hi = sluice_load_bf16(x + 32 * g + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float dg = amax / 127.f;
    const int64_t c = g / 4, j = g % 4;
    int8_t* at = a + c * kW4Chunk + 16 * j;
    if (amax > 0.f) {
      const __m512 dv = _mm512_set1_ps(dg);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_div_ps(lo, dv)), qhi = _mm512_cvtps_epi32(_mm512_div_ps(hi, dv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 64), _mm512_cvtepi32_epi8(qhi));
      off[pos] = -8.f * dg * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
    }
    w4_store_d(d, g, pos, block_chunks, dg);
    sum[pos] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
}

// bf16 scales of chunk c (four groups) to fp32 lanes: lane l holds the scale of group 4 c + l / 4.
inline __m512 w4_lane_scales(const uint16_t* s, int64_t c) {
  const __m512i ctl = _mm512_set_epi8(7, 6, -1, -1, 7, 6, -1, -1, 7, 6, -1, -1, 7, 6, -1, -1,
                                      5, 4, -1, -1, 5, 4, -1, -1, 5, 4, -1, -1, 5, 4, -1, -1,
                                      3, 2, -1, -1, 3, 2, -1, -1, 3, 2, -1, -1, 3, 2, -1, -1,
                                      1, 0, -1, -1, 1, 0, -1, -1, 1, 0, -1, -1, 1, 0, -1, -1);
  int64_t four;
  std::memcpy(&four, s + 4 * c, 8);
  return _mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_set1_epi64(four), ctl));
}

// Four int32 vectors of a block's chunks (lane 4 g + p: part p of group g of the chunk) to the 16 group sums,
// lane 4 g + c holding chunk c's group g.
inline __m512i w4_transpose_add(const __m512i* d) {
  const __m512i p = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
  const __m512i q = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(p, q), _mm512_unpackhi_epi64(p, q));
}

// W weight rows (codes `q`, row stride Kp / 2; scales/zeros `sz`, row stride 2 Gp) against R activation rows:
// out[m * ldo + j] = the fp32 dot product. Rows one after another (memory order: one stream for the prefetcher),
// each into its own R accumulators; the W x R sums are reduced at once at the end.
template <int W, int R>
inline void w4_tile(const W4Acts* acts, int64_t Kp, const uint8_t* q, const uint16_t* sz, const at::BFloat16* bias,
                    at::BFloat16* out, int64_t ldo) {
  static_assert(W * R <= 16, "one reduction tree");
  const int64_t Gp = Kp / kW4Group, row = Kp / 2, chunks = Kp / kW4Chunk, blocks = chunks / 4;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int j = 0; j < W; ++j) {
    const uint8_t* qj = q + j * row;
    const uint16_t* sj = sz + j * 2 * Gp;
    __m512 a[R];
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) a[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {  // whole blocks: one conversion and scaling per 16 groups
      __m512i dots[R][4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(qj + (4 * b + c) * 64);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 16
        for (int m = 0; m < R; ++m) {
          const int8_t* am = acts[m].a + (4 * b + c) * kW4Chunk;
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(am));
          dots[m][c] = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(am + 64));
        }
      }
      const __m512 s = sluice_load_bf16(sj + 16 * b);
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) {
        const __m512 ds = _mm512_mul_ps(s, _mm512_loadu_ps(acts[m].d + 64 * b));
        a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(w4_transpose_add(dots[m])), ds, a[m]);
      }
    }
    for (int64_t c = 4 * blocks; c < chunks; ++c) {  // the chunks after them, one at a time
      const __m512i v = _mm512_loadu_si512(qj + c * 64);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      const __m512 s = w4_lane_scales(sj, c);
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) {
        const int8_t* am = acts[m].a + c * kW4Chunk;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(am));
        dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(am + 64));
        const __m512 ds = _mm512_mul_ps(s, _mm512_loadu_ps(acts[m].d + c * 16));
        a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), ds, a[m]);
      }
    }
    for (int64_t g = 0; g < Gp; g += 16) {  // per group: s * (- 8 d sum a) + z * sum x
      const __mmask16 mask = static_cast<__mmask16>(_bzhi_u32(0xFFFF, static_cast<uint32_t>(std::min<int64_t>(16, Gp - g))));
      const __m512 s = sluice_load_bf16(sj + g, mask), z = sluice_load_bf16(sj + Gp + g, mask);
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) {
        const __m512 zx = _mm512_fmadd_ps(z, _mm512_maskz_loadu_ps(mask, acts[m].sum + g), a[m]);
        a[m] = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(mask, acts[m].off + g), zx);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) acc[j * R + m] = a[m];
  }
  float sums[W * R];
  sluice_sums<W * R>(acc, sums);
  for (int j = 0; j < W; ++j) {  // the bias in fp32, one rounding to bf16
    const float b = bias != nullptr ? static_cast<float>(bias[j]) : 0.f;
    for (int m = 0; m < R; ++m) out[m * ldo + j] = static_cast<at::BFloat16>(sums[j * R + m] + b);
  }
}

// Output rows [n0, n1) of y [M, N]: tiles of 4 weight rows x 4 activation rows (8 or 16 weight rows at one or two
// activation rows measured no faster), the last N % 4 rows one at a time.
void w4_rows(const W4Acts* acts, int64_t M, int64_t Kp, const uint8_t* q, const uint16_t* sz,
             const at::BFloat16* bias, int64_t n0, int64_t n1, at::BFloat16* y, int64_t N) {
  const int64_t row = Kp / 2, Gp = Kp / kW4Group;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const uint8_t* qn = q + n * row;
    const uint16_t* sn = sz + n * 2 * Gp;
    const at::BFloat16* bn = bias != nullptr ? bias + n : nullptr;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) w4_tile<4, 4>(acts + m, Kp, qn, sn, bn, y + m * N + n, N);
    switch (M - m) {
      case 1: w4_tile<4, 1>(acts + m, Kp, qn, sn, bn, y + m * N + n, N); break;
      case 2: w4_tile<4, 2>(acts + m, Kp, qn, sn, bn, y + m * N + n, N); break;
      case 3: w4_tile<4, 3>(acts + m, Kp, qn, sn, bn, y + m * N + n, N); break;
      default: break;
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m)
      w4_tile<1, 1>(acts + m, Kp, q + n * row, sz + n * 2 * Gp, bias != nullptr ? bias + n : nullptr, y + m * N + n, N);
}
#endif

bool w4a8_supported() {  // int4_vnni_mm: AVX512-VNNI or AVX2
#ifdef SLUICE_W4A8
  return true;
#else
  return false;
#endif
}

bool vnni_supported() {
#ifdef SLUICE_AVX512_VNNI
  return true;
#else
  return false;
#endif
}

// What the VNNI product needs of a weight [N, K] besides the weight: per row 128 * its sum (int32 [N]), which
// the + 128 on the activation codes adds to each dot product. A linear computes it once and passes it to
// int8_mm, sparing the one-row product a pass over the weight per call (with more rows the product makes that
// pass anyway, block by block, to bring the rows into cache for its tiles).
torch::Tensor int8_vnni_comp(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.device().is_cpu(),
              "int8_vnni_comp: a contiguous CPU int8 weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  auto comp = torch::empty({N}, w.options().dtype(torch::kInt32));
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* c = comp.data_ptr<int32_t>();
  at::parallel_for(0, N, 256, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
#ifdef SLUICE_AVX512_VNNI
      c[n] = vnni_comp(wp + n * K, K);
#else
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += wp[n * K + k];
      c[n] = 128 * s;
#endif
    }
  });
  return comp;
}

// torch._int_mm(x, w.t()) for int8 x [M, K] and a row-major int8 weight [N, K] by our VNNI kernel: the same
// exact int32 sums. comp: int8_vnni_comp(w), or none (computed per call).
torch::Tensor int8_mm_vnni(const torch::Tensor& x, const torch::Tensor& w,
                           const c10::optional<torch::Tensor>& comp = c10::nullopt) {
  TORCH_CHECK(vnni_supported(), "int8_mm_vnni: built without avx512_vnni");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_mm_vnni: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kChar && w.scalar_type() == at::kChar, "int8_mm_vnni: int8 x and w");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu(), "int8_mm_vnni: contiguous CPU x, w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(!comp.has_value() || (comp->scalar_type() == at::kInt && comp->is_contiguous() && comp->numel() == N),
              "int8_mm_vnni: comp must be int8_vnni_comp(w), contiguous int32 [N]");
  auto y = torch::empty({M, N}, x.options().dtype(torch::kInt32));
#ifdef SLUICE_AVX512_VNNI
  vnni_mm(x.data_ptr<int8_t>(), M, w.data_ptr<int8_t>(), K, N, y.data_ptr<int32_t>(),
          comp.has_value() ? comp->data_ptr<int32_t>() : nullptr);
#endif
  return y;
}

// Rows our kernel takes: measured against oneDNN's (torch._int_mm) streaming a 125M model's int8 weights,
// 1.1-2x at 1-64 rows; above, a GEMM's blocking (oneDNN) wins.
constexpr int64_t kVnniMaxRows = 64;

// x · wᵀ in int32 [M, N], exact: ours (VNNI) where it is faster, else torch._int_mm; without VNNI always ours
// (int8_mm_avx2.h: oneDNN's product saturates there).
// comp: int8_vnni_comp(w) where the caller keeps it (our kernel's; torch's does not need it).
torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& w,
                      const c10::optional<torch::Tensor>& comp = c10::nullopt) {
  if (vnni_supported() && x.size(0) <= kVnniMaxRows && x.is_contiguous() && w.is_contiguous() && x.device().is_cpu())
    return int8_mm_vnni(x, w, comp);
#ifdef SLUICE_INT8_MM_AVX2
  if (x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.scalar_type() == at::kChar &&
      w.scalar_type() == at::kChar && x.is_contiguous() && w.is_contiguous() && x.device().is_cpu()) {
    auto y = torch::empty({x.size(0), w.size(0)}, x.options().dtype(torch::kInt32));
    int8_mm_avx2(x.data_ptr<int8_t>(), x.size(0), w.data_ptr<int8_t>(), x.size(1), w.size(0), y.data_ptr<int32_t>());
    return y;
  }
#endif
  return at::_int_mm(x, w.t());
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
#ifdef SLUICE_W4A8
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
#endif
  return y;
}

#ifdef SLUICE_AVX512_VNNI
// Weight rows [n0, n0 + rows) of our int4 layout requantized to int8 rows [rows, K] with one absmax scale per
// row (as the int8 weight-only linears store theirs), and each row's 128 x sum of codes (`vnni_comp`). A row's
// absmax comes from its groups' ends, z - 8 s and z + 7 s (the codes 0 and 15, which `quantize` gives each
// group's minimum and maximum), so every weight is dequantized and requantized in one fused step.
void w4_requant_rows(const uint8_t* q, const uint16_t* sz, int64_t K, int64_t Kp, int64_t n0, int64_t rows,
                     int8_t* out, float* scales, int32_t* comp) {
  const int64_t Gp = Kp / kW4Group, G = K / kW4Group, block_chunks = Kp / kW4Chunk / 4 * 4;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* qr = q + (n0 + r) * (Kp / 2);
    const uint16_t* sr = sz + (n0 + r) * 2 * Gp;
    float amax = 0.f;
    for (int64_t p = 0; p < Gp; ++p) {  // padded groups have s = z = 0
      const float sv = sluice_bf16_to_float(sr[p]), base = sluice_bf16_to_float(sr[Gp + p]) - 8.f * sv;
      amax = std::max({amax, std::abs(base), std::abs(std::fma(15.f, sv, base))});
    }
    const float scale = std::max(amax, 1e-30f) / 127.f, inv = 1.f / scale;
    int8_t* o = out + r * K;
    __m512i sum = _mm512_setzero_si512();
    const __m512 qv = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int64_t c = 0; c * 4 < G; ++c) {
      // each group's 16 possible weights, round((q s + z - 8 s) / scale) for q = 0..15, in its 128-bit lane:
      // one byte shuffle per half chunk then requantizes 64 codes
      __m128i tables[4];
      for (int l = 0; l < 4; ++l) {
        const int64_t g = std::min(4 * c + l, G - 1), pos = w4_pos(g, block_chunks);
        const float sv = sluice_bf16_to_float(sr[pos]), base = sluice_bf16_to_float(sr[Gp + pos]) - 8.f * sv;
        tables[l] = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(
            _mm512_fmadd_ps(qv, _mm512_set1_ps(sv * inv), _mm512_set1_ps(base * inv))));
      }
      const __m512i lut = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(
          _mm512_castsi128_si512(tables[0]), tables[1], 1), tables[2], 2), tables[3], 3);
      const __m512i v = _mm512_loadu_si512(qr + c * 64);
      const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low4));
      const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
      // group l's 32 columns are its low half's lane l, then its high half's
      const __m512i a = _mm512_permutex2var_epi64(lo, first, hi), b = _mm512_permutex2var_epi64(lo, second, hi);
      const int64_t left = K - 128 * c;  // a multiple of 32
      const __mmask64 ma = left >= 64 ? ~0ULL : _bzhi_u64(~0ULL, left);
      const __mmask64 mb = left >= 128 ? ~0ULL : (left > 64 ? _bzhi_u64(~0ULL, left - 64) : 0ULL);
      _mm512_mask_storeu_epi8(o + 128 * c, ma, a);
      _mm512_mask_storeu_epi8(o + 128 * c + 64, mb, b);
      sum = _mm512_dpbusd_epi32(sum, ones, _mm512_maskz_mov_epi8(ma, a));
      sum = _mm512_dpbusd_epi32(sum, ones, _mm512_maskz_mov_epi8(mb, b));
    }
    scales[r] = scale;
    comp[r] = 128 * _mm512_reduce_add_epi32(sum);
  }
}
#endif

// x [M, K] (bf16) times an int4 weight in our VNNI layout for more rows (large decode batches, prefill): x
// quantized per row to int8 (as the dynamic int8 path), each thread's block of 32 weight rows dequantized and
// requantized to int8 with one scale per row, the int8 product by our VNNI kernel (exact int32 sums), rescaled,
// bias added in fp32, one rounding to bf16. The int8 product does twice a bf16 dot product's work per
// instruction, which per-group int4 scales (the W4A8 kernel above) spend in conversions once x has many rows;
// measured over a 125M model's linears, 1.3-1.6x dequantizing to bf16 for oneDNN at 24-512 rows.
torch::Tensor int4_vnni_int8_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales_zeros,
                                const c10::optional<torch::Tensor>& bias) {
  check_w4_args("int4_vnni_int8_mm", x, packed, scales_zeros, vnni_supported());
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), Kp = packed.size(1) * 2;
  auto y = torch::empty({M, N}, x.options());
#ifdef SLUICE_AVX512_VNNI
  const auto xq = quantize_rows(x);
  const int8_t* xc = xq[0].data_ptr<int8_t>();
  const float* xs = xq[1].data_ptr<float>();
  const int64_t K64 = (K + 63) / 64 * 64;
  const std::vector<uint8_t> xu = vnni_activations(xc, M, K, K64);
  torch::Tensor b = bias.has_value() ? bias->contiguous().to(torch::kFloat32) : torch::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "int4_vnni_int8_mm: bias must have N values");
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  const uint8_t* xup = xu.data();
  at::parallel_for(0, (N + kVnniBlock - 1) / kVnniBlock, 1, [&](int64_t b0, int64_t b1) {
    static thread_local std::vector<int8_t> w8;
    static thread_local std::vector<float> wscale;
    static thread_local std::vector<int32_t> comp, y32;
    w8.resize(kVnniBlock * K);
    wscale.resize(kVnniBlock);
    comp.resize(kVnniBlock);
    y32.resize(M * kVnniBlock);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kVnniBlock, rows = std::min(kVnniBlock, N - n0);
      w4_requant_rows(q, sz, K, Kp, n0, rows, w8.data(), wscale.data(), comp.data());
      vnni_rows<4>(xup, K64, M, w8.data(), K, rows, comp.data(), 0, rows, y32.data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < rows; j += 16) {  // y32 x row scale x weight scale (+ bias), one rounding
          const __mmask16 mask = sluice_tail16(rows - j);
          __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, &y32[m * rows + j])),
                                                 _mm512_set1_ps(xs[m])), _mm512_maskz_loadu_ps(mask, &wscale[j]));
          if (bp != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bp + n0 + j));
          _mm256_mask_storeu_epi16(yp + m * N + n0 + j, mask, _mm512_cvtepi32_epi16(sluice_round_bf16(v)));
        }
    }
  });
#endif
  return y;
}

#ifndef SLUICE_NO_MODULE  // decode_stack.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_tile_mm", &int4_tile_mm, "x times an int4-packed weight, dequantized tile by tile (CPU)");
  m.def("int4_codes", &int4_codes, "codes of an int4-packed weight as the tile kernel reads them");
  m.def("quantize_rows", &quantize_rows, "per-row absmax int8 quantization (CPU)");
  m.def("bnb_4bit_blocks", &bnb_4bit_blocks, "blocks as bitsandbytes' default quantize_4bit codes them (CPU)",
        py::arg("x"), py::arg("blocksize"), py::arg("bounds"), py::arg("order") = py::none());
  m.def("bnb_int8_rows", &bnb_int8_rows, "weight rows as bitsandbytes' int8_vectorwise_quant gives an fp16 copy (CPU)");
  m.def("int8_rescale", &int8_rescale, "int32 matmul result times row and column scales, plus bias (CPU)");
  m.attr("VNNI") = vnni_supported();
  m.attr("W4A8") = w4a8_supported();
  m.attr("VNNI_MAX_ROWS") = kVnniMaxRows;
  m.def("int8_mm", &int8_mm, "torch._int_mm(x, w.t()) for int8 x [M, K], w [N, K]: ours (VNNI) to VNNI_MAX_ROWS",
        py::arg("x"), py::arg("w"), py::arg("comp") = py::none());
  m.def("int8_mm_vnni", &int8_mm_vnni, "torch._int_mm(x, w.t()) by our AVX512-VNNI kernel (CPU)", py::arg("x"),
        py::arg("w"), py::arg("comp") = py::none());
  m.def("int8_vnni_comp", &int8_vnni_comp, "per weight row 128 * its sum: what int8_mm's VNNI kernel subtracts");
  m.def("int4_vnni_mm", &int4_vnni_mm, "x (bf16) times an int4 weight in our VNNI layout, activations int8 per 32",
        py::arg("x"), py::arg("packed"), py::arg("scales_zeros"), py::arg("bias") = py::none());
  m.def("int4_vnni_int8_mm", &int4_vnni_int8_mm, "x (bf16) times an int4 weight in our VNNI layout requantized "
        "to int8 per row, x quantized per row, the int8 product by VNNI", py::arg("x"), py::arg("packed"),
        py::arg("scales_zeros"), py::arg("bias") = py::none());
}
#endif
