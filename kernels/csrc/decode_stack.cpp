// A decode step's whole decoder stack in one call: per layer the same kernels, in the same order, that
// engine/models/llama.py's DecoderLayer calls one by one from Python (add_rms_norm, the linears' ops, rope_qk,
// store_kv, paged_attention_cpu, silu_mul), so the results are bitwise the layers', without what a layer's
// ~10 calls from Python (module __call__, dispatch checks, views) cost (docs/benchmarks.md, decode_steps).
// With a head (`set_head`), `logits`
// also runs what LlamaModel.forward does around the layers: the embedding rows, the step's rotary rows, the final
// norm and the LM head (Python ops, each slow on caches the step's weights have just evicted).
// The kernels' sources are included whole; elementwise.cpp first, as it sets CPU_CAPABILITY (cpu_capability.h)
// before any ATen vector header is read.
#pragma once
#ifndef SLUICE_NO_MODULE  // built alone: its own module, not its parts'
#define SLUICE_DECODE_STACK_MODULE
#define SLUICE_NO_MODULE
#endif
#include "elementwise.cpp"
#include "rms_norm.cpp"
#include "paged_attention.cpp"
#include "bf16_gemv.cpp"
#include "quant_linear.cpp"
#include "nf4.cpp"
#include "lora.cpp"

#include <optional>
#include <tuple>
#include <vector>

// One linear, run by the op its Python module runs at the step's row count: our bf16 GEMV (kernels/linear.py),
// our int8 x int4 VNNI product or torch's int4pack matmul (kernels/int4_weights.py), our int8 GEMV up to gemv_rows rows or else the fused
// dynamic int8 matmul (kernels/int8_weights.py), LLM.int8() as engine/quantization/int8_cpu.py runs it (bitsandbytes'
// activation quantization, the exact int8 product, its dequant epilogue, the outlier columns added back), bitsandbytes'
// NF4/FP4 weights by our 4-bit GEMV (kernels/nf4.py).
// kernels/decode_stack.py makes one only where its module takes exactly these branches at every row count the stack
// serves.
struct StackLinear {
  enum Kind { kBf16, kInt4, kInt4Vnni, kInt8, kLLMInt8, kFused, kNf4 } kind;
  torch::Tensor weight;                 // bf16 [out, in]; int4: packed codes; int8, LLM.int8(): int8 [out, in];
                                        // NF4/FP4: bitsandbytes' codes [out, in / 2]
  std::optional<torch::Tensor> scales;  // int4: scales_zeros (int4pack or our layout); int8: row scales [out];
                                        // LLM.int8(): SCB, fp32 row absmax [out]; NF4/FP4: bf16 absmax [out, in / 64]
  std::optional<torch::Tensor> bias;
  int64_t out_features, group, gemv_rows;  // group: int4's; gemv_rows: int8's
  double threshold = 0;                    // LLM.int8()'s outlier threshold
  std::vector<StackLinear> parts;          // kFused: one linear per checkpoint tensor, outputs side by side
  torch::Tensor table;                     // NF4/FP4: the 16 code values (fp32)
  // LoRA (lora.cpp): the step's mapping and this projection's slots, A [S, R, in] and B [S, out, R], added
  // after the base product where the step has adapters (engine/lora/slots.py's LoRALinear, as it adds them)
  std::shared_ptr<const LoraMapping> lora;
  torch::Tensor lora_a, lora_b;
  std::vector<int64_t> lora_splits;
  std::optional<torch::Tensor> panels;  // bf16, int8: the weight packed into panels (bf16_panels.h, int8_panels.h)

  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor y = base(x);
    if (lora && lora->active()) lora_add_groups(y, x, lora_a, lora_b, lora->groups, 1.0, lora_splits);
    return y;
  }

  torch::Tensor base(const torch::Tensor& x) const {
    if (kind == kBf16) return panels ? panels_linear(x, *panels, out_features, bias) : bf16_gemv(x, weight, bias);
    if (kind == kLLMInt8) return llm_int8(x, bnb_int8_act(x, threshold));
    if (kind == kFused) {  // FusedLinear: the parts' outputs concatenated (LLM.int8() parts share x's quantization)
      std::vector<torch::Tensor> out;
      const bool shared = parts[0].kind == kLLMInt8;
      const auto a = shared ? bnb_int8_act(x, parts[0].threshold) : std::vector<torch::Tensor>{};
      for (const StackLinear& p : parts) out.push_back(shared ? p.llm_int8(x, a) : p(x));
      return torch::cat(out, 1);
    }
    if (kind == kInt4Vnni) return int4_vnni_mm(x, weight, *scales, bias);
    if (kind == kNf4) return nf4_gemv(x, weight, *scales, table, bias);
    torch::Tensor y;
    if (kind == kInt4) {
      y = at::_weight_int4pack_mm_for_cpu(x, weight, group, *scales);
      if (y.size(1) != out_features) y = y.slice(1, 0, out_features).contiguous();
    } else if (x.size(0) <= gemv_rows) {
      y = int8_gemv_op(x, weight, *scales);  // kernels.int8_weights' GEMV for bf16 (bf16_gemv.cpp)
    } else {
      const auto q = quantize_rows(x);
      return int8_rescale(panels ? int8_panels_mm(q[0], *panels, out_features) : int8_mm(q[0], weight), q[1], *scales,
                          bias);
    }
    return bias ? y + *bias : y;
  }

  // LLM.int8() of x given its quantization a = bnb_int8_act(x, threshold): codes, row absmax, outlier columns.
  torch::Tensor llm_int8(const torch::Tensor& x, const std::vector<torch::Tensor>& a) const {
    auto y = bnb_int8_dequant(int8_mm(a[0], weight), a[1], *scales, bias);
    TORCH_CHECK(y.has_value() && bnb_int8_outliers(*y, x, a[2], weight, *scales),
                "DecodeStack: LLM.int8() epilogue not built for this tier");
    return *y;
  }
};

