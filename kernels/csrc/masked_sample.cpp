// One token per logits row on CPU, the grammar's bitmask, the temperature, the sampling noise and the argmax in a
// few passes over the row and no [rows, vocab] temporaries (engine/sampler.py's torch path makes a float32 copy,
// applies the mask, divides, takes a softmax, hashes a noise tensor in int64 ops and divides again):
//   greedy rows (temperature <= 0): the first maximum of the logits the row's bitmask allows;
//   sampled rows: sampler.draw's exponential race, argmax_v softmax(x / T)_v / E_v with E_v = -log(u_v) and u_v
//   the counter-based hash of (row key, v) that sampler.keyed_uniform computes; a refused token has p_v = 0.
// Bit v of bitmask row mask_rows[r] (xgrammar's int32 layout) allows token v < mask_vocab; rows with
// mask_rows[r] < 0, and tokens from mask_vocab on, are not masked (as xgr.apply_token_bitmask_inplace leaves them).
// exp and log are at::vec's (Sleef, as torch's own ops), so tokens differ from the torch path's only where two
// candidates' scores tie to rounding.
#pragma once
#ifndef SLUICE_NO_MODULE  // built alone: its own module, not elementwise.cpp's
#define SLUICE_MASKED_SAMPLE_MODULE
#define SLUICE_NO_MODULE
#endif
#include "elementwise.cpp"

#include <cstdint>

namespace {

// sampler._mix32 on uint32 (its int64 arithmetic masked to 32 bits is this wrapping arithmetic).
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  return x ^ (x >> 16);
}

// The row's part of keyed_uniform's hash, from its key (lo, hi, pos, stream).
inline uint32_t row_hash(const int64_t* key) {
  const auto lo = static_cast<uint32_t>(key[0]), hi = static_cast<uint32_t>(key[1]);
  const auto pos = static_cast<uint32_t>(key[2]), stream = static_cast<uint32_t>(key[3]);
  return mix32(mix32(lo ^ mix32(hi ^ mix32(stream))) ^ pos);
}

// out[v] = x[v] / t for v in [0, n) (no mask); with AVX-512 16 lanes a step, lanes off `keep` at -inf.
template <typename T>
void scaled(const T* x, int64_t n, float t, float* out, uint32_t keep = 0xFFFFFFFFu) {
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t v = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (!std::is_same_v<T, double>) {
    const __m512 vt = _mm512_set1_ps(t), vinf = _mm512_set1_ps(ninf);
    for (; v + 16 <= n; v += 16) {
      __m512 xv;
      if constexpr (std::is_same_v<T, float>) xv = _mm512_loadu_ps(x + v);
      else if constexpr (std::is_same_v<T, at::BFloat16>) xv = sluice_load_bf16(x + v);
      else xv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + v)));
      const auto k = static_cast<__mmask16>(v < 32 ? keep >> v : 0xFFFFu);  // masked calls take <= 32 tokens
      _mm512_storeu_ps(out + v, _mm512_mask_div_ps(vinf, k, xv, vt));
    }
  }
#endif
  for (; v < n; ++v) out[v] = (keep >> (v & 31)) & 1u ? static_cast<float>(x[v]) / t : ninf;
}

// out[v] = x[v] / t where bits allows v (or v >= vocab, or no bits), -inf elsewhere: one bitmask word (32
// tokens) a step.
template <typename T>
void masked_row(const T* x, int64_t n, const int32_t* bits, int64_t vocab, float t, float* out) {
  int64_t v = 0;
  if (bits != nullptr) {
    const int64_t masked = std::min(n, vocab);
    for (; v < masked; v += 32)
      scaled<T>(x + v, std::min<int64_t>(32, masked - v), t, out + v, static_cast<uint32_t>(bits[v >> 5]));
    v = masked;
  }
  scaled<T>(x + v, n - v, t, out + v);
}

// x[v] (scaled logits) becomes exp(x[v] - max x) / -log(u_v): the race's scores, p_v / E_v up to the softmax's sum.
void race_row(float* x, int64_t n, uint32_t row, float* u) {
  for (int64_t v = 0; v < n; ++v) {
    const uint32_t bits = mix32(mix32(row + static_cast<uint32_t>(v) * 0x9E3779B9u) ^ row);
    u[v] = (static_cast<float>(bits >> 8) + 0.5f) * 0x1p-24f;
  }
  using V = Vectorized<float>;
  const float top = at::vec::reduce_all<float>([](V& a, V& b) { return at::vec::maximum(a, b); }, x, n);
  const V vtop(top);
  at::vec::map2<float>([vtop](V a, V b) { return (a - vtop).exp() / b.log().neg(); }, x, x, u, n);
}

}  // namespace

// logits [R, n] (rows of unit stride; fp32, bf16 or fp16), temps fp32 [R] (<= 0: greedy), keys int64 [R, 4],
// bitmask int32 [B, W], mask_rows int64 [R] -> int64 [R].
torch::Tensor masked_sample(torch::Tensor logits, torch::Tensor temps, torch::Tensor keys, torch::Tensor bitmask,
                            torch::Tensor mask_rows, int64_t mask_vocab) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1, "masked_sample: logits [R, n > 0]");
  const int64_t R = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(temps.dtype() == at::kFloat && temps.is_contiguous() && temps.numel() == R, "masked_sample: temps");
  TORCH_CHECK(keys.dtype() == at::kLong && keys.is_contiguous() && keys.numel() == 4 * R, "masked_sample: keys");
  TORCH_CHECK(bitmask.dtype() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(), "masked_sample: bitmask");
  TORCH_CHECK(mask_rows.dtype() == at::kLong && mask_rows.is_contiguous() && mask_rows.numel() == R,
              "masked_sample: mask_rows");
  const int64_t W = bitmask.size(1), B = bitmask.size(0);
  TORCH_CHECK(mask_vocab <= 32 * W || B == 0, "masked_sample: mask_vocab beyond the bitmask");
  auto out = torch::empty({R}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const float* tp = temps.data_ptr<float>();
  const int64_t *kp = keys.data_ptr<int64_t>(), *mr = mask_rows.data_ptr<int64_t>();
  const int32_t* bm = bitmask.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(mr[r] < B, "masked_sample: mask row out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "masked_sample", [&] {
    const scalar_t* lp = logits.data_ptr<scalar_t>();
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
      std::vector<float> x(n), u(n);
      for (int64_t r = b; r < e; ++r) {
        const float t = tp[r];
        masked_row<scalar_t>(lp + r * ld, n, mr[r] >= 0 ? bm + mr[r] * W : nullptr, mask_vocab, t > 0 ? t : 1.0f,
                             x.data());
        if (t > 0) race_row(x.data(), n, row_hash(kp + 4 * r), u.data());
        o[r] = argmax_row<float>(x.data(), n);
      }
    });
  });
  return out;
}

// This file's Python functions, on the module `m` (its own library's, or cpu_kernels.cpp's submodule "masked_sample").
inline void bind_masked_sample(py::module_& m) {
  m.def("masked_sample", &masked_sample,
        "one token per logits row: grammar bitmask, temperature, keyed exponential race, argmax (CPU)");
}

#ifdef SLUICE_MASKED_SAMPLE_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bind_masked_sample(m); }
#endif
