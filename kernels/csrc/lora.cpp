// LoRA's grouped low-rank products on CPU (the SGMV idea of Punica and S-LoRA): a step's tokens sorted into
// one group per adapter slot (`LoraMapping`, once per step), then per projection each group's shrink
// v = x · A[slot]ᵀ and expand y += scale · v · B[slot]ᵀ, in place on the base linear's output y [T, N].
//
// A is [slots, R, K] and B [slots, N, R], both in the activations' dtype (bf16 or fp32): every product is
// summed in fp32 and y rounded once, at the end. A fused projection (q/k/v, gate/up) has one part per
// checkpoint linear: with `out_splits` (each part's output rows), part p's outputs read only its own rank
// columns [p·R/P, (p + 1)·R/P) of B, the rest of a fused slot's B being zeros the expand need not read.
// Shrink tasks are (group, block of 8 tokens): the block's x rows widened to fp32 once, then each A row is
// read once for its tokens. Expand tasks are (group, block of 64 output rows): 8 B rows at a time widened
// once, each token's 8 sums reduced together by a shuffle tree and added to y as one vector. Every output
// sums its products in one fixed order whatever the threads, so the eager layers and the decode stack (which
// both call `lora_add_groups`) agree bitwise. The AVX2 + FMA code serves the avx2 and avx512 tiers (bf16
// widened by a shift); the generic tier runs the same loops in scalar code.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_LORA_AVX2
#endif

namespace {

#ifdef SLUICE_LORA_AVX2
#include "bf16_avx2.h"
#endif

// A step's tokens grouped by adapter slot: group g is slot[g] over the flat rows
// rows[start[g], start[g + 1]).
struct LoraGroups {
  std::vector<int64_t> rows, start, slot;
  int64_t max_slot = -1;

  bool empty() const { return slot.empty(); }
};

// Group each flat token's slot (int32 or int64 [T]; -1: the base model, no group) in slot order, rows
// ascending.
inline LoraGroups lora_groups_of(const torch::Tensor& token_slots) {
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.device().is_cpu(),
              "lora: token_slots must be a CPU vector");
  const torch::Tensor s = token_slots.to(torch::kLong).contiguous();
  const int64_t* p = s.data_ptr<int64_t>();
  const int64_t n = s.numel();
  LoraGroups g;
  for (int64_t t = 0; t < n; ++t) g.max_slot = std::max(g.max_slot, p[t]);
  if (g.max_slot < 0) return g;
  std::vector<int64_t> count(g.max_slot + 1, 0);
  for (int64_t t = 0; t < n; ++t)
    if (p[t] >= 0) ++count[p[t]];
  std::vector<int64_t> at(g.max_slot + 1, 0);
  int64_t offset = 0;
  for (int64_t slot = 0; slot <= g.max_slot; ++slot) {
    if (count[slot] == 0) continue;
    g.slot.push_back(slot);
    g.start.push_back(offset);
    at[slot] = offset;
    offset += count[slot];
  }
  g.start.push_back(offset);
  g.rows.resize(offset);
  for (int64_t t = 0; t < n; ++t)
    if (p[t] >= 0) g.rows[at[p[t]]++] = t;
  return g;
}

// The step's mapping, set from Python once per step and read by every LoRA projection of the forward (the
// eager layers' and the decode stack's).
struct LoraMapping {
  LoraGroups groups;

  void set(const std::optional<torch::Tensor>& token_slots) {
    groups = token_slots ? lora_groups_of(*token_slots) : LoraGroups{};
  }
  bool active() const { return !groups.empty(); }
};

