"""LLM.int8() and bitsandbytes 4-bit linears, built from loaded weights (quantize while loading) or from
pre-quantized tensors."""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from sluice import kernels
from sluice.engine.models.llama import LlamaModel, ModelConfig
from sluice.engine.models.loader import CheckpointReader
from sluice.engine.quantization import four_bit
from sluice.engine.quantization.int8_cpu import LLMInt8Linear
from sluice.engine.quantization.spec import BLOCKSIZE, INT4_WEIGHT_ONLY, WEIGHT_ONLY, QuantSpec
from sluice.kernels import decode_stack, int4_weights, int8_weights

QUIET = ("bitsandbytes.backends.cpu.ops", "bitsandbytes.autograd._functions")  # per-call cast notices


def _bnb():
    """bitsandbytes, imported where a linear needs it (CUDA; 4-bit), its per-call cast notices quieted."""
    import logging

    import bitsandbytes

    for name in QUIET:
        logging.getLogger(name).setLevel(logging.ERROR)
    return bitsandbytes


class FusedLinear(nn.Module):
    """A fused projection (q/k/v, gate/up) kept as one quantized linear per checkpoint tensor."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def stack_linear(self):
        """This projection for kernels.decode_stack (its parts' stack linears side by side), or None where a
        part does not stack."""
        parts = [getattr(p, "stack_linear", lambda: None)() for p in self.parts]
        return decode_stack.fused_stack_linear(parts)


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Parameter | None:
    return None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)


def llm_int8_module(spec: QuantSpec, cb: torch.Tensor, scb: torch.Tensor, bias, dtype) -> nn.Module:
    """LLM.int8() linear over int8 rows `cb` [out, in] with fp32 row scales `scb`: ours on CPU (bitsandbytes'
    Linear8bitLt arithmetic, without bitsandbytes), bitsandbytes' Linear8bitLt elsewhere."""
    if cb.device.type == "cpu":
        return LLMInt8Linear(cb, scb, bias, dtype, spec.threshold)
    bnb = _bnb()
    out_f, in_f = cb.shape
    mod = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias is not None, has_fp16_weights=False,
                              threshold=spec.threshold, device="meta")
    mod.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
    mod.bias = _bias(bias, dtype)
    return mod


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CB and SCB of a weight [out, in] as bitsandbytes' int8_vectorwise_quant gives them for its fp16 copy:
    on CPU ours (the same bits: tests/test_quant_kernels.py), elsewhere bitsandbytes' own."""
    if weight.device.type != "cpu":
        return _bnb().functional.int8_vectorwise_quant(weight.to(torch.float16))[:2]
    return int8_weights.bnb_int8_rows(weight) or int8_weights.bnb_int8_act(weight, 0.0)[:2]


def four_bit_module(spec: QuantSpec, packed: torch.Tensor, quant_state, bias, dtype) -> nn.Module:
    """A 4-bit linear over packed codes and their state: ours on CPU (a `four_bit.State4bit`: kernels.nf4, no
    bitsandbytes), bitsandbytes' Linear4bit computing in `dtype` elsewhere (its QuantState)."""
    if isinstance(quant_state, four_bit.State4bit):
        return four_bit.Linear4bitCpu(packed, quant_state, bias, dtype)
    bnb = _bnb()
    out_f, in_f = quant_state.shape
    mod = bnb.nn.Linear4bit(in_f, out_f, bias=bias is not None, compute_dtype=dtype,
                            compress_statistics=quant_state.nested, quant_type=quant_state.quant_type,
                            device="meta")
    quant_state.dtype = dtype
    mod.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=quant_state,
                                   blocksize=quant_state.blocksize, compress_statistics=quant_state.nested,
                                   quant_type=quant_state.quant_type, module=mod, bnb_quantized=True)
    mod.quant_state = quant_state
    mod.bias = _bias(bias, dtype)
    return mod


def pack_4bit_for_cpu(model: nn.Module) -> int:
    """Put every 4-bit linear of a CPU model in the layout its kernel reads (`four_bit.pack_for_cpu`: the
    absmax in bf16, in the model's weight arena where it has one, bitsandbytes' state freed), at load rather
    than at its first forward; returns the linears packed."""
    arena = getattr(model, "weight_arena", None)
    return four_bit.pack_for_cpu(model, arena.empty if arena is not None else None)


