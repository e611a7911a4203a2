// Bidirectional attention of unpadded sequences laid back to back (an encoder's layers, a vision tower's
// images): every query row of a sequence attends every key of that sequence, with no padding and no mask. A
// unit is one head's block of kQBlock query rows of one sequence. Its thread transposes that head's keys of the
// sequence into [D][n] once (kept while its next unit is the same head of the same sequence), so the scores of
// kRows query rows against a vector of keys are broadcast FMAs with no reductions; the rows' scores over all n
// keys sit in L2, take the exact softmax (max, exp, sum) and weigh the value rows, kRows rows sharing each
// value load. Units are shared among the threads by their cost (rows x keys). Rotary positions (a vision
// tower's: cos and sin per token, the same for every head) are applied to q and k as they are read:
// x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) of x's halves, rounded to the input's dtype as
// transformers rounds its rotated q and k. fp32, bf16 and fp16 inputs; the arithmetic is fp32 throughout (a
// head's values converted once per sequence beside its keys), the output rounded once.
#pragma once
#include "paged_attention.cpp"

namespace varlen {

constexpr int64_t kQBlock = 64;  // query rows per unit
constexpr int64_t kW = Vec::size();
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRows = 8;  // rows scored and summed together: 16 of the 32 vector registers accumulate
#else
constexpr int kRows = 4;  // AVX2 has 16 registers
#endif

template <typename T>
struct Heads {  // a [T, H, D] tensor's rows: token t, head h at base + t * stride + h * D
  T* base;
  int64_t stride, D;
  T* at(int64_t t, int64_t h) const { return base + t * stride + h * D; }
};

struct Rotary {  // cos and sin [T, D] (null: none)
  const float* cos;
  const float* sin;
};

// dst[d * dst_stride] = src[d] * scale, src rotated first (and rounded to T) where r has positions (token t's).
template <typename T>
static inline void read_row(const T* src, const Rotary& r, int64_t t, int64_t D, float scale, float* dst,
                            int64_t dst_stride) {
  if (!r.cos) {
    for (int64_t d = 0; d < D; ++d) dst[d * dst_stride] = static_cast<float>(src[d]) * scale;
    return;
  }
  const float *c = r.cos + t * D, *s = r.sin + t * D;
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float turned = d < half ? -static_cast<float>(src[d + half]) : static_cast<float>(src[d - half]);
    const float x = static_cast<float>(src[d]) * c[d] + turned * s[d];
    dst[d * dst_stride] = static_cast<float>(static_cast<T>(x)) * scale;
  }
}

struct Scratch {
  std::vector<float> kt, vf, s, q;
  int64_t t0 = -1, h = -1;  // whose keys and values kt and vf hold
};

static inline int64_t padded(int64_t n) { return (n + 2 * kW - 1) / (2 * kW) * (2 * kW); }

// kt [D][np] = head h's keys of tokens [t0, t0 + n), zero past n; vf [n][D] = its values, in fp32.
template <typename T>
static void load_head(const Heads<T>& k, const Heads<T>& v, const Rotary& rot, int64_t t0, int64_t n, int64_t h,
                      Scratch& sc) {
  const int64_t np = padded(n), D = k.D;
  sc.kt.assign(D * np, 0.f);
  sc.vf.resize(n * D);
  for (int64_t j = 0; j < n; ++j) {
    read_row(k.at(t0 + j, h), rot, t0 + j, D, 1.f, sc.kt.data() + j, np);
    const T* row = v.at(t0 + j, h);
    for (int64_t d = 0; d < D; ++d) sc.vf[j * D + d] = static_cast<float>(row[d]);
  }
  sc.t0 = t0, sc.h = h;
}