struct LayerWeights {
  torch::Tensor input_norm;
  StackLinear qkv, o;
  torch::Tensor post_norm;
  StackLinear gate_up, down;
  torch::Tensor k_cache, v_cache;
};

using LayerSpec = std::tuple<torch::Tensor, StackLinear, StackLinear, torch::Tensor, StackLinear, StackLinear,
                             torch::Tensor, torch::Tensor>;

class DecodeStack {
 public:
  // Each layer: input norm, qkv, o, post-attention norm, gate_up, down, key cache, value cache (held, not copied:
  // the stack sees later writes to them).
  DecodeStack(const std::vector<LayerSpec>& layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              double eps, double scale)
      : nh_(num_heads), nk_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale) {
    for (const auto& t : layers) std::apply([&](const auto&... w) { layers_.push_back(LayerWeights{w...}); }, t);
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
      const torch::Tensor qkv = w.qkv(normed[1]).view({T, -1, d_});
      const auto qk = rope_qk(qkv, cos, sin, nh_, nk_);
      store_kv(w.k_cache, w.v_cache, qk[1], qkv.slice(1, nh_ + nk_), slots);
      torch::Tensor o = torch::empty_like(qk[0]);
      paged_attention_cpu(qk[0], w.k_cache, w.v_cache, o, qstart, qlen, ctx, tables, scale_, std::nullopt,
                          std::nullopt, 0);
      normed = add_rms_norm(x, w.o(o.view({T, nh_ * d_})), w.post_norm, eps_);
      x = normed[0];
      delta = w.down(silu_mul(w.gate_up(normed[1])));
    }
    TORCH_CHECK(delta.has_value(), "DecodeStack: no layers");
    return {x, *delta};
  }

  // The model's ends: embedding [vocab, hidden], final norm [hidden], LM head.
  void set_head(torch::Tensor embed, torch::Tensor final_norm, StackLinear head) {
    embed_ = std::move(embed);
    final_norm_ = std::move(final_norm);
    head_ = std::move(head);
  }

  // Logits [T, vocab] of every token of the step: token ids and positions [T] (int64), the rotary tables
  // [positions, D] in the activations' dtype; the rest as `run`.
  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& cos_table,
                       const torch::Tensor& sin_table, torch::Tensor slots, torch::Tensor qstart, torch::Tensor qlen,
                       torch::Tensor ctx, torch::Tensor tables) const {
    TORCH_CHECK(head_.has_value(), "DecodeStack.logits: no head (set_head)");
    auto [x, delta] = run(embed_->index_select(0, ids), std::nullopt, cos_table.index_select(0, positions),
                          sin_table.index_select(0, positions), std::move(slots), std::move(qstart), std::move(qlen),
                          std::move(ctx), std::move(tables));
    return (*head_)(add_rms_norm(x, delta, *final_norm_, eps_)[1]);
  }

  // Whether every linear (the head's too, if set) is a bf16 one, on the GEMV call at every row count it takes.
  bool all_bf16() const {
    auto bf16 = [](const StackLinear& l) { return l.kind == StackLinear::kBf16; };
    for (const LayerWeights& w : layers_)
      if (!bf16(w.qkv) || !bf16(w.o) || !bf16(w.gate_up) || !bf16(w.down)) return false;
    return !head_ || bf16(*head_);
  }

 private:
  std::vector<LayerWeights> layers_;
  int64_t nh_, nk_, d_;
  double eps_, scale_;
  std::optional<torch::Tensor> embed_, final_norm_;
  std::optional<StackLinear> head_;
};

using Bias = std::optional<torch::Tensor>;

