// Sparse mixture-of-experts SwiGLU experts on CPU, one call per layer: every (token, slot) pair of the top-k routing
// grouped by expert here (a counting sort: no Python per expert or per token), each expert's tokens gathered once,
// then two parallel regions for all experts together: gate and up products with silu(gate) * up over (expert, block
// of expert columns) tasks, and the down products with the routing-weighted combine over blocks of hidden columns
// (each task owns its output columns: no atomics, a fixed sum order). Sums in fp32, the output rounded to the
// activations' dtype once at the end; scratch buffers are the holder's, reused from call to call.
// Weights bf16 or fp32, as the activations. Where the tier has AVX512-BF16 and the experts are bf16, the products
// are `vdpbf16ps` tiles (bf16 pairs, fp32 sums) and silu(gate) * up is rounded to bf16 before the down product, as
// transformers' bf16 experts round it; elsewhere they are register tiles of up to 4 tokens x kRows weight rows over
// the vectors of the tier's width (GCC vector extensions: AVX-512, AVX2 or SSE code from one source, per the
// tier's flags), a bf16 weight widened by a shift as it is loaded, the activations kept in fp32.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512  // at::vec at this file's tier: torch's vectorized exp for silu
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "row_tiles.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include "avx512_reduce.h"
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

#if defined(__AVX512BF16__)
constexpr bool kDpBf16 = true;  // bf16 experts take the vdpbf16ps tiles

#include "bf16_dp_tile.h"

// sums[m * lds + r] = x[m] . w[r] over K for M bf16 rows of x and R bf16 weight rows (both stride K).
template <int M, int R>
inline void dp_tile(const at::BFloat16* x, const at::BFloat16* w, int64_t K, float* sums, int64_t lds) {
  bf16_dp_tile<M, R>(reinterpret_cast<const uint16_t*>(x), K, reinterpret_cast<const uint16_t*>(w), K, sums, lds);
}

// products() for bf16 rows of x against bf16 weight rows: 4 weight rows at a time against the rows four at a time.
void products(const at::BFloat16* x, int64_t n, const at::BFloat16* w, int64_t K, int64_t rows, float* sums,
              int64_t lds) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    sluice_row_tiles<4>(0, n, [&](auto t, int64_t m) {
      dp_tile<decltype(t)::value, 4>(x + m * K, w + r * K, K, sums + m * lds + r, lds);
    });
  }
  for (; r < rows; ++r) {
    sluice_row_tiles<4>(0, n, [&](auto t, int64_t m) {
      dp_tile<decltype(t)::value, 1>(x + m * K, w + r * K, K, sums + m * lds + r, lds);
    });
  }
}
#else
constexpr bool kDpBf16 = false;
#endif

constexpr int64_t kBlock = 32;  // output columns per task (a multiple of every tile's rows)

inline void store(float v, float* p) { *p = v; }
inline void store(float v, at::BFloat16* p) { *p = at::BFloat16(v); }  // round to nearest even

// h[o] = silu(a[o]) * b[o] for o < n <= kBlock (torch's vectorized exp), stored in X.
template <typename X>
inline void silu_mul(const float* a, const float* b, int64_t n, X* h) {
  using fVec = at::vec::Vectorized<float>;
  float tmp[kBlock];
  int64_t o = 0;
  for (; o + fVec::size() <= n; o += fVec::size()) {
    const fVec g = fVec::loadu(a + o);
    (g / (fVec(1.f) + g.neg().exp()) * fVec::loadu(b + o)).store(tmp + o);
  }
  for (; o < n; ++o) tmp[o] = a[o] / (1.f + std::exp(-a[o])) * b[o];
  for (o = 0; o < n; ++o) store(tmp[o], h + o);
}

// The step's (token, slot) pairs grouped by expert (a counting sort, stable: tokens ascending in each expert).
struct Grouping {
  std::vector<int64_t> start;  // [E + 1]: expert e's pairs are [start[e], start[e + 1])
  std::vector<int64_t> token;  // per grouped pair: its token
  std::vector<float> weight;   // per grouped pair: its routing weight
  std::vector<int64_t> active; // the experts with at least one pair, ascending