// s [R][np] = q [R][D] (scaled) times kt [D][np], two vectors of keys at a time.
template <int R>
static void score_rows(const float* q, const float* kt, int64_t np, int64_t D, float* s) {
  for (int64_t j = 0; j < np; j += 2 * kW) {
    Vec a[R], b[R];
    for (int r = 0; r < R; ++r) a[r] = Vec(0.f), b[r] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const Vec k0 = Vec::loadu(kt + d * np + j), k1 = Vec::loadu(kt + d * np + j + kW);
      for (int r = 0; r < R; ++r) {
        const Vec x(q[r * D + d]);
        a[r] = at::vec::fmadd(x, k0, a[r]);
        b[r] = at::vec::fmadd(x, k1, b[r]);
      }
    }
    for (int r = 0; r < R; ++r) a[r].store(s + r * np + j), b[r].store(s + r * np + j + kW);
  }
}

// A row's n scores (the rest of its np set to -inf) to exp(score - max) in place; returns their sum.
static float softmax_row(float* s, int64_t n, int64_t np) {
  std::fill(s + n, s + np, -std::numeric_limits<float>::infinity());
  Vec top(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < np; j += kW) top = at::vec::maximum(top, Vec::loadu(s + j));
  const Vec m(at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, top));
  Vec sum(0.f);
  for (int64_t j = 0; j < np; j += kW) {
    const Vec e = (Vec::loadu(s + j) - m).exp_u20();
    e.store(s + j);
    sum = sum + e;
  }
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
}

template <typename T>
static inline void store(const Vec& x, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    x.store(dst);
  } else {
    alignas(64) float tmp[kW];
    x.store(tmp);
    for (int64_t i = 0; i < kW; ++i) dst[i] = static_cast<T>(tmp[i]);
  }
}

