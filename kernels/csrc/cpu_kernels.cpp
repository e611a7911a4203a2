// The CPU kernels every model's step runs, as one library per tier: the decode stack and the kernels it includes
// (elementwise, rms_norm, paged_attention, bf16_gemv, quant_linear, nf4) and the masked sampler, each file's Python
// functions on a submodule of its name (kernels.cpp_build.part). Built as separate libraries, a process mapped
// the same code twice, once in its own library and once in the stack's, and a fresh host compiled it twice: one
// library touches fewer pages of code and loads once (docs/benchmarks.md, quant_memory). MoE's kernels
// (moe.cpp, AMX tiles where the tier has them) stay a library of their own.
// lora.cpp's grouped LoRA products are a part too (the stack adds them after its linears), and
// varlen_attention.cpp's bidirectional attention of unpadded sequences (encoders, vision towers).
#define SLUICE_NO_MODULE
#include "decode_stack.cpp"
#include "masked_sample.cpp"
#include "varlen_attention.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const std::pair<const char*, void (*)(py::module_&)> parts[] = {
      {"elementwise", bind_elementwise}, {"rms_norm", bind_rms_norm},         {"paged_attention", bind_paged_attention},
      {"bf16_gemv", bind_bf16_gemv},     {"quant_linear", bind_quant_linear}, {"decode_stack", bind_decode_stack},
      {"masked_sample", bind_masked_sample}, {"nf4", bind_nf4}, {"lora", bind_lora},
      {"varlen_attention", bind_varlen_attention}};
  for (const auto& [name, bind] : parts) {
    py::module_ sub = m.def_submodule(name);
    bind(sub);
  }
}
