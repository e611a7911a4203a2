"""LLM.int8() and bitsandbytes 4-bit linears, built from loaded weights (quantize while loading) or from
pre-quantized tensors."""

from __future__ import annotations

import copy
import ctypes
import functools
import itertools
import sys
from typing import Any

import torch
from torch import nn

from sluice import kernels
from sluice.engine.models.llama import LlamaModel, ModelConfig
from sluice.engine.models.loader import CheckpointReader
from sluice.engine.quantization.int8_cpu import LLMInt8Linear
from sluice.engine.quantization.spec import BLOCKSIZE, CPU_INT4_ROWS, INT4_WEIGHT_ONLY, WEIGHT_ONLY, QuantSpec
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


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Parameter | None:
    return None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)


def int8_linear(spec: QuantSpec, cb: torch.Tensor, scb: torch.Tensor, bias, dtype) -> nn.Module:
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
    """CB and SCB of a weight [out, in] as bitsandbytes' int8_vectorwise_quant gives them for its fp16 copy: on CPU
    ours (the same bits: tests/test_quant_kernels.py), elsewhere bitsandbytes' own."""
    if weight.device.type != "cpu":
        return _bnb().functional.int8_vectorwise_quant(weight.to(torch.float16))[:2]
    return int8_weights.bnb_int8_rows(weight) or int8_weights.bnb_int8_act(weight, 0.0)[:2]


def int4_linear(spec: QuantSpec, packed: torch.Tensor, quant_state, bias, dtype) -> nn.Module:
    """Linear4bit over packed 4-bit `packed` and its QuantState, computing in `dtype`."""
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
    """Put every bitsandbytes 4-bit linear of a CPU model in the layout bitsandbytes' CPU kernel reads, which its
    first forward makes otherwise (`_convert_weight_packed_for_cpu`: every code widened to int32, transposed and
    packed again, a large share of a model's warm-up): the same bytes by uint8 ops on the packed ones (faster:
    docs/benchmarks.md), where a probe shows this bitsandbytes' own result; returns the linears packed."""
    if "bitsandbytes" not in sys.modules or not _cpu_packing_matches_bnb():
        return 0
    done, linear4bit = 0, _bnb().nn.Linear4bit
    for mod in model.modules():
        if isinstance(mod, linear4bit) and _cpu_packable(mod):
            mod.weight.data, _ = _packed_for_cpu(mod.weight.data, mod.weight.quant_state)
            done += 1
    return done


def _cpu_packable(mod: nn.Module) -> bool:
    """Whether bitsandbytes' forward would repack this Linear4bit for its CPU kernel (its own conditions)."""
    state = getattr(mod.weight, "quant_state", None)
    return (state is not None and mod.weight.device.type == "cpu" and mod.support_avx512bf16_for_cpu
            and not mod.training and not getattr(state, "packing_format_for_cpu", False)
            and state.shape[0] % 32 == 0 and state.shape[1] % 2 == 0)


