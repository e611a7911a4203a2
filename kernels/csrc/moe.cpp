// Sparse mixture-of-experts SwiGLU experts on CPU: every (token, slot) pair of the top-k routing grouped by
// expert here (no Python per expert or per token), each expert's weight rows streamed once for all of its tokens,
// sums in fp32 (activations widened once), the output rounded to the activations' dtype once at the end.
// Weights bf16 or fp32, as the activations; a weight row's bf16 values are widened by a shift inside the dot.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

template <typename W>
static inline float dot(const float* x, const W* w, int64_t n) {
  float acc = 0.f;
  if constexpr (std::is_same_v<W, at::BFloat16>) {
    const uint16_t* b = reinterpret_cast<const uint16_t*>(w);
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(b[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      acc += x[i] * f;
    }
  } else {
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += x[i] * w[i];
  }
  return acc;
}

struct Group {
  std::vector<int64_t> tokens;
  std::vector<float> weights;
};

// One expert over its tokens: h = silu(x gate^T) * (x up^T), then out[t] += w_t * (h down^T).
template <typename W>
static void run_expert(const float* x, float* out, const Group& g, const W* gate, const W* up, const W* down,
                       int64_t H, int64_t I) {
  const int64_t n = static_cast<int64_t>(g.tokens.size());
  std::vector<float> h(n * I);
  at::parallel_for(0, I, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t j = 0; j < n; ++j) {
        const float* xr = x + g.tokens[j] * H;
        const float a = dot(xr, gate + o * H, H), b = dot(xr, up + o * H, H);
        h[j * I + o] = a / (1.f + std::exp(-a)) * b;
      }
    }
  });
  at::parallel_for(0, H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t j = 0; j < n; ++j) out[g.tokens[j] * H + o] += g.weights[j] * dot(h.data() + j * I, down + o * I, I);
    }
  });
}

// The experts' weights, held once (a call passes only the step's tensors).
struct Experts {
  std::vector<torch::Tensor> gate, up, down;  // per expert: [I, H], [I, H], [H, I], contiguous, one dtype
  int64_t H, I;

  Experts(std::vector<torch::Tensor> g, std::vector<torch::Tensor> u, std::vector<torch::Tensor> d)
      : gate(std::move(g)), up(std::move(u)), down(std::move(d)) {
    TORCH_CHECK(!gate.empty() && gate.size() == up.size() && gate.size() == down.size(), "one gate/up/down per expert");
    I = gate[0].size(0);
    H = gate[0].size(1);
    for (size_t e = 0; e < gate.size(); ++e) {
      for (auto* t : {&gate[e], &up[e], &down[e]}) {
        TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->scalar_type() == gate[0].scalar_type(),
                    "expert weights must be contiguous CPU tensors of one dtype");
      }
      TORCH_CHECK(gate[e].sizes() == up[e].sizes() && gate[e].size(0) == I && gate[e].size(1) == H &&
                      down[e].size(0) == H && down[e].size(1) == I, "expert ", e, " has other shapes");
    }
  }

  // x [T, H], ids [T, k] (int64), weights [T, k]: each token's weighted sum over its k experts, x's dtype.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H && x.scalar_type() == gate[0].scalar_type(), "x must be [T, hidden]");
    TORCH_CHECK(ids.sizes() == weights.sizes() && ids.size(0) == x.size(0), "ids and weights must be [T, k]");
    const torch::Tensor xf = x.to(torch::kFloat).contiguous(), idx = ids.to(torch::kLong).contiguous();
    const torch::Tensor wf = weights.to(torch::kFloat).contiguous();
    const int64_t T = x.size(0), k = ids.size(1), E = static_cast<int64_t>(gate.size());
    std::vector<Group> groups(E);
    for (int64_t p = 0; p < T * k; ++p) {
      const int64_t e = idx.data_ptr<int64_t>()[p];
      TORCH_CHECK(e >= 0 && e < E, "expert id ", e, " out of range");
      groups[e].tokens.push_back(p / k);
      groups[e].weights.push_back(wf.data_ptr<float>()[p]);
    }
    torch::Tensor out = torch::zeros({T, H}, xf.options());
    for (int64_t e = 0; e < E; ++e) {
      if (groups[e].tokens.empty()) continue;
      if (x.scalar_type() == torch::kBFloat16) {
        run_expert(xf.data_ptr<float>(), out.data_ptr<float>(), groups[e], gate[e].data_ptr<at::BFloat16>(),
                   up[e].data_ptr<at::BFloat16>(), down[e].data_ptr<at::BFloat16>(), H, I);
      } else {
        TORCH_CHECK(x.scalar_type() == torch::kFloat, "bf16 or fp32 experts only");
        run_expert(xf.data_ptr<float>(), out.data_ptr<float>(), groups[e], gate[e].data_ptr<float>(),
                   up[e].data_ptr<float>(), down[e].data_ptr<float>(), H, I);
      }
    }
    return out.to(x.scalar_type());
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Experts>(m, "Experts", py::module_local())  // one registration per tier's module in a process
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>>(),
           py::arg("gate"), py::arg("up"), py::arg("down"))
      .def("forward", &Experts::forward, "x [T, hidden], ids [T, k], weights [T, k] -> [T, hidden]",
           py::arg("x"), py::arg("ids"), py::arg("weights"));
}
