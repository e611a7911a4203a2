// A decode step's whole decoder stack in one call: per layer the same kernels, in the same order, that
// engine/models/llama.py's DecoderLayer calls one by one from Python (add_rms_norm, bf16_gemv, rope_qk,
// store_kv, paged_attention_cpu, silu_mul), so the results are bitwise the layers', without the ~0.1 ms a layer
// that ~10 calls from Python (module __call__, dispatch checks, views) cost.
// The kernels' sources are included whole; elementwise.cpp first, as it sets CPU_CAPABILITY before any ATen
// vector header is read.
#define SLUICE_NO_MODULE
#include "elementwise.cpp"
#include "rms_norm.cpp"
#include "paged_attention.cpp"
#include "bf16_gemv.cpp"

#include <optional>
#include <tuple>
#include <vector>

struct LayerWeights {
  torch::Tensor input_norm, qkv;
  std::optional<torch::Tensor> qkv_bias;
  torch::Tensor o, post_norm, gate_up, down, k_cache, v_cache;
};

class DecodeStack {
 public:
  // Each layer: input norm, qkv weight, qkv bias or None, o weight, post-attention norm, gate_up weight, down
  // weight, key cache, value cache (held, not copied: the stack sees later writes to them).
  DecodeStack(const std::vector<std::vector<std::optional<torch::Tensor>>>& layers, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : nh_(num_heads), nk_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale) {
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 9, "DecodeStack: 9 tensors a layer");
      for (size_t i = 0; i < 9; ++i) TORCH_CHECK(i == 2 || t[i].has_value(), "DecodeStack: only the bias may be None");
      layers_.push_back({*t[0], *t[1], t[2], *t[3], *t[4], *t[5], *t[6], *t[7], *t[8]});
    }
  }

  // The residual stream x [T, hidden] (+ delta) through every layer: (stream after the last attention, the last
  // MLP output to add), as the Python loop leaves them. cos/sin [T, 1, D]; the rest is AttentionMetadata's.
  std::tuple<torch::Tensor, torch::Tensor> run(torch::Tensor x, std::optional<torch::Tensor> delta, torch::Tensor cos,
                                               torch::Tensor sin, torch::Tensor slots, torch::Tensor qstart,
                                               torch::Tensor qlen, torch::Tensor ctx, torch::Tensor tables) const {
    const int64_t T = x.size(0);
    cos = cos.reshape({T, d_});
    sin = sin.reshape({T, d_});
    for (const LayerWeights& w : layers_) {
      auto normed = add_rms_norm(x, delta, w.input_norm, eps_);
      x = normed[0];
      const torch::Tensor qkv = bf16_gemv(normed[1], w.qkv, w.qkv_bias).view({T, -1, d_});
      const auto qk = rope_qk(qkv, cos, sin, nh_, nk_);
      store_kv(w.k_cache, w.v_cache, qk[1], qkv.slice(1, nh_ + nk_), slots);
      torch::Tensor o = torch::empty_like(qk[0]);
      paged_attention_cpu(qk[0], w.k_cache, w.v_cache, o, qstart, qlen, ctx, tables, scale_, std::nullopt,
                          std::nullopt, 0);
      normed = add_rms_norm(x, bf16_gemv(o.view({T, nh_ * d_}), w.o, std::nullopt), w.post_norm, eps_);
      x = normed[0];
      delta = bf16_gemv(silu_mul(bf16_gemv(normed[1], w.gate_up, std::nullopt)), w.down, std::nullopt);
    }
    TORCH_CHECK(delta.has_value(), "DecodeStack: no layers");
    return {x, *delta};
  }

 private:
  std::vector<LayerWeights> layers_;
  int64_t nh_, nk_, d_;
  double eps_, scale_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("SUPPORTED") = supported();  // the GEMV's avx512_bf16: without it the stack has no kernel to call
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<const std::vector<std::vector<std::optional<torch::Tensor>>>&, int64_t, int64_t, int64_t, double,
                    double>(),
           py::arg("layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("scale"))
      .def("run", &DecodeStack::run, "the decoder stack over one decode step: (x, delta)",
           py::call_guard<py::gil_scoped_release>());
}