class Int8WeightOnlyLinear(nn.Module):
    """int8 weights [out, in] with a scale per output row (absmax / 127); activations stay in `dtype`."""

    ROWS_PER_CHUNK = 1024  # quantize in slices so loading never holds a float32 copy of a whole LM head

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.empty(weight.shape, dtype=torch.int8, device=weight.device))
        self.register_buffer("scales", torch.empty(weight.shape[0], dtype=dtype, device=weight.device))
        for start in range(0, weight.shape[0], self.ROWS_PER_CHUNK):
            rows = slice(start, start + self.ROWS_PER_CHUNK)
            w = weight[rows].float()  # may alias a float32 weight (a tied embedding table): no in-place ops
            scales = w.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127
            self.qweight[rows] = (w / scales[:, None]).round_().to(torch.int8)
            self.scales[rows] = scales.to(dtype)
        self.bias = _bias(bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.int8_linear(x, self.qweight, self.scales, self.bias)

    def stack_linear(self):
        """This linear for kernels.decode_stack, or None where the stack would not run it as `forward`
        does."""
        return decode_stack.int8_stack_linear(self.qweight, self.scales, self.bias)


class Int4WeightOnlyLinear(nn.Module):
    """4-bit weights in groups of 32 input columns (scale and zero each); activations stay in `dtype`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        # an input width off the group (MoE experts' inner sizes): zero columns to a whole group, and the
        # activations padded with zeros to match, so the padded columns add exactly nothing
        self.pad = -weight.shape[1] % int4_weights.GROUP
        w = int4_weights.pack(nn.functional.pad(weight, (0, self.pad)) if self.pad else weight, dtype)
        self.register_buffer("packed", w.packed)
        self.register_buffer("scales_zeros", w.scales_zeros)
        self.out_features, self.in_features, self.layout = w.out_features, w.in_features, w.layout
        self.bias = _bias(bias, dtype)

    def weight(self) -> int4_weights.Int4Weight:
        return int4_weights.Int4Weight(self.packed, self.scales_zeros, self.out_features, self.in_features,
                                       self.layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad:
            x = nn.functional.pad(x, (0, self.pad))
        return int4_weights.int4_linear(x, self.weight(), self.bias)

    def stack_linear(self):
        """This linear for kernels.decode_stack, or None where the stack would not run it as `forward`
        does."""
        return None if self.pad else decode_stack.int4_stack_linear(self.weight(), self.bias)


WEIGHT_ONLY_LINEARS = {WEIGHT_ONLY: Int8WeightOnlyLinear, INT4_WEIGHT_ONLY: Int4WeightOnlyLinear}


def quantized_linear(spec: QuantSpec, weight: torch.Tensor, bias: torch.Tensor | None, dtype) -> nn.Module:
    """Quantize one weight [out, in] (already on its device) into the spec's LLM.int8() or bitsandbytes 4-bit
    linear."""
    if spec.method == "int8":
        return llm_int8_module(spec, *int8_rows(weight), bias, dtype)
    n_out, n_in = weight.shape
    pad = -n_in % BLOCKSIZE if weight.device.type == "cpu" else 0
    if pad:  # our CPU kernel multiplies whole blocks of 64 columns (MoE experts' widths vary)
        weight = nn.functional.pad(weight, (0, pad))
    packed, state = _quantize_4bit(spec, weight.to(dtype).contiguous())
    mod = four_bit_module(spec, packed, state, bias, dtype)
    return ZeroPadded(mod, pad, n_out) if pad else mod


def _quantize_4bit(spec: QuantSpec, w: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """bitsandbytes' 4-bit packing of w: on CPU ours (`four_bit.quantize_4bit`, the same bits, no
    bitsandbytes), elsewhere bitsandbytes' own."""
    if w.device.type == "cpu":
        return four_bit.quantize_4bit(w, spec.quant_type, spec.double_quant)
    F = _bnb().functional
    return F.quantize_4bit(w, blocksize=BLOCKSIZE, compress_statistics=spec.double_quant,
                           quant_type=spec.quant_type)


class ZeroPadded(nn.Module):
    """A linear whose weight was padded with zero columns and rows: the input padded with zeros to match (adds
    exactly 0), the output cut back to `out_features`."""

    def __init__(self, inner: nn.Module, pad: int, out_features: int) -> None:
        super().__init__()
        self.inner, self.pad, self.out_features = inner, pad, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(nn.functional.pad(x, (0, self.pad)) if self.pad else x)
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]


