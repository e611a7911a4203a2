// Fused residual add + RMSNorm on CPU, rounding like HF's LlamaRMSNorm: out = w * dtype(x * rsqrt(mean(x^2) + eps)).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

template <typename T>
static void norm_rows(const T* x, const T* delta, T* sum, const T* w, T* out, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(D);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      double ss = 0.0;  // near-exact, as close as we can get to torch's vectorized fp32 sum of squares
      for (int64_t d = 0; d < D; ++d) {
        float v = static_cast<float>(xr[d]);
        if (delta != nullptr) {
          const T s = static_cast<T>(v + static_cast<float>(delta[r * D + d]));  // rounded like `x + delta`
          sum[r * D + d] = s;
          v = static_cast<float>(s);
        }
        buf[d] = v;
        ss += static_cast<double>(v * v);
      }
      const float inv = 1.f / std::sqrt(static_cast<float>(ss) / static_cast<float>(D) + eps);
      T* o = out + r * D;
      for (int64_t d = 0; d < D; ++d)
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "fused residual add + RMSNorm (CPU)");
}