// This file's Python functions, on the module `m` (its own library's, or cpu_kernels.cpp's submodule "decode_stack").
inline void bind_decode_stack(py::module_& m) {
  m.attr("SUPPORTED") = supported();  // the GEMV's tier (avx2 or avx512_bf16): without it the stack has no kernel
  // module_local: each tier's object registers its own types, so a process (a test) may load several tiers
  py::class_<StackLinear>(m, "Linear", py::module_local());
  m.def("bf16_linear", [](torch::Tensor weight, Bias bias, std::optional<torch::Tensor> panels) {
    const int64_t n = weight.size(0);
    StackLinear l{StackLinear::kBf16, std::move(weight), std::nullopt, std::move(bias), n, 0, 0};
    l.panels = std::move(panels);
    return l;
  }, "a bf16 linear: from its panels where given (kernels.linear.weight_panels), else on the GEMV",
        py::arg("weight"), py::arg("bias"), py::arg("panels") = py::none());
  m.def("int4_linear", [](torch::Tensor packed, torch::Tensor scales_zeros, Bias bias, int64_t out_features,
                          int64_t group) {
    return StackLinear{StackLinear::kInt4, std::move(packed), std::move(scales_zeros), std::move(bias), out_features,
                       group, 0};
  }, "an int4pack linear", py::arg("packed"), py::arg("scales_zeros"), py::arg("bias"), py::arg("out_features"),
        py::arg("group"));
  m.def("int4_vnni_linear", [](torch::Tensor packed, torch::Tensor scales_zeros, Bias bias) {
    const int64_t n = packed.size(0);
    return StackLinear{StackLinear::kInt4Vnni, std::move(packed), std::move(scales_zeros), std::move(bias), n, 0, 0};
  }, "an int4 linear in our VNNI layout", py::arg("packed"), py::arg("scales_zeros"), py::arg("bias"));
  m.def("int8_linear", [](torch::Tensor qweight, torch::Tensor scales, Bias bias, int64_t gemv_rows,
                          std::optional<torch::Tensor> panels) {
    const int64_t n = qweight.size(0);
    StackLinear l{StackLinear::kInt8, std::move(qweight), std::move(scales), std::move(bias), n, 0, gemv_rows};
    l.panels = std::move(panels);
    return l;
  }, "an int8 weight-only linear: the int8 GEMV to gemv_rows rows, the dynamic int8 matmul above (its product "
     "from the weight's panels where given)",
        py::arg("qweight"), py::arg("scales"), py::arg("bias"), py::arg("gemv_rows"), py::arg("panels") = py::none());
  m.def("llm_int8_linear", [](torch::Tensor cb, torch::Tensor scb, Bias bias, double threshold) {
    const int64_t n = cb.size(0);
    return StackLinear{StackLinear::kLLMInt8, std::move(cb), std::move(scb), std::move(bias), n, 0, 0, threshold};
  }, "an LLM.int8() linear (bitsandbytes' CB and SCB)", py::arg("cb"), py::arg("scb"), py::arg("bias"),
        py::arg("threshold"));
  m.def("nf4_linear", [](torch::Tensor codes, torch::Tensor absmax, torch::Tensor table, Bias bias) {
    const int64_t n = codes.size(0);
    return StackLinear{StackLinear::kNf4, std::move(codes), std::move(absmax), std::move(bias), n, 0, 0, 0.0, {},
                       std::move(table)};
  }, "a bitsandbytes NF4/FP4 linear (codes, bf16 absmax, code table), on the 4-bit GEMV", py::arg("codes"),
        py::arg("absmax"), py::arg("table"), py::arg("bias"));
  m.def("fused_linear", [](std::vector<StackLinear> parts) {
    TORCH_CHECK(!parts.empty(), "fused_linear: no parts");
    const bool int8 = parts[0].kind == StackLinear::kLLMInt8;
    int64_t n = 0;
    for (const StackLinear& p : parts) {
      TORCH_CHECK((p.kind == StackLinear::kLLMInt8) == int8 && (!int8 || p.threshold == parts[0].threshold),
                  "fused_linear: LLM.int8() parts only with one another, at one threshold");
      n += p.out_features;
    }
    return StackLinear{StackLinear::kFused, torch::Tensor(), std::nullopt, std::nullopt, n, 0, 0, 0.0,
                       std::move(parts)};
  }, "a fused projection: its parts' outputs side by side", py::arg("parts"));
  m.def("lora_linear", [](StackLinear base, std::shared_ptr<LoraMapping> mapping, torch::Tensor a,
                          torch::Tensor b, std::vector<int64_t> out_splits) {
    base.lora = std::move(mapping);
    base.lora_a = std::move(a);
    base.lora_b = std::move(b);
    base.lora_splits = std::move(out_splits);
    return base;
  }, "a stack linear with a LoRA projection's slots added after it when the mapping is active",
        py::arg("base"), py::arg("mapping"), py::arg("a"), py::arg("b"), py::arg("out_splits"));
  m.attr("BNB_INT8_EPILOGUE") = bnb_int8_epilogue_supported();
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<const std::vector<LayerSpec>&, int64_t, int64_t, int64_t, double, double>(), py::arg("layers"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def("run", &DecodeStack::run, "the decoder stack over one decode step: (x, delta)",
           py::call_guard<py::gil_scoped_release>())
      .def("set_head", &DecodeStack::set_head, "the embedding, final norm and LM head `logits` runs",
           py::arg("embed"), py::arg("final_norm"), py::arg("head"))
      .def("all_bf16", &DecodeStack::all_bf16, "whether every linear, the head's too, is a bf16 one")
      .def("logits", &DecodeStack::logits, "embedding, the decoder stack, final norm and LM head over one step",
           py::call_guard<py::gil_scoped_release>());
}

#ifdef SLUICE_DECODE_STACK_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bind_decode_stack(m); }
#endif