def _packed_for_cpu(packed: torch.Tensor, state) -> tuple[torch.Tensor, object]:
    """bitsandbytes' CPU layout of a 4-bit weight and its QuantState, updated in place as its
    `_convert_weight_packed_for_cpu` does: per block of 32 rows, byte i of column pair kk holds code 2 kk + i % 2
    of rows i / 2 (low nibble) and 16 + i / 2 (high); absmax dequantized if nested, [blocks, rows] in bf16."""
    q = packed.view(torch.uint8)
    if packed.dtype != torch.uint8:
        state.original_storage_type = packed.dtype
    state.original_dtype, state.original_nested, state.original_qshape = state.dtype, state.nested, q.shape
    n, half = state.shape[0], state.shape[1] // 2
    v = q.reshape(n // 32, 2, 16, half)
    lo, hi = v[:, 0], v[:, 1]  # rows 0-15 and 16-31 of each block; a byte's high nibble is the even code
    pairs = torch.stack(((hi & 0xF0) | (lo >> 4), (hi << 4) | (lo & 0x0F)), dim=-1)
    out = pairs.permute(0, 2, 1, 3).contiguous().view(n, half)
    if state.nested:
        absmax = _bnb().functional.dequantize_blockwise(state.absmax, state.state2)
        absmax += state.offset
        state.absmax, state.nested = absmax.float(), False
        delattr(state, "state2")
    state.absmax = state.absmax.reshape(n, state.shape[1] // state.blocksize).T.to(torch.bfloat16).contiguous()
    state.dtype = torch.bfloat16
    state.packing_format_for_cpu = True
    return out, state


@functools.cache
def _cpu_packing_matches_bnb() -> bool:
    """Whether `_packed_for_cpu` gives this bitsandbytes' own bytes and QuantState (NF4 and FP4, nested or not),
    checked once per process; another version that packs otherwise keeps its own first-forward repack."""
    F = _bnb().functional
    convert = getattr(F, "_convert_weight_packed_for_cpu", None)
    if convert is None:
        return False
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for quant_type, nested in itertools.product(("nf4", "fp4"), (False, True)):
        packed, state = F.quantize_4bit(w, blocksize=BLOCKSIZE, compress_statistics=nested, quant_type=quant_type)
        theirs = convert(packed.clone(), copy.deepcopy(state))
        ours = _packed_for_cpu(packed.clone(), copy.deepcopy(state))
        if not torch.equal(ours[0], theirs[0]) or not _same_state(ours[1], theirs[1]):
            return False
    return True


def _same_state(a, b) -> bool:
    va, vb = vars(a), vars(b)
    return va.keys() == vb.keys() and all(
        (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)) if isinstance(x, torch.Tensor)
        else x == y for x, y in ((va[k], vb[k]) for k in va))


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
        # what the CPU int8 product subtracts per row, computed once here instead of on every call (not saved)
        self.register_buffer("comp", int8_weights.vnni_comp(self.qweight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.int8_linear(x, self.qweight, self.scales, self.bias, self.comp)

    def stack_linear(self):
        """This linear for kernels.decode_stack, or None where the stack would not run it as `forward` does."""
        return decode_stack.int8_linear(self.qweight, self.scales, self.bias, self.comp)


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
        """This linear for kernels.decode_stack, or None where the stack would not run it as `forward` does."""
        return None if self.pad else decode_stack.int4_linear(self.weight(), self.bias)


WEIGHT_ONLY_LINEARS = {WEIGHT_ONLY: Int8WeightOnlyLinear, INT4_WEIGHT_ONLY: Int4WeightOnlyLinear}


def quantized_linear(spec: QuantSpec, weight: torch.Tensor, bias: torch.Tensor | None, dtype) -> nn.Module:
    """Quantize one weight [out, in] (already on its device) into the spec's LLM.int8() or bitsandbytes 4-bit
    linear."""
    if spec.method == "int8":
        return int8_linear(spec, *int8_rows(weight), bias, dtype)
    n_out, n_in = weight.shape
    pads = (-n_in % BLOCKSIZE, -n_out % CPU_INT4_ROWS) if weight.device.type == "cpu" else (0, 0)
    if any(pads):  # bitsandbytes' CPU kernel packs whole blocks of 32 rows x 64 columns (MoE experts' widths vary)
        weight = nn.functional.pad(weight, (0, pads[0], 0, pads[1]))
        bias = None if bias is None else nn.functional.pad(bias, (0, pads[1]))
    packed, state = _quantize_4bit(spec, weight.to(dtype).contiguous())
    mod = int4_linear(spec, packed, state, bias, dtype)
    return ZeroPadded(mod, pads[0], n_out) if any(pads) else mod


def _quantize_4bit(spec: QuantSpec, w: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """bitsandbytes' 4-bit packing of w, through our CPU function where it gives bitsandbytes' exact bits."""
    if w.device.type == "cpu" and _cpu_4bit_matches_bnb():
        return cpu_quantize_4bit(w, spec.quant_type, spec.double_quant)
    F = _bnb().functional
    return F.quantize_4bit(w, blocksize=BLOCKSIZE, compress_statistics=spec.double_quant, quant_type=spec.quant_type)


class ZeroPadded(nn.Module):
    """A linear whose weight was padded with zero columns and rows: the input padded with zeros to match (adds
    exactly 0), the output cut back to `out_features`."""

    def __init__(self, inner: nn.Module, pad: int, out_features: int) -> None:
        super().__init__()
        self.inner, self.pad, self.out_features = inner, pad, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(nn.functional.pad(x, (0, self.pad)) if self.pad else x)
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]


@functools.cache
def _cpu_4bit_tables() -> dict[str, tuple] | None:
    """bitsandbytes' NF4/FP4 rounding bounds (and FP4's code order) for our C++ blocks pass, or None where either
    is missing (then bitsandbytes' own op quantizes)."""
    try:
        from bitsandbytes.backends.default.ops import _get_4bit_quantize_bounds
    except ImportError:
        return None
    if int4_weights.bnb_4bit_kernel() is None:
        return None
    tables = {}
    for kind in ("nf4", "fp4"):
        bounds, order = _get_4bit_quantize_bounds(kind, torch.device("cpu"))
        tables[kind] = (bounds.float().contiguous(), None if kind == "nf4" else order.contiguous())
    return tables


def cpu_quantize_4bit(w: torch.Tensor, quant_type: str, nested: bool) -> tuple[torch.Tensor, object]:
    """F.quantize_4bit of a contiguous CPU weight (blocks of BLOCKSIZE, uint8 storage) with its blocks quantized by
    one C++ pass (`bnb_4bit_blocks`, 16 values a step) in place of bitsandbytes' torch ops; the QuantState is
    bitsandbytes' own, built as F.quantize_4bit builds it. Use where `_cpu_4bit_matches_bnb`."""
    F = _bnb().functional
    bounds, order = _cpu_4bit_tables()[quant_type]
    packed, absmax = int4_weights.bnb_4bit_kernel()(w, BLOCKSIZE, bounds, order)
    kw = dict(shape=w.shape, dtype=w.dtype, blocksize=BLOCKSIZE, code=F.get_4bit_type(quant_type, device=w.device),
              quant_type=quant_type)
    if not nested:
        return packed.unsqueeze(1), F.QuantState(absmax=absmax, **kw)
    offset = absmax.mean()
    qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
    return packed.unsqueeze(1), F.QuantState(absmax=qabsmax, offset=offset, state2=state2, **kw)


@functools.cache
def _cpu_4bit_matches_bnb() -> bool:
    """Whether `cpu_quantize_4bit` gives the installed bitsandbytes' own codes and QuantState for NF4 and FP4, nested
    or not (a zero block and a short last block included), checked once per process; another version that
    quantizes otherwise keeps its own op."""
    if _cpu_4bit_tables() is None:
        return False
    F = _bnb().functional
    probe = (torch.randn(64 * 2048 + 37, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
    probe[:70] = 0
    for kind, nested in itertools.product(("nf4", "fp4"), (False, True)):
        ours = cpu_quantize_4bit(probe, kind, nested)
        theirs = F.quantize_4bit(probe, blocksize=BLOCKSIZE, compress_statistics=nested, quant_type=kind)
        if not torch.equal(ours[0], theirs[0]) or not _same_state(ours[1], theirs[1]):
            return False
    return True


def read_linear(spec: QuantSpec, reader: CheckpointReader, name: str, dtype, device) -> nn.Module:
    """A pre-quantized linear from its checkpoint tensors; unquantized ones (skipped modules) stay plain."""
    get = lambda key: reader.get(key).to(device)  # noqa: E731
    bias = get(f"{name}.bias") if f"{name}.bias" in reader else None
    weight = get(f"{name}.weight")
    if f"{name}.SCB" in reader:
        return int8_linear(spec, weight, get(f"{name}.SCB"), bias, dtype)
    stats = {k.removeprefix(f"{name}.weight."): get(k) for k in reader.names() if k.startswith(f"{name}.weight.")}
    if stats:
        state = _bnb().functional.QuantState.from_dict(stats, device=device)
        return int4_linear(spec, weight, state, bias, dtype)
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
    """The loader's linear hook: each loaded linear becomes bitsandbytes linears, one per checkpoint tensor."""

    def __init__(self, spec: QuantSpec, c: ModelConfig, dtype, device, reader: CheckpointReader | None) -> None:
        self.spec, self.dtype, self.device, self.reader = spec, dtype, device, reader
        self.split = LlamaModel.fused_sizes(c)
        self.prequantized = reader is not None

    @property
    def quantizes_head(self) -> bool:
        """bitsandbytes leaves the LM head in full precision (as transformers does); weight-only methods do not."""
        return self.spec.method in WEIGHT_ONLY_LINEARS

    def quantize_module(self, model: nn.Module, architecture: str) -> int:
        """Swap every plain nn.Linear of a transformers model (already on its device: the generic path) for our
        quantized linear of this spec, the LM head only where the method quantizes it (weight-only); widths off the
        4-bit kernels' blocks are zero-padded there. Returns how many it swapped."""
        if self.prequantized:
            raise ValueError(f"{architecture} runs on the generic path, which quantizes while loading: a "
                             f"pre-quantized bitsandbytes checkpoint is not supported there (load the unquantized "
                             f"one with quantization={self.spec.method!r})")
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
        if self.reader is not None:
            parts = [read_linear(self.spec, self.reader, n, self.dtype, self.device) for n in names]
        else:
            sizes = next((s for k, s in self.split.items() if prefix.endswith(k)), [linear.out_features])
            biases = linear.bias.split(sizes) if linear.bias is not None else [None] * len(sizes)
            parts = [quantized_linear(self.spec, w, b, self.dtype)
                     for w, b in zip(linear.weight.split(sizes), biases, strict=True)]
        return parts[0] if len(parts) == 1 else FusedLinear(parts)
