"""A CPU decode step's whole decoder stack in one C++ call (csrc/decode_stack.cpp, built on first use).

At a few tokens a layer's kernel calls from Python (module __call__, each kernel's checks, views) are a large
share of a small model's bf16 decode step (docs/benchmarks.md, decode_steps). The stack makes the same calls
in the same order from C++, so its results are bitwise the layers'. It
serves bf16 steps of 1 to MAX_STACK_TOKENS tokens (to `linear.bf16_stack_rows` for a stack whose every linear
is bf16, where our GEMV call serves those rows: `max_tokens`) whose sequences all have short queries
(decode, speculative verify) on the fused attention kernel; anything else runs the Python layers. Its linears
are bf16 ones, the weight-only quantized ones, each running the op its Python module would at the step's row
count (decided when the stack is built, by asking the module's own branch tests), LLM.int8() ones on x86 tiers
(AVX2 and up: its bf16 C++ passes) and bitsandbytes-format NF4/FP4 ones (our 4-bit GEMV); a layer with any
other linear (bitsandbytes' own modules, on other devices) is not stacked. A LoRA projection's linear adds
the step's adapters after its product (`lora_stack_linear`, csrc/lora.cpp), so steps with adapters run on
the stack too.
"""

from __future__ import annotations

import torch

from sluice.kernels import cpp_build, int4_weights, int8_weights, nf4, options
from sluice.kernels.attention import AttentionMetadata
from sluice.kernels.linear import MAX_GEMV_ROWS, MAX_GEMV_ROWS_FP32, bf16_stack_rows, weight_panels

MAX_STACK_TOKENS = 16  # the stack's steps: where the int4 W4A8 product and our bf16 GEMV serve every linear
assert MAX_STACK_TOKENS <= min(MAX_GEMV_ROWS, MAX_GEMV_ROWS_FP32) and MAX_STACK_TOKENS < nf4.TILE_MIN_ROWS


def max_tokens(in_features: int = 1) -> int:
    """The most tokens a step may have to run on a stack: MAX_STACK_TOKENS, or more where our GEMV call serves
    bf16 linears of up to `in_features` inputs at every row count past it (`linear.bf16_stack_rows`: the avx2
    tier's GEMM; on AVX512-BF16 without AMX the GEMV itself), for stacks whose every linear is bf16
    (`DecodeStack.max_tokens`). The default, the narrowest linear, bounds every stack's."""
    return max(MAX_STACK_TOKENS, bf16_stack_rows(in_features))


@options.derived
def _any_stack_tokens() -> int:
    """`max_tokens()`, the bound of every stack, kept with the options: `step_fits` asks it every step."""
    return max_tokens()


def _ext():
    ext = cpp_build.part("decode_stack") if cpp_build.enabled() else None
    return ext if ext is not None and ext.SUPPORTED else None


def available() -> bool:
    """True when the stack is enabled (SLUICE_CPU_KERNEL != 0) and built for a tier with a bf16 GEMV (avx2 and
    up)."""
    return _ext() is not None


def step_fits(ids: torch.Tensor, dtype: torch.dtype, meta) -> bool:
    """Whether a step of token ids [T] with activations in `dtype` can run on a stack (a few attribute tests:
    every step)."""
    return (dtype is torch.bfloat16 and 1 <= ids.shape[0] <= _any_stack_tokens() and ids.device.type == "cpu"
            and type(meta) is AttentionMetadata and meta.fused_short is not None and not meta.short_groups
            and not meta.long_seqs and not meta.fused_long and not torch.is_grad_enabled())


def _plain_bf16(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype is torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous())


def _row_counts(in_features: int) -> list[torch.Tensor]:
    """Empty bf16 inputs of every row count the stack serves: the quantized linears' own branch tests are
    asked about each, once, when a linear is stacked."""
    return [torch.empty(m, in_features, dtype=torch.bfloat16) for m in range(1, MAX_STACK_TOKENS + 1)]


def bf16_stack_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """sluice.kernels.linear.Linear's weights as a stack linear (the product from its panels where
    `linear.weight_panels` has them, else our GEMV, at every row count), or None where neither would serve
    them."""
    ext = _ext()
    if ext is None or not _plain_bf16(weight) or not _plain_bf16(bias):
        return None
    return ext.bf16_linear(weight, bias, weight_panels(weight))


def int4_stack_linear(w: int4_weights.Int4Weight, bias: torch.Tensor | None):
    """An int4 weight-only linear as a stack linear (the int8 x int4 VNNI product for our layout,
    `_weight_int4pack_mm_for_cpu` for torch's, as int4_weights.int4_linear runs them), or None where that
    function takes another branch at some row count."""
    ext = _ext()
    if ext is None:
        return None
    if w.layout == "vnni":
        kernel = int4_weights.vnni_kernel()
        if kernel is None or MAX_STACK_TOKENS > int4_weights.w4a8_max_rows(kernel) or not _plain_bf16(bias):
            return None
        return ext.int4_vnni_linear(w.packed, w.scales_zeros, bias)
    if w.layout != "int4pack" or any(int4_weights.use_tiles(r) for r in _row_counts(w.in_features)):
        return None
    return ext.int4_linear(w.packed, w.scales_zeros, bias, w.out_features, int4_weights.GROUP)