def read_linear(spec: QuantSpec, reader: CheckpointReader, name: str, dtype, device) -> nn.Module:
    """A pre-quantized linear from its checkpoint tensors; unquantized ones (skipped modules) stay plain."""
    get = lambda key: reader.get(key).to(device)  # noqa: E731
    bias = get(f"{name}.bias") if f"{name}.bias" in reader else None
    weight = get(f"{name}.weight")
    if f"{name}.SCB" in reader:
        return llm_int8_module(spec, weight, get(f"{name}.SCB"), bias, dtype)
    stats = {field: get(key) for field, key in reader.fields(f"{name}.weight").items()}
    if stats:
        cpu = torch.device(device).type == "cpu"
        state = (four_bit.State4bit.from_dict(stats) if cpu
                 else _bnb().functional.QuantState.from_dict(stats, device))
        return four_bit_module(spec, weight, state, bias, dtype)
    plain = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    plain.weight, plain.bias = nn.Parameter(weight.to(dtype), requires_grad=False), _bias(bias, dtype)
    return plain


def release_freed_memory() -> None:
    """Hand the previous layer's freed full-precision weights back to the OS (glibc keeps them otherwise)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def part_names(prefix: str) -> list[str]:
    """Checkpoint names of the linears behind one of our (possibly fused) linears."""
    layer, _, name = prefix.rpartition("layers.")
    index, _, local = name.partition(".")
    return [f"{layer}layers.{index}.{p}" for p in LlamaModel.FUSED.get(local, (local,))]


class Quantizer:
    """The loader's linear hook: each loaded linear becomes bitsandbytes linears, one per checkpoint tensor;
    `prequantized`: read from the checkpoint through `reader`, the load's own (models.loader.load_model sets
    it)."""

    def __init__(self, spec: QuantSpec, c: ModelConfig, dtype, device, prequantized: bool = False) -> None:
        self.spec, self.dtype, self.device, self.prequantized = spec, dtype, device, prequantized
        self.split = LlamaModel.fused_sizes(c)
        self.reader: CheckpointReader | None = None

    @property
    def quantizes_head(self) -> bool:
        """bitsandbytes leaves the LM head in full precision (as transformers does); weight-only methods do
        not."""
        return self.spec.method in WEIGHT_ONLY_LINEARS

    def quantize_module(self, model: nn.Module, architecture: str) -> int:
        """Swap every plain nn.Linear of a transformers model (already on its device: the generic path) for
        our quantized linear of this spec, the LM head only where the method quantizes it (weight-only);
        widths off the 4-bit kernels' blocks are zero-padded there. Returns how many it swapped."""
        if self.prequantized:
            raise ValueError(f"{architecture} runs on the generic path, which quantizes while loading: a "
                             "pre-quantized bitsandbytes checkpoint is not supported there (load the "
                             f"unquantized one with quantization={self.spec.method!r})")
        head = model.get_output_embeddings()
        chosen = [(name, mod) for name, mod in model.named_modules()
                  if type(mod) is nn.Linear and (mod is not head or self.quantizes_head)]
        for name, mod in chosen:
            if self.spec.method in WEIGHT_ONLY_LINEARS:
                new = WEIGHT_ONLY_LINEARS[self.spec.method](mod.weight, mod.bias, self.dtype)
            else:
                new = quantized_linear(self.spec, mod.weight, mod.bias, self.dtype)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, new)
            release_freed_memory()
        return len(chosen)

    def __call__(self, prefix: str, linear: nn.Linear) -> nn.Module:
        release_freed_memory()
        if self.spec.method in WEIGHT_ONLY_LINEARS:
            return WEIGHT_ONLY_LINEARS[self.spec.method](linear.weight, linear.bias, self.dtype)
        names = part_names(prefix)
        if self.prequantized:
            if self.reader is None:
                raise RuntimeError("a pre-quantized checkpoint's linears are read through the load's reader")
            parts = [read_linear(self.spec, self.reader, n, self.dtype, self.device) for n in names]
        else:
            sizes = next((s for k, s in self.split.items() if prefix.endswith(k)), [linear.out_features])
            biases = linear.bias.split(sizes) if linear.bias is not None else [None] * len(sizes)
            parts = [quantized_linear(self.spec, w, b, self.dtype)
                     for w, b in zip(linear.weight.split(sizes), biases, strict=True)]
        return parts[0] if len(parts) == 1 else FusedLinear(parts)
