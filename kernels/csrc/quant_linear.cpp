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
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SLUICE_AVX512_BF16 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__BMI2__)
#include <immintrin.h>
#include "avx512_reduce.h"
#define SLUICE_AVX512_VNNI 1
#endif

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

// rows [M, K] -> (int8 codes [M, K], fp32 scales [M, 1]): absmax / 127 per row (at least 1e-12 / 127).
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [M, K] must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({M, 1}, x.options().dtype(torch::kFloat32));
  int8_t* q = xq.data_ptr<int8_t>();
  float* s = scale.data_ptr<float>();
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

// acc [M, N] int32 * row_scale [M, 1] * col_scale [N] -> dtype of col_scale, then + bias (rounded as torch's add).
torch::Tensor int8_rescale(torch::Tensor acc, torch::Tensor row_scale, torch::Tensor col_scale,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && col_scale.is_contiguous(), "acc [M, N] must be contiguous");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(col_scale.numel() == N && row_scale.numel() == M, "scales must match acc");
  auto y = torch::empty({M, N}, acc.options().dtype(col_scale.scalar_type()));
  auto rs = row_scale.contiguous();
  torch::Tensor b = bias.has_value() ? bias->contiguous().to(col_scale.scalar_type()) : torch::Tensor();
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
  alignas(64) int32_t sums[16];
  _mm512_store_si512(sums, sluice_reduce16_epi32(done));
  for (int j = 0; j < W; ++j)
    for (int m = 0; m < R; ++m) out[m * ldo + j] = sums[sluice_lane_of(j * R + m)] - comp[j];
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

void vnni_mm(const int8_t* x, int64_t M, const int8_t* w, int64_t K, int64_t N, int32_t* y) {
  const int64_t Kp = (K + 63) / 64 * 64;
  std::vector<uint8_t> xu(M * Kp, 0);  // codes + 128 as u8; the padding meets weight lanes loaded as 0
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xu[m * Kp + k] = static_cast<uint8_t>(x[m * K + k] ^ 0x80);
  std::vector<int32_t> comp(N);
  const uint8_t* xp = xu.data();
  at::parallel_for(0, (N + kVnniBlock - 1) / kVnniBlock, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kVnniBlock, n1 = std::min(N, b1 * kVnniBlock);
    for (int64_t n = n0; n < n1; ++n) comp[n] = vnni_comp(w + n * K, K);
    if (M <= 2) vnni_rows<8>(xp, Kp, M, w, K, N, comp.data(), n0, n1, y);  // 8 x 1-2: more weight rows in flight
    else vnni_rows<4>(xp, Kp, M, w, K, N, comp.data(), n0, n1, y);
  });
}
#endif

bool vnni_supported() {
#ifdef SLUICE_AVX512_VNNI
  return true;
#else
  return false;
#endif
}

// torch._int_mm(x, w.t()) for int8 x [M, K] and a row-major int8 weight [N, K] by our VNNI kernel: the same
// exact int32 sums.
torch::Tensor int8_mm_vnni(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(vnni_supported(), "int8_mm_vnni: built without avx512_vnni");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_mm_vnni: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kChar && w.scalar_type() == at::kChar, "int8_mm_vnni: int8 x and w");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu(), "int8_mm_vnni: contiguous CPU x, w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kInt32));
#ifdef SLUICE_AVX512_VNNI
  vnni_mm(x.data_ptr<int8_t>(), M, w.data_ptr<int8_t>(), K, N, y.data_ptr<int32_t>());
#endif
  return y;
}

// Rows our kernel takes: measured against oneDNN's (torch._int_mm) streaming a 125M model's int8 weights,
// 1.1-2x at 1-64 rows; above, a GEMM's blocking (oneDNN) wins.
constexpr int64_t kVnniMaxRows = 64;

// torch._int_mm(x, w.t()) (int32 [M, N]): ours where it is faster, else torch's; the result is the same.
torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& w) {
  if (vnni_supported() && x.size(0) <= kVnniMaxRows && x.is_contiguous() && w.is_contiguous() && x.device().is_cpu())
    return int8_mm_vnni(x, w);
  return at::_int_mm(x, w.t());
}

#ifndef SLUICE_NO_MODULE  // decode_stack.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_tile_mm", &int4_tile_mm, "x times an int4-packed weight, dequantized tile by tile (CPU)");
  m.def("int4_codes", &int4_codes, "codes of an int4-packed weight as the tile kernel reads them");
  m.def("quantize_rows", &quantize_rows, "per-row absmax int8 quantization (CPU)");
  m.def("int8_rescale", &int8_rescale, "int32 matmul result times row and column scales, plus bias (CPU)");
  m.attr("VNNI") = vnni_supported();
  m.attr("VNNI_MAX_ROWS") = kVnniMaxRows;
  m.def("int8_mm", &int8_mm, "torch._int_mm(x, w.t()) for int8 x [M, K], w [N, K]: ours (VNNI) to VNNI_MAX_ROWS");
  m.def("int8_mm_vnni", &int8_mm_vnni, "torch._int_mm(x, w.t()) by our AVX512-VNNI kernel (CPU)");
}
#endif