// out rows [R] columns [d0, d0 + NV * kW) = inv[r] * sum over j of s[r][j] * vf[j].
template <int R, int NV, typename T>
static void weigh_values(const float* s, int64_t np, int64_t n, const float* vf, int64_t D, int64_t d0,
                         const float* inv, T* const* out) {
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec(0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* row = vf + j * D + d0;
    Vec x[NV];
    for (int c = 0; c < NV; ++c) x[c] = Vec::loadu(row + c * kW);
    for (int r = 0; r < R; ++r) {
      const Vec p(s[r * np + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(p, x[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store(acc[r][c] * Vec(inv[r]), out[r] + d0 + c * kW);
}

template <typename T>
struct Job {  // what a unit's rows read and write
  Heads<T> q;
  Rotary rot;
  T* out;
  int64_t ostride;
  float scale;
};

// R query rows starting at token t0 + i of the sequence [t0, t0 + n), head h, into jb.out.
template <int R, typename T>
static void attend_rows(const Job<T>& jb, int64_t t0, int64_t n, int64_t i, int64_t h, Scratch& sc) {
  const Heads<T>& q = jb.q;
  const int64_t np = padded(n), D = q.D;
  sc.q.resize(R * D);
  sc.s.resize(R * np);
  T* out[R];
  float inv[R];
  for (int r = 0; r < R; ++r) {
    read_row(q.at(t0 + i + r, h), jb.rot, t0 + i + r, D, jb.scale, sc.q.data() + r * D, 1);
    out[r] = jb.out + (t0 + i + r) * jb.ostride + h * D;
  }
  score_rows<R>(sc.q.data(), sc.kt.data(), np, D, sc.s.data());
  for (int r = 0; r < R; ++r) inv[r] = 1.f / softmax_row(sc.s.data() + r * np, n, np);
  int64_t d0 = 0;
  for (; d0 + 2 * kW <= D; d0 += 2 * kW) weigh_values<R, 2>(sc.s.data(), np, n, sc.vf.data(), D, d0, inv, out);
  if (d0 < D) weigh_values<R, 1>(sc.s.data(), np, n, sc.vf.data(), D, d0, inv, out);
}

template <int R, typename T>
static void attend_block(const Job<T>& jb, int64_t t0, int64_t n, int64_t i0, int64_t i1, int64_t h,
                         Scratch& sc) {
  int64_t i = i0;
  for (; i + R <= i1; i += R) attend_rows<R>(jb, t0, n, i, h, sc);
  if constexpr (R > 1) {
    if (i < i1) attend_block<R / 2>(jb, t0, n, i, i1, h, sc);
  }
}

struct Unit {
  int64_t t0, n, i0, i1, h;
};

template <typename T>
static void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& out,
                const Rotary& rot, const std::vector<Unit>& units, const std::vector<double>& cost, float scale) {
  const int64_t D = q.size(2);
  const Heads<T> hk{k.data_ptr<T>(), k.stride(0), D}, hv{v.data_ptr<T>(), v.stride(0), D};
  const Job<T> jb{{q.data_ptr<T>(), q.stride(0), D}, rot, out.data_ptr<T>(), out.stride(0), scale};
  balanced<Scratch>(cost, [&](size_t x, Scratch& scratch) {
    const Unit& u = units[x];
    if (scratch.t0 != u.t0 || scratch.h != u.h) load_head(hk, hv, rot, u.t0, u.n, u.h, scratch);
    attend_block<kRows>(jb, u.t0, u.n, u.i0, u.i1, u.h, scratch);
  });
}

}  // namespace varlen

// out [T, H, D] (row stride out.stride(0)) = softmax(q kᵀ * scale) v within each sequence [cu[s], cu[s + 1]);
// q, k, v: [T, H, D] views of one dtype (fp32, bf16, fp16) whose heads lie D apart and whose rows may be strided (a fused qkv's thirds);
// cos, sin: [T, D] rotary positions applied to q and k, or none.
void varlen_attention_cpu(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                          torch::Tensor cu_seqlens, double scale, std::optional<torch::Tensor> cos,
                          std::optional<torch::Tensor> sin) {
  using varlen::kQBlock, varlen::kW, varlen::padded;
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "q: float32, bf16 or fp16");
  for (const torch::Tensor* t : {&q, &k, &v, &out}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == dtype, "q, k, v, out: [T, H, D] of one dtype");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "heads must lie D apart, D contiguous");
    TORCH_CHECK(t->sizes() == q.sizes(), "q, k, v and out differ in shape");
  }
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous(), "cu_seqlens: int64");
  const int64_t H = q.size(1), D = q.size(2), S = cu_seqlens.size(0) - 1;
  TORCH_CHECK(D % kW == 0, "head dim must be a multiple of ", kW);
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(S >= 0 && cu[0] == 0 && cu[S] == q.size(0), "cu_seqlens must run from 0 to T");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "rotary positions need both cos and sin");
  varlen::Rotary rot{nullptr, nullptr};
  if (cos) {
    for (const torch::Tensor* t : {&*cos, &*sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == q.size(0)
                      && t->size(1) == D && D % 2 == 0, "cos, sin: [T, D] float32, contiguous, D even");
    rot = {cos->data_ptr<float>(), sin->data_ptr<float>()};
  }
  std::vector<varlen::Unit> units;
  std::vector<double> cost;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = cu[s + 1] - cu[s];
    TORCH_CHECK(n >= 0, "cu_seqlens must not decrease");
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; i += kQBlock) {
        units.push_back({cu[s], n, i, std::min(n, i + kQBlock), h});
        cost.push_back(double(std::min(n, i + kQBlock) - i) * double(padded(n) + D));
      }
  }
  const float sc = static_cast<float>(scale);
  if (dtype == at::kFloat)
    varlen::run<float>(q, k, v, out, rot, units, cost, sc);
  else if (dtype == at::kBFloat16)
    varlen::run<at::BFloat16>(q, k, v, out, rot, units, cost, sc);
  else
    varlen::run<at::Half>(q, k, v, out, rot, units, cost, sc);
}

// This file's Python functions, on the module `m` (cpu_kernels.cpp's submodule "varlen_attention").
inline void bind_varlen_attention(py::module_& m) {
  m.def("varlen_attention_cpu", &varlen_attention_cpu,
        "Bidirectional attention within each of the sequences laid back to back (no padding, no mask), "
        "rotary positions applied to q and k where cos and sin are given",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("cu_seqlens"), py::arg("scale"),
        py::arg("cos") = py::none(), py::arg("sin") = py::none());
  m.attr("HEAD_DIM_MULTIPLE") = varlen::kW;
}
