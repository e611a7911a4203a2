// Fused elementwise steps of a decoder layer on CPU, rounding exactly like the torch ops they replace:
//   rope_qk:  q, k = x * cos + rotate_half(x) * sin for the query and key heads of a fused qkv row (HF's
//             apply_rotary_pos_emb, each product and the sum rounded to the activations' dtype), written as
//             contiguous [T, H, D] / [T, Hkv, D] tensors in one pass;
//   silu_mul: silu(gate) * up of a fused gate_up row, silu rounded before the product, as torch does.
//   store_kv: this step's keys and values [T, Hkv, D] (rows may be strided, as v is inside qkv) copied to
//             their slots of the [Hkv, blocks, block, D] caches in one call (in place of two index_copy_
//             and their views a layer);
//   argmax:   the index of each row's first maximum (the first NaN where a row has one), as x.max(-1).indices
//             gives it (torch's reduction reads a wide vocabulary row slowly: docs/benchmarks.md,
//             decode_steps).
// at::vec with the CPU capability this file is compiled for gives torch's own vectorized math (Sleef exp).
#pragma once
#include "cpu_capability.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(CPU_CAPABILITY_AVX512)
#include "avx512_reduce.h"
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

using at::vec::Vectorized;

template <typename T>
static inline T round_to(float v) { return static_cast<T>(v); }

// One head: out[i] = T(T(x[i] * c[i]) + T(r[i] * s[i])), r = rotate_half(x) = (-x[h:], x[:h]).
template <typename T>
static void rope_head(const T* x, const T* c, const T* s, T* out, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float xi = static_cast<float>(x[i]);
    const float ri = i < h ? -static_cast<float>(x[i + h]) : static_cast<float>(x[i - h]);
    const T a = round_to<T>(xi * static_cast<float>(c[i]));
    const T b = round_to<T>(ri * static_cast<float>(s[i]));
    out[i] = round_to<T>(static_cast<float>(a) + static_cast<float>(b));
  }
}

// qkv [T, NH + 2 NK, D] (rows may be strided), cos/sin [T, D] -> (q [T, NH, D], k [T, NK, D]) contiguous.
std::vector<torch::Tensor> rope_qk(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t nh, int64_t nk) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2), "qkv [T, heads, D] rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == qkv.size(2),
              "cos/sin must be contiguous [T, D]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "dtypes differ");
  TORCH_CHECK(qkv.size(2) % 2 == 0 && nh + nk <= qkv.size(1), "bad head counts");
  const int64_t T = qkv.size(0), D = qkv.size(2), row = qkv.stride(0);
  auto q = torch::empty({T, nh, D}, qkv.options());
  auto k = torch::empty({T, nk, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_qk", [&] {
    const scalar_t* x = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    scalar_t* qo = q.data_ptr<scalar_t>();
    scalar_t* ko = k.data_ptr<scalar_t>();
    const int64_t heads = nh + nk;
    at::parallel_for(0, T * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t t = w / heads, hd = w % heads;
        scalar_t* dst = hd < nh ? qo + (t * nh + hd) * D : ko + (t * nk + hd - nh) * D;
        rope_head<scalar_t>(x + t * row + hd * D, c + t * D, s + t * D, dst, D);
      }
    });
  });
  return {q, k};
}

template <typename T>
static void silu_mul_row(const T* g, const T* u, T* out, int64_t n) {
  using fVec = Vectorized<float>;
  const fVec one(1.f);
  int64_t i = 0;
  if constexpr (at::vec::is_reduced_floating_point_v<T>) {  // 32 at a time, conversions vectorized too
    using TVec = Vectorized<T>;
    for (; i + TVec::size() <= n; i += TVec::size()) {
      auto [g0, g1] = at::vec::convert_to_float<T>(TVec::loadu(g + i));
      auto [u0, u1] = at::vec::convert_to_float<T>(TVec::loadu(u + i));
      auto [s0, s1] = at::vec::convert_to_float<T>(
          at::vec::convert_from_float<T>(g0 / (one + g0.neg().exp()), g1 / (one + g1.neg().exp())));
      at::vec::convert_from_float<T>(s0 * u0, s1 * u1).store(out + i);
    }
  }
  for (; i + fVec::size() <= n; i += fVec::size()) {
    float gb[fVec::size()], ub[fVec::size()];
    for (int64_t j = 0; j < fVec::size(); ++j) {
      gb[j] = static_cast<float>(g[i + j]);
      ub[j] = static_cast<float>(u[i + j]);
    }
    const fVec x = fVec::loadu(gb);
    fVec sil = x / (one + x.neg().exp());
    float sb[fVec::size()];
    sil.store(sb);
    for (int64_t j = 0; j < fVec::size(); ++j)
      out[i + j] = round_to<T>(static_cast<float>(round_to<T>(sb[j])) * ub[j]);
  }
  for (; i < n; ++i) {
    const float x = static_cast<float>(g[i]);
    const T sl = round_to<T>(x / (1.f + std::exp(-x)));
    out[i] = round_to<T>(static_cast<float>(sl) * static_cast<float>(u[i]));
  }
}

