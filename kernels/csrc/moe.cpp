// Sparse mixture-of-experts SwiGLU experts on CPU: every (token, slot) pair of the top-k routing grouped by
// expert here (no Python per expert or per token), each expert's tokens gathered (fp32, widened once) and its
// weights streamed once for all of them, sums in fp32, the output rounded to the activations' dtype once at the end.
// Weights bf16 or fp32, as the activations. The products are register tiles of up to 4 tokens x kRows weight rows
// over the vectors of the tier's width (GCC vector extensions: AVX-512, AVX2 or SSE code from one source, per
// the tier's flags), a bf16 weight widened by a shift as it is loaded; each tile's sums are reduced once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "row_tiles.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRows = 4;  // weight rows per tile: 4 x 4 accumulators fit AVX-512's 32 registers
#elif defined(__AVX2__)
constexpr int kLanes = 8;
constexpr int kRows = 2;  // 4 x 2 accumulators and the loads fit AVX2's 16
#else
constexpr int kLanes = 4;
constexpr int kRows = 2;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vh __attribute__((vector_size(kLanes * 2)));
typedef uint32_t vu __attribute__((vector_size(kLanes * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf load(const at::BFloat16* p) {  // bf16 widened to fp32: its bits shifted into the high half
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

inline float hsum(vf v) {  // a shuffle tree where the tier has one (a lane-by-lane sum costs as much as the tile)
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512&>(v));
#elif defined(__AVX2__)
  const __m256 y = reinterpret_cast<__m256&>(v);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

// sums[m * lds + r] = x[m] . w[r] over K for M tokens (rows of x, stride K) and R weight rows (stride K).
template <int M, int R, typename W>
inline void tile(const float* x, const W* w, int64_t K, float* sums, int64_t lds) {
  vf acc[M][R] = {};
  int64_t i = 0;
  for (; i + kLanes <= K; i += kLanes) {
    vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load(w + r * K + i);
    for (int m = 0; m < M; ++m) {
      const vf xv = load(x + m * K + i);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t j = i; j < K; ++j) s += x[m * K + j] * widen(w[r * K + j]);
      sums[m * lds + r] = s;
    }
  }
}

// sums[m * lds + r] = x[m] . w[r] for n tokens and weight rows [0, rows): kRows weight rows at a time against
// the tokens four at a time (the weight rows stay in L1 across the token tiles).
template <typename W>
void products(const float* x, int64_t n, const W* w, int64_t K, int64_t rows, float* sums, int64_t lds) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    sluice_row_tiles<4>(0, n, [&](auto t, int64_t m) {
      tile<decltype(t)::value, kRows>(x + m * K, w + r * K, K, sums + m * lds + r, lds);
    });
  }
  for (; r < rows; ++r) {
    sluice_row_tiles<4>(0, n, [&](auto t, int64_t m) {
      tile<decltype(t)::value, 1>(x + m * K, w + r * K, K, sums + m * lds + r, lds);
    });
  }
}

constexpr int64_t kBlock = 32;  // output rows per task (a multiple of every kRows)

struct Group {
  std::vector<int64_t> tokens;
  std::vector<float> weights;
};

// One expert over its tokens: h = silu(x gate^T) * (x up^T), then out[t] += w_t * (h down^T).
template <typename W>
void run_expert(const float* xf, float* out, const Group& g, const W* gate, const W* up, const W* down, int64_t H,
                int64_t I) {
  const int64_t n = static_cast<int64_t>(g.tokens.size());
  std::vector<float> x(n * H), h(n * I);
  for (int64_t j = 0; j < n; ++j) std::memcpy(&x[j * H], xf + g.tokens[j] * H, H * sizeof(float));
  at::parallel_for(0, (I + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> a(n * kBlock), b(n * kBlock);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t o0 = blk * kBlock, rows = std::min(kBlock, I - o0);
      products(x.data(), n, gate + o0 * H, H, rows, a.data(), kBlock);
      products(x.data(), n, up + o0 * H, H, rows, b.data(), kBlock);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t o = 0; o < rows; ++o) {
          const float s = a[j * kBlock + o];
          h[j * I + o0 + o] = s / (1.f + std::exp(-s)) * b[j * kBlock + o];
        }
      }
    }
  });
  at::parallel_for(0, (H + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> y(n * kBlock);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t o0 = blk * kBlock, rows = std::min(kBlock, H - o0);
      products(h.data(), n, down + o0 * I, I, rows, y.data(), kBlock);
      for (int64_t j = 0; j < n; ++j) {
        float* dst = out + g.tokens[j] * H + o0;
        for (int64_t o = 0; o < rows; ++o) dst[o] += g.weights[j] * y[j * kBlock + o];
      }
    }
  });
}

}  // namespace
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