def int8_stack_linear(qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """An int8 weight-only linear as a stack linear: our int8 GEMV at the row counts where
    int8_weights.int8_linear runs it, the fused dynamic int8 matmul at the rest (its int8 product from the
    weight's panels where `int8_weights.int8_panels` has them); None where it takes another
    branch (torch's GEMV for other scale dtypes, the torch dynamic reference when the fused helpers do not
    build)."""
    ext = _ext()
    if ext is None:
        return None
    gemv = int8_weights.stack_branches(qweight, scales, _row_counts(qweight.shape[1]))
    if gemv is None or gemv != sorted(gemv, reverse=True):  # the GEMV runs a prefix of the row counts
        return None
    return ext.int8_linear(qweight, scales, bias, sum(gemv), int8_weights.int8_panels(qweight))


def llm_int8_stack_linear(cb: torch.Tensor, scb: torch.Tensor, bias: torch.Tensor | None, threshold: float):
    """An LLM.int8() linear (engine/quantization/int8_cpu.py: bitsandbytes' CB int8 [out, in] and SCB fp32
    [out]) as a stack linear: the same C++ passes its forward runs for bf16 (activation quantization, the
    exact int8 product, the dequant epilogue, the outlier columns), or None where the tier has no bf16
    epilogue pass (its forward then runs torch ops). The stack and kernels.int8_weights' functions are parts
    of one library (cpp_build.part), so the stack's BNB_INT8_EPILOGUE answers for both."""
    ext = _ext()
    if (ext is None or not ext.BNB_INT8_EPILOGUE or not _plain_bf16(bias) or cb.dtype is not torch.int8
            or cb.device.type != "cpu" or not cb.is_contiguous() or scb.dtype is not torch.float32
            or not scb.is_contiguous()):
        return None
    return ext.llm_int8_linear(cb, scb, bias, float(threshold))


def nf4_stack_linear(codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
                     bias: torch.Tensor | None):
    """A bitsandbytes NF4/FP4 linear (engine/quantization/four_bit.py's Linear4bitCpu, packed: codes uint8
    [out, in / 2], bf16 absmax [out, in / 64], the fp32 code table) as a stack linear: the 4-bit GEMV its
    forward runs below nf4.TILE_MIN_ROWS rows, or None where the tensors are not the kernel's."""
    ext = _ext()
    if (ext is None or codes.dtype is not torch.uint8 or codes.device.type != "cpu"
        or not codes.is_contiguous()
            or not _plain_bf16(absmax) or table.dtype is not torch.float32 or not table.is_contiguous()
            or not _plain_bf16(bias)):
        return None
    return ext.nf4_linear(codes, absmax, table, bias)


def fused_stack_linear(parts: list):
    """A fused projection (engine.quantization.linears.FusedLinear: one linear per checkpoint tensor) as a
    stack linear, from its parts' stack linears: their outputs side by side (LLM.int8() parts quantize the
    activations once, the same codes each of them would make); None where a part does not stack."""
    ext = _ext()
    return None if ext is None or not parts or any(p is None for p in parts) else ext.fused_linear(parts)


def lora_stack_linear(base, mapping, a: torch.Tensor, b: torch.Tensor, out_splits: list[int]):
    """A stack linear `base` that adds a LoRA projection's slots (A [S, R, in], B [S, out, R],
    engine.lora.slots) after its product whenever the step's `mapping` (csrc/lora.cpp's LoraMapping) has
    adapters, as the eager LoRALinear does; None where the kernels do not build."""
    ext = _ext()
    return None if ext is None or base is None else ext.lora_linear(base, mapping, a, b, out_splits)


def build_stack(layers: list[list], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
          scale: float, head: tuple | None = None, widest: int = 1 << 30) -> DecodeStack | None:
    """A stack over per-layer [input norm, qkv, o, post-attention norm, gate_up, down, k cache, v cache], the
    linears as this module's stack linears, or None where the kernels do not build or a norm or cache is not a
    contiguous CPU bf16 tensor. `head` (embedding weight, final norm weight, LM head as a stack linear or
    None) gives it `logits`, where both weights are contiguous CPU bf16 and the LM head stacks. `widest`: the
    most inputs of any of its linears (the rows a bf16 stack takes depend on it)."""
    ext = _ext()
    if ext is None or not all(_plain_bf16(layer[i]) for layer in layers for i in (0, 3, 6, 7)):
        return None
    stack = ext.DecodeStack(layers, num_heads, num_kv_heads, head_dim, eps, scale)
    with_head = head is not None and head[2] is not None and _plain_bf16(head[0]) and _plain_bf16(head[1])
    if with_head:
        stack.set_head(*head)
    return DecodeStack(stack, with_head, max_tokens(widest) if stack.all_bf16() else MAX_STACK_TOKENS)


class DecodeStack:
    """The C++ stack, holding the layers' weights and caches (later writes to them are seen, not copies);
    `max_tokens`: the most tokens of a step it runs as its layers would (past MAX_STACK_TOKENS only where
    every linear is bf16 and our GEMV call serves them there)."""

    __slots__ = ("_stack", "has_head", "max_tokens")

    def __init__(self, stack, has_head: bool = False, max_tokens: int = MAX_STACK_TOKENS) -> None:
        self._stack, self.has_head, self.max_tokens = stack, has_head, max_tokens

    def logits(self, ids: torch.Tensor, positions: torch.Tensor,
               rope_tables: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Logits [T, vocab] of every token of a step that `step_fits` (the stack has a head): the embedding,
        the layers, the final norm and the LM head as LlamaModel.forward runs them; rope_tables: cos and sin
        [positions, D] in bf16."""
        return self._stack.logits(ids, positions, *rope_tables, meta.slot_mapping, *meta.fused_short)

    def run(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings x [T, hidden] of a step that `step_fits` through every layer: (x, delta) as the
        Python loop leaves them."""
        return self._stack.run(x, None, *cos_sin, meta.slot_mapping, *meta.fused_short)