  void group(const int64_t* ids, const float* weights, int64_t pairs, int64_t k, int64_t E) {
    start.assign(E + 1, 0);
    for (int64_t p = 0; p < pairs; ++p) {
      TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "expert id ", ids[p], " out of range");
      ++start[ids[p] + 1];
    }
    active.clear();
    for (int64_t e = 0; e < E; ++e) {
      if (start[e + 1]) active.push_back(e);
      start[e + 1] += start[e];
    }
    token.resize(pairs);
    weight.resize(pairs);
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t at = next[ids[p]]++;
      token[at] = p / k;
      weight[at] = weights[p];
    }
  }
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "moe_amx.h"
#define SLUICE_MOE_AMX 1
#endif

// One layer's experts over a grouped step, X the type the activations are multiplied in (bf16 for the vdpbf16ps
// tiles, else fp32), W the weights'. x [T, H] (W), acc [T, H] fp32 zeros, out [T, H] (W).
template <typename X, typename W>
struct Layer {
  const std::vector<const W*>& gate;
  const std::vector<const W*>& up;
  const std::vector<const W*>& down;
  int64_t H, I;
  const Grouping& g;
  std::vector<X>& xs;  // [pairs, H] the grouped pairs' tokens
  std::vector<X>& hs;  // [pairs, I] silu(gate) * up per grouped pair

  void gather(const W* x) {
    const int64_t pairs = static_cast<int64_t>(g.token.size());
    xs.resize(pairs * H);
    hs.resize(pairs * I);
    for (int64_t p = 0; p < pairs; ++p) {
      const W* src = x + g.token[p] * H;
      X* dst = xs.data() + p * H;
      if constexpr (std::is_same_v<X, W>) {
        std::memcpy(dst, src, H * sizeof(W));
      } else {
        for (int64_t i = 0; i < H; ++i) dst[i] = widen(src[i]);
      }
    }
  }