// gate_up [T, 2I] (rows may be strided) -> silu(gate) * up [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "gate_up [T, 2I] rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, row = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* x = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t chunk = 512;  // columns per work item: rows of a big batch and column chunks of a small one
    const int64_t per_row = (I + chunk - 1) / chunk;
    at::parallel_for(0, T * per_row, 16, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t t = w / per_row, c0 = (w % per_row) * chunk, n = std::min(chunk, I - c0);
        silu_mul_row<scalar_t>(x + t * row + c0, x + t * row + I + c0, o + t * I + c0, n);
      }
    });
  });
  return out;
}

void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.dim() == 4, "caches [Hkv, blocks, block, D], contiguous");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2), "k, v [T, Hkv, D] with contiguous heads");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "k, v and caches in one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0) &&
              slots.is_contiguous(), "slots int64 [T]");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t capacity = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == H && k_cache.size(3) == D, "cache heads/dim differ from k's");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot out of range");
  const int64_t bytes = D * k.element_size();
  auto kc = static_cast<char*>(k_cache.data_ptr()), vc = static_cast<char*>(v_cache.data_ptr());
  auto ks = static_cast<const char*>(k.data_ptr()), vs = static_cast<const char*>(v.data_ptr());
  const int64_t krow = k.stride(0) * k.element_size(), vrow = v.stride(0) * v.element_size();
  at::parallel_for(0, T * H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / H, h = w % H, dst = (h * capacity + slot[t]) * bytes;
      std::memcpy(kc + dst, ks + t * krow + h * bytes, bytes);
      std::memcpy(vc + dst, vs + t * vrow + h * bytes, bytes);
    }
  });
}

// Index of the first maximum of row x [n] (the first NaN if any): a pass for the maximum (NaNs flagged on the
// way), a second for its first position.
template <typename T>
static int64_t argmax_row(const T* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  auto load = [&](int64_t k, __mmask16 mask) -> __m512 {
    if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(mask, x + k);
    else if constexpr (std::is_same_v<T, at::BFloat16>) return sluice_load_bf16(x + k, mask);
    else return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, x + k));
  };
  __m512 vmax = _mm512_set1_ps(top);
  __mmask16 unordered = 0;
  for (; i < n; i += 16) {
    const __mmask16 mask = sluice_tail16(n - i);
    const __m512 v = _mm512_mask_mov_ps(vmax, mask, load(i, mask));  // masked-off lanes keep the max
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  if (unordered == 0) {  // with a NaN, the loop after this block finds the first
    const __m512 t = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    for (i = 0; i < n; i += 16) {
      const __mmask16 mask = sluice_tail16(n - i);
      const __mmask16 hit = _mm512_mask_cmp_ps_mask(mask, load(i, mask), t, _CMP_EQ_OQ);
      if (hit) return i + __builtin_ctz(hit);
    }
  }
#else
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    top = std::max(top, v);
  }
  for (i = 0; i < n; ++i)
    if (static_cast<float>(x[i]) == top) return i;
#endif
  for (i = 0; i < n; ++i)  // a NaN (or nothing matched: not reached for n > 0)
    if (std::isnan(static_cast<float>(x[i]))) return i;
  return 0;
}

// x [R, n] (contiguous rows; fp32, bf16 or fp16) -> int64 [R]: x.max(-1).indices.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, "argmax_rows: contiguous x [rows, n > 0]");
  const int64_t R = x.size(0), n = x.size(1);
  auto out = torch::empty({R}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "argmax_rows: fp32, bf16 or fp16");
    } else {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      at::parallel_for(0, R, std::max<int64_t>(1, 65536 / n), [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) o[r] = argmax_row<scalar_t>(xp + r * n, n);
      });
    }
  });
  return out;
}

// This file's Python functions, on the module `m` (its own library's, or cpu_kernels.cpp's submodule "elementwise").
inline void bind_elementwise(py::module_& m) {
  m.def("store_kv", &store_kv, "keys/values [T, Hkv, D] to their slots of the paged caches (CPU)");
  m.def("rope_qk", &rope_qk, "rotary embedding of the q and k heads of a fused qkv projection (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up projection (CPU)");
  m.def("argmax_rows", &argmax_rows, "each row's first maximum (first NaN), as x.max(-1).indices (CPU)");
}

#ifndef SLUICE_NO_MODULE  // built alone (decode_stack.cpp and cpu_kernels.cpp include it without its module)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bind_elementwise(m); }
#endif