inline float lora_load(const float* p) { return *p; }
inline float lora_load(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline void lora_store(float* p, float v) { *p = v; }
inline void lora_store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

#ifdef SLUICE_LORA_AVX2
inline __m256 lora_load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 lora_load8(const c10::BFloat16* p) {
  return sluice_bf16x8_ps(reinterpret_cast<const uint16_t*>(p));
}
inline void lora_store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void lora_store8(c10::BFloat16* p, __m256 v) {
  const __m256i r = sluice_round_bf16x8(v);  // bf16 in each lane's low 16 bits: pack them to 8 x 16 bits
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

inline float lora_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The eight sums of a[0..7], as one vector.
inline __m256 lora_hsum8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

// The dot product of n fp32 values: 8 lanes, then the scalar tail (the same order on every call).
inline float lora_dot(const float* a, const float* b, int64_t n) {
  int64_t k = 0;
  float sum = 0.f;
#ifdef SLUICE_LORA_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
  sum = lora_hsum(acc);
#endif
  for (; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

constexpr int64_t kLoraTokenBlock = 8;  // tokens of one shrink task
constexpr int64_t kLoraRowBlock = 64;   // output rows of one expand task

template <typename T>
void lora_widen(const T* src, float* dst, int64_t n) {
  int64_t k = 0;
#ifdef SLUICE_LORA_AVX2
  for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, lora_load8(src + k));
#endif
  for (; k < n; ++k) dst[k] = lora_load(src + k);
}

// v [rows, R] = x[rows] · A[slot]ᵀ for every group's rows, in fp32.
template <typename T>
void lora_shrink(const T* x, int64_t x_stride, const T* a, int64_t R, int64_t K, const LoraGroups& g,
                 float* v) {
  std::vector<int64_t> tasks;  // (group, first row index) pairs, flattened
  for (size_t i = 0; i < g.slot.size(); ++i)
    for (int64_t r = g.start[i]; r < g.start[i + 1]; r += kLoraTokenBlock)
      tasks.insert(tasks.end(), {int64_t(i), r});
  at::parallel_for(0, int64_t(tasks.size() / 2), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(kLoraTokenBlock * K), arow(K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t grp = tasks[2 * t], first = tasks[2 * t + 1];
      const int64_t n = std::min(kLoraTokenBlock, g.start[grp + 1] - first);
      for (int64_t i = 0; i < n; ++i) lora_widen(x + g.rows[first + i] * x_stride, xf.data() + i * K, K);
      const T* ab = a + g.slot[grp] * R * K;
      for (int64_t r = 0; r < R; ++r) {
        lora_widen(ab + r * K, arow.data(), K);
        for (int64_t i = 0; i < n; ++i) v[(first + i) * R + r] = lora_dot(arow.data(), xf.data() + i * K, K);
      }
    }
  });
}

// y[rows] += scale · v[rows] · B[slot]ᵀ for every group; output rows of part p read rank columns
// [p·rp, (p+1)·rp).
template <typename T>
void lora_expand(const float* v, const T* b, int64_t N, int64_t R, const std::vector<int64_t>& part_end,
                 float scale, const LoraGroups& g, T* y, int64_t y_stride) {
  const int64_t rp = R / int64_t(part_end.size());
  const int64_t blocks = (N + kLoraRowBlock - 1) / kLoraRowBlock;
  const int64_t groups = int64_t(g.slot.size());
  at::parallel_for(0, groups * blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> bt(8 * rp);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t grp = t / blocks, n1 = std::min(N, (t % blocks + 1) * kLoraRowBlock);
      const T* bs = b + g.slot[grp] * N * R;
      int64_t n = (t % blocks) * kLoraRowBlock, part = 0;
      while (n < n1) {
        while (part_end[part] <= n) ++part;
        const int64_t tile = std::min({int64_t(8), n1 - n, part_end[part] - n});
        for (int64_t j = 0; j < tile; ++j) lora_widen(bs + (n + j) * R + part * rp, bt.data() + j * rp, rp);
        for (int64_t i = g.start[grp]; i < g.start[grp + 1]; ++i) {
          const float* vi = v + i * R + part * rp;
          T* yi = y + g.rows[i] * y_stride + n;
#ifdef SLUICE_LORA_AVX2
          if (tile == 8) {
            __m256 acc[8];
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
            int64_t c = 0;
            for (; c + 8 <= rp; c += 8) {
              const __m256 vc = _mm256_loadu_ps(vi + c);
              for (int j = 0; j < 8; ++j)
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(bt.data() + j * rp + c), vc, acc[j]);
            }
            __m256 sums = lora_hsum8(acc);
            if (c < rp) {
              alignas(32) float tail[8];
              for (int j = 0; j < 8; ++j) tail[j] = lora_dot(bt.data() + j * rp + c, vi + c, rp - c);
              sums = _mm256_add_ps(sums, _mm256_load_ps(tail));
            }
            lora_store8(yi, _mm256_fmadd_ps(sums, _mm256_set1_ps(scale), lora_load8(yi)));
            continue;
          }
#endif
          for (int64_t j = 0; j < tile; ++j)
            lora_store(yi + j, lora_load(yi + j) + scale * lora_dot(bt.data() + j * rp, vi, rp));
        }
        n += tile;
      }
    }
  });
}