  void gate_up() {  // tasks: (active expert, block of kBlock expert columns)
    const int64_t blocks = (I + kBlock - 1) / kBlock, tasks = static_cast<int64_t>(g.active.size()) * blocks;
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> a, b;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t e = g.active[t / blocks], o0 = (t % blocks) * kBlock, rows = std::min(kBlock, I - o0);
        const int64_t p0 = g.start[e], n = g.start[e + 1] - p0;
        a.resize(n * kBlock);
        b.resize(n * kBlock);
        products(xs.data() + p0 * H, n, gate[e] + o0 * H, H, rows, a.data(), kBlock);
        products(xs.data() + p0 * H, n, up[e] + o0 * H, H, rows, b.data(), kBlock);
        for (int64_t j = 0; j < n; ++j) silu_mul(a.data() + j * kBlock, b.data() + j * kBlock, rows,
                                                  hs.data() + (p0 + j) * I + o0);
      }
    });
  }

  void down_combine(float* acc, W* out, int64_t T) {  // tasks: blocks of kBlock hidden columns, every expert
    at::parallel_for(0, (H + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> y;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t o0 = blk * kBlock, rows = std::min(kBlock, H - o0);
        for (const int64_t e : g.active) {
          const int64_t p0 = g.start[e], n = g.start[e + 1] - p0;
          y.resize(n * kBlock);
          products(hs.data() + p0 * I, n, down[e] + o0 * I, I, rows, y.data(), kBlock);
          for (int64_t j = 0; j < n; ++j) {
            float* dst = acc + g.token[p0 + j] * H + o0;
            const float w = g.weight[p0 + j];
            for (int64_t o = 0; o < rows; ++o) dst[o] += w * y[j * kBlock + o];
          }
        }
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t o = 0; o < rows; ++o) out[t * H + o0 + o] = static_cast<W>(acc[t * H + o0 + o]);
        }
      }
    });
  }
};

}  // namespace
// The experts' weights, held once (a call passes only the step's tensors), and the calls' scratch.
struct Experts {
  std::vector<torch::Tensor> gate, up, down;  // per expert: [I, H], [I, H], [H, I], contiguous, one dtype
  int64_t H, I;
  mutable Grouping grouping;
  mutable std::vector<float> acc, xs32, hs32;
  mutable std::vector<at::BFloat16> xs16, hs16;
  mutable std::vector<int64_t> base;  // AMX: each expert's first padded token slot
  bool amx = false;  // bf16 experts of whole multiples of 32 wide, on the AMX tier, where Linux allows the tiles

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
#if defined(SLUICE_MOE_AMX)
    amx = gate[0].scalar_type() == torch::kBFloat16 && H % kBlock == 0 && I % kBlock == 0 && amx::permitted();
#endif
  }

  template <typename W>
  std::vector<const W*> pointers(const std::vector<torch::Tensor>& ws) const {
    std::vector<const W*> out;
    for (const auto& w : ws) out.push_back(w.data_ptr<W>());
    return out;
  }

  template <typename X, typename W>
  void run(const torch::Tensor& x, torch::Tensor& out, std::vector<X>& xs, std::vector<X>& hs) const {
    const auto g = pointers<W>(gate), u = pointers<W>(up), d = pointers<W>(down);
    Layer<X, W> layer{g, u, d, H, I, grouping, xs, hs};
    layer.gather(x.data_ptr<W>());
    layer.gate_up();
    layer.down_combine(acc.data(), out.data_ptr<W>(), x.size(0));
  }

  // x [T, H], ids [T, k] (int64), weights [T, k]: each token's weighted sum over its k experts, x's dtype.
  torch::Tensor forward(const torch::Tensor& x_in, const torch::Tensor& ids, const torch::Tensor& weights) const {
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == H && x_in.scalar_type() == gate[0].scalar_type(),
                "x must be [T, hidden] in the experts' dtype");
    TORCH_CHECK(ids.sizes() == weights.sizes() && ids.size(0) == x_in.size(0), "ids and weights must be [T, k]");
    const torch::Tensor x = x_in.contiguous(), idx = ids.to(torch::kLong).contiguous();
    const torch::Tensor wf = weights.to(torch::kFloat).contiguous();
    const int64_t T = x.size(0), k = ids.size(1);
    grouping.group(idx.data_ptr<int64_t>(), wf.data_ptr<float>(), T * k, k, static_cast<int64_t>(gate.size()));
    acc.assign(T * H, 0.f);
    torch::Tensor out = torch::empty({T, H}, x.options());
    if (x.scalar_type() == torch::kBFloat16) {
#if defined(SLUICE_MOE_AMX)
      if (amx) {
        const auto g = pointers<at::BFloat16>(gate), u = pointers<at::BFloat16>(up), d = pointers<at::BFloat16>(down);
        amx::Layer layer{g, u, d, H, I, grouping, xs16, hs16, base};
        layer.gather(x.data_ptr<at::BFloat16>());
        layer.gate_up();
        layer.down_combine(acc.data(), out.data_ptr<at::BFloat16>(), T);
        return out;
      }
#endif
#if defined(__AVX512BF16__)
      run<at::BFloat16, at::BFloat16>(x, out, xs16, hs16);
#else
      run<float, at::BFloat16>(x, out, xs32, hs32);
#endif
    } else {
      TORCH_CHECK(x.scalar_type() == torch::kFloat, "bf16 or fp32 experts only");
      run<float, float>(x, out, xs32, hs32);
    }
    return out;
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Experts>(m, "Experts", py::module_local())  // one registration per tier's module in a process
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>>(),
           py::arg("gate"), py::arg("up"), py::arg("down"))
      .def("forward", &Experts::forward, "x [T, hidden], ids [T, k], weights [T, k] -> [T, hidden]",
           py::arg("x"), py::arg("ids"), py::arg("weights"))
      .def_readonly("amx", &Experts::amx, "whether this holder's products are AMX tiles")
      .def_property_readonly_static("bf16_products", [](py::object) { return kDpBf16; },
                                    "whether bf16 experts take vdpbf16ps (h rounded to bf16) on this tier");
}
