// Fused residual add + RMSNorm on CPU, rounding like HF's LlamaRMSNorm: out = w * dtype(x * rsqrt(mean(x^2) + eps)).
// bf16/fp16 rows go 32 elements at a time through at::vec (fp32 math, round-to-nearest-even casts back), with
// the sum of squares in fp32 lanes as torch's own vectorized reduction keeps it; other dtypes and tails are
// scalar loops.
#pragma once
#include "cpu_capability.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <vector>

using Vec = at::vec::Vectorized<float>;

template <typename T>
static void norm_rows(const T* x, const T* delta, T* sum, const T* w, T* out, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(D);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      int64_t d = 0;
      float ss = 0.f;
      if constexpr (at::vec::is_reduced_floating_point_v<T>) {
        using TVec = at::vec::Vectorized<T>;
        constexpr int64_t n = TVec::size();  // 2 * Vec::size()
        Vec acc0(0.f), acc1(0.f);
        for (; d + n <= D; d += n) {
          auto [a, b] = at::vec::convert_to_float<T>(TVec::loadu(xr + d));
          if (delta != nullptr) {
            auto [da, db] = at::vec::convert_to_float<T>(TVec::loadu(delta + r * D + d));
            const TVec s = at::vec::convert_from_float<T>(a + da, b + db);  // rounded like `x + delta`
            s.store(sum + r * D + d);
            std::tie(a, b) = at::vec::convert_to_float<T>(s);
          }
          a.store(buf.data() + d);
          b.store(buf.data() + d + Vec::size());
          acc0 = at::vec::fmadd(a, a, acc0);
          acc1 = at::vec::fmadd(b, b, acc1);
        }
        ss = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc0 + acc1);
      }
      for (; d < D; ++d) {
        float v = static_cast<float>(xr[d]);
        if (delta != nullptr) {
          const T s = static_cast<T>(v + static_cast<float>(delta[r * D + d]));  // rounded like `x + delta`
          sum[r * D + d] = s;
          v = static_cast<float>(s);
        }
        buf[d] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      T* o = out + r * D;
      d = 0;
      if constexpr (at::vec::is_reduced_floating_point_v<T>) {
        using TVec = at::vec::Vectorized<T>;
        constexpr int64_t n = TVec::size();
        const Vec f(inv);
        for (; d + n <= D; d += n) {
          // w * dtype(x * inv): the normalised row is rounded to the dtype before the weight multiplies
          auto [na, nb] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(
              Vec::loadu(buf.data() + d) * f, Vec::loadu(buf.data() + d + Vec::size()) * f));
          auto [wa, wb] = at::vec::convert_to_float<T>(TVec::loadu(w + d));
          at::vec::convert_from_float<T>(wa * na, wb * nb).store(o + d);
        }
      }
      for (; d < D; ++d)
        o[d] = static_cast<T>(static_cast<float>(w[d]) * static_cast<float>(static_cast<T>(buf[d] * inv)));
    }
  });
}

// Returns (x + delta, norm(x + delta)) when delta is given, else (x, norm(x)).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w,
                                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous(), "x [T, D] and w [D] must be contiguous");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.size(0) == x.size(1), "w must match x's dtype and width");
  auto out = torch::empty_like(x);
  torch::Tensor sum = x;
  const bool has_delta = delta.has_value();
  if (has_delta) {
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), "delta must match x");
    sum = torch::empty_like(x);
  }
  torch::Tensor d = has_delta ? delta->contiguous() : x;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), has_delta ? d.data_ptr<scalar_t>() : nullptr,
                        sum.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                        x.size(1), static_cast<float>(eps));
  });
  return {sum, out};
}

// This file's Python functions, on the module `m` (its own library's, or cpu_kernels.cpp's submodule "rms_norm").
inline void bind_rms_norm(py::module_& m) {
  m.def("add_rms_norm", &add_rms_norm, "fused residual add + RMSNorm (CPU)");
}

#ifndef SLUICE_NO_MODULE  // built alone (decode_stack.cpp and cpu_kernels.cpp include it without its module)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bind_rms_norm(m); }
#endif