// y [T, N] += scale · x[t] · A[slot]ᵀ · B[slot]ᵀ for each token t of each group; x [T, K], A [S, R, K],
// B [S, N, R] in one dtype (bf16 or fp32), rows of x and y contiguous. out_splits: each part's output rows
// (empty: one part).
inline torch::Tensor lora_add_groups(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& a,
                                     const torch::Tensor& b, const LoraGroups& g, double scale,
                                     const std::vector<int64_t>& out_splits) {
  if (g.empty()) return y;
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && b.dim() == 3,
              "lora_add: x, y [T, *], a, b [S, *, *]");
  const int64_t T = x.size(0), K = x.size(1), S = a.size(0), R = a.size(1), N = b.size(1);
  TORCH_CHECK(y.size(0) == T && y.size(1) == N && a.size(2) == K && b.size(0) == S && b.size(2) == R,
              "lora_add: shapes do not agree (x [T, K], y [T, N], a [S, R, K], b [S, N, R])");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && a.scalar_type() == b.scalar_type() &&
                  b.scalar_type() == y.scalar_type() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat),
              "lora_add: x, y, a and b must share one dtype, bf16 or float32");
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && a.device().is_cpu() && b.device().is_cpu(),
              "lora_add: CPU tensors only");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(),
              "lora_add: x and y need contiguous rows, a and b must be contiguous");
  TORCH_CHECK(g.max_slot < S, "lora_add: slot ", g.max_slot, " of the mapping, but only ", S, " slots");
  TORCH_CHECK(g.rows.empty() || g.rows.back() < T, "lora_add: the mapping has more tokens than x");
  std::vector<int64_t> part_end;
  for (int64_t n : out_splits) part_end.push_back((part_end.empty() ? 0 : part_end.back()) + n);
  if (part_end.empty()) part_end.push_back(N);
  TORCH_CHECK(part_end.back() == N && R % int64_t(part_end.size()) == 0,
              "lora_add: out_splits must sum to N and divide the rank rows evenly");
  std::vector<float> v(T * R);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    lora_shrink(x.data_ptr<T>(), x.stride(0), a.data_ptr<T>(), R, K, g, v.data());
    lora_expand(v.data(), b.data_ptr<T>(), N, R, part_end, float(scale), g, y.data_ptr<T>(), y.stride(0));
  };
  if (x.scalar_type() == torch::kBFloat16) {
    run(c10::BFloat16());
  } else {
    run(float());
  }
  return y;
}

// This file's Python functions, on the module `m` (cpu_kernels.cpp's submodule "lora").
inline void bind_lora(py::module_& m) {
  // module_local: each tier's object registers its own types, so a process (a test) may load several tiers
  py::class_<LoraMapping, std::shared_ptr<LoraMapping>>(m, "LoraMapping", py::module_local())
      .def(py::init<>())
      .def("set", &LoraMapping::set,
           "each flat token's slot (-1: none) for the coming forward; None: no adapter",
           py::arg("token_slots"))
      .def_property_readonly("active", &LoraMapping::active);
  m.def("lora_add", [](torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b,
                       torch::Tensor token_slots, double scale, std::vector<int64_t> out_splits) {
    return lora_add_groups(std::move(y), x, a, b, lora_groups_of(token_slots), scale, out_splits);
  }, "y += scale * x[t] A[slot]^T B[slot]^T per token of slot token_slots[t] >= 0, in place",
        py::arg("y"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("token_slots"),
        py::arg("scale") = 1.0, py::arg("out_splits") = std::vector<int64_t>{},
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_add_mapped", [](torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b,
                              const LoraMapping& mapping, double scale, std::vector<int64_t> out_splits) {
    return lora_add_groups(std::move(y), x, a, b, mapping.groups, scale, out_splits);
  }, "lora_add over a LoraMapping's groups (the step's, set once)", py::arg("y"), py::arg("x"), py::arg("a"),
        py::arg("b"), py::arg("mapping"), py::arg("scale") = 1.0,
        py::arg("out_splits") = std::vector<int64_t>{}, py::call_guard<py::gil_scoped_release>());
}

}  // namespace
