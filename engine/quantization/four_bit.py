"""bitsandbytes' 4-bit linears (NF4 / FP4, blocks of 64) on CPU without importing bitsandbytes.

bitsandbytes' serialized state is parsed here (`State4bit.from_dict`: packed codes, absmax fp32 or nested,
the code table, the JSON `quant_state.bitsandbytes__nf4|fp4`) and written back in the same form
(`State4bit.as_dict`), so a checkpoint round-trips; quantizing while loading gives bitsandbytes' own bits
(`quantize_4bit`: our C++ blocks pass, bitsandbytes' default quantize_4bit with torch ops where it does not
build, and its CPU blockwise 8-bit quantization of the absmax for double quant). `Linear4bitCpu` multiplies
with kernels.nf4, in the checkpoint's byte layout; `pack()` (at load: `pack_4bit_for_cpu`) replaces the
absmax, nested or fp32, by its bf16 copy [out, in / 64] (what bitsandbytes' CPU kernel multiplies with), after
which the module no longer holds bitsandbytes' state.
"""

from __future__ import annotations

import functools
import itertools
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from sluice.kernels import decode_stack, int4_weights
from sluice.kernels import nf4 as nf4_kernels

BLOCKSIZE = 64
# storage for a tensor (a weight arena's)
Empty = Callable[[tuple[int, ...], torch.dtype], "torch.Tensor | None"]
NESTED_BLOCKSIZE = 256
# bitsandbytes' get_4bit_type tables before their normalization by the largest magnitude (FP4: 1 sign, 2
# exponent and 1 mantissa bits in bit-pattern order; its negative zero is written as the integer -0 there, so
# +0)
LEVELS = {
    "nf4": (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0),
    "fp4": (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0),
}


def _f32(x: float) -> float:
    """`x` rounded to the nearest fp32 value (ties to even), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


@functools.cache
def _levels(quant_type: str) -> tuple[float, ...]:
    """The 16 fp32 values of a 4-bit type (bitsandbytes' get_4bit_type: the levels over the largest magnitude,
    in fp32) as Python floats: an fp32 quotient computed in float64 and rounded once is fp32's own. Tables
    this small are not worth torch's kernels, whose code pages (a sort's above all) a process keeps resident
    once touched."""
    data = [_f32(v) for v in LEVELS[quant_type]]
    top = max(abs(v) for v in data)
    return tuple(_f32(v / top) for v in data)


def code_table(quant_type: str) -> torch.Tensor:
    """The 16 fp32 values of a 4-bit type, as bitsandbytes' get_4bit_type builds them (a fresh tensor)."""
    return torch.tensor(_levels(quant_type), dtype=torch.float32)


@functools.cache
def _bounds(quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The 15 midpoints between the sorted levels and the sort order (bitsandbytes' quantize bounds: fp32 sums
    halved), in Python (`_levels`); equal levels (FP4's two zeros) keep their order."""
    code = _levels(quant_type)
    order = sorted(range(len(code)), key=code.__getitem__)
    mids = [_f32(code[a] + code[b]) / 2 for a, b in itertools.pairwise(order)]
    return torch.tensor(mids, dtype=torch.float32), torch.tensor(order, dtype=torch.int64)


@functools.cache
def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (create_dynamic_map), the nested absmax's code table."""
    data: list[float] = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
    return torch.tensor(sorted([*data, 0.0, 1.0]), dtype=torch.float32)


def quantize_blockwise(a: torch.Tensor,
                       blocksize: int = NESTED_BLOCKSIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values to 8-bit codes of `dynamic_map` and an absmax per block, as bitsandbytes' CPU
    quantize_blockwise does: each value times the reciprocal of its block's absmax, clamped to [-1, 1], looked
    up in a table of 65536 evenly spaced values (`_lookup`) that holds each one's nearest code; a block of
    zeros gets code 0."""
    n = a.numel()
    blocks = -(n // -blocksize)
    padded = torch.nn.functional.pad(a.reshape(-1).float(),
                                     (0, blocks * blocksize - n)).view(blocks, blocksize)
    absmax = padded.abs().amax(1)  # the zeros padding a short block change no maximum
    inverse = torch.where(absmax > 0, 1.0 / absmax, 0.0)
    scaled = (padded * inverse[:, None]).clamp_(-1.0, 1.0)
    index = ((scaled + 1.0) * 0.5 * (LOOKUP - 1) + 0.5).long()  # fp32 steps, truncated as a cast truncates
    q = _lookup()[index]
    q[absmax == 0] = 0
    return q.view(-1)[:n].contiguous(), absmax


LOOKUP = 65536


@functools.cache
def _lookup() -> torch.Tensor:
    """bitsandbytes' quantize table: for value -1 + 2 i / 65535 (fp32), the number of midpoints between
    consecutive `dynamic_map` codes below it."""
    code = dynamic_map()
    midpoints = 0.5 * (code[:-1] + code[1:])
    values = -1.0 + (2.0 * torch.arange(LOOKUP, dtype=torch.float32)) / (LOOKUP - 1)
    return torch.searchsorted(midpoints, values).to(torch.uint8)


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                         blocksize: int) -> torch.Tensor:
    """code[q] * its block's absmax in fp32 (bitsandbytes' dequantize_blockwise on CPU)."""
    n = q.numel()
    values = torch.nn.functional.pad(code.float()[q.reshape(-1).long()], (0, -n % blocksize))
    return (values.view(-1, blocksize) * absmax.float()[:, None]).view(-1)[:n]


@dataclass(slots=True)
class State4bit:
    """bitsandbytes' QuantState of one 4-bit weight as it serializes it: absmax fp32 per block of `blocksize`,
    or (nested) uint8 codes of `nested_quant_map` with an fp32 absmax per `nested_blocksize` of them, plus
    `offset`."""

    quant_type: str
    shape: tuple[int, int]
    dtype: torch.dtype
    absmax: torch.Tensor
    quant_map: torch.Tensor
    blocksize: int = BLOCKSIZE
    # nested_absmax, nested_quant_map (tensors), blocksize, dtype, offset
    nested: dict | None = field(default=None)

    @classmethod
    def from_dict(cls, stats: dict[str, torch.Tensor]) -> State4bit:
        """Parse a linear's `weight.*` tensors (prefix removed): absmax, quant_map, nested_*, and the JSON
        tensor
        `quant_state.bitsandbytes__nf4|fp4`."""
        keys = [k for k in stats if k.startswith("quant_state.bitsandbytes__")]
        if len(keys) != 1:
            raise ValueError(f"expected one quant_state.bitsandbytes__nf4|fp4 tensor, found {keys}")
        meta = json.loads(bytes(stats[keys[0]].to(torch.uint8).tolist()).decode("utf-8"))
        nested = None
        if "nested_absmax" in stats:
            nested = {"absmax": stats["nested_absmax"].float(),
                      "quant_map": stats["nested_quant_map"].float(),
                      "blocksize": int(meta["nested_blocksize"]),
                      "dtype": meta.get("nested_dtype", "float32"), "offset": float(meta["nested_offset"])}
        return cls(quant_type=meta["quant_type"], shape=tuple(meta["shape"]),
                   dtype=getattr(torch, meta["dtype"]),
                   absmax=stats["absmax"], quant_map=stats["quant_map"].float(),
                   blocksize=int(meta["blocksize"]), nested=nested)

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The tensors bitsandbytes' Params4bit saves beside `weight` (its
        QuantState.as_dict(packed=True))."""
        meta = {"quant_type": self.quant_type, "blocksize": self.blocksize,
                "dtype": str(self.dtype).strip("torch."), "shape": list(self.shape)}
        out = {"absmax": self.absmax, "quant_map": self.quant_map}
        if self.nested is not None:
            out |= {"nested_absmax": self.nested["absmax"], "nested_quant_map": self.nested["quant_map"]}
            meta |= {"nested_blocksize": self.nested["blocksize"], "nested_dtype": self.nested["dtype"],
                     "nested_offset": self.nested["offset"]}
        data = torch.tensor(list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)
        return out | {f"quant_state.bitsandbytes__{self.quant_type}": data}

    def absmax_fp32(self) -> torch.Tensor:
        """The absmax per block in fp32, the nested codes dequantized plus the offset (as bitsandbytes
        does)."""
        if self.nested is None:
            return self.absmax.float()
        n = self.nested
        values = dequantize_blockwise(self.absmax, n["absmax"], n["quant_map"], n["blocksize"])
        return values + torch.tensor(n["offset"], dtype=torch.float32)


def quantize_4bit(w: torch.Tensor, quant_type: str, nested: bool) -> tuple[torch.Tensor, State4bit]:
    """bitsandbytes' quantize_4bit of a weight [out, in] (blocks of 64, uint8 storage): its packed codes
    [out * in / 2, 1] and state, bit for bit (double quant: the absmax less its mean, blockwise 8-bit)."""
    bounds, order = _bounds(quant_type)
    kernel = int4_weights.bnb_4bit_kernel() if w.device.type == "cpu" else None
    x = w.contiguous()
    if kernel is not None:
        packed, absmax = kernel(x, BLOCKSIZE, bounds, None if quant_type == "nf4" else order)
    else:
        packed, absmax = _quantize_blocks(x, bounds.to(x.device), order.to(x.device), quant_type)
    state = State4bit(quant_type, tuple(w.shape), w.dtype, absmax, code_table(quant_type).to(w.device))
    if nested:
        offset = absmax.mean()
        codes, nested_absmax = quantize_blockwise(absmax - offset)
        state.absmax = codes
        state.nested = {"absmax": nested_absmax, "quant_map": dynamic_map().clone(),
                        "blocksize": NESTED_BLOCKSIZE, "dtype": "float32", "offset": offset.item()}
    return packed.view(-1, 1), state


def _quantize_blocks(x: torch.Tensor, bounds: torch.Tensor, order: torch.Tensor, quant_type: str):
    """bitsandbytes' default quantize_4bit by torch ops (where our C++ pass does not build)."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    full = n - n % BLOCKSIZE
    blocks = flat[:full].view(-1, BLOCKSIZE)
    absmax = blocks.abs().amax(-1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1), -1, 1).view(-1)
    if n % BLOCKSIZE:
        last = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, last.view(1)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / last, -1, 1)])
    if scaled.numel() % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    q = torch.bucketize(scaled, bounds, out_int32=True)
    q = (q if quant_type == "nf4" else order[q]).to(torch.uint8)
    return (q[::2] << 4) | q[1::2], absmax


class Linear4bitCpu(nn.Module):
    """bitsandbytes' Linear4bit on CPU by kernels.nf4: `codes` [out, in / 2] are the checkpoint's packed bytes
    as they are; until `pack()` the module holds bitsandbytes' state (and saves it as bitsandbytes does),
    after it the absmax in bf16 [out, in / 64] (the rest of the state dropped)."""

    def __init__(self, packed: torch.Tensor, state: State4bit, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = state.shape
        err = nf4_kernels.shape_error(*state.shape)
        if err is not None or state.blocksize != BLOCKSIZE:
            raise ValueError(f"4-bit weight {state.shape} (blocksize {state.blocksize}) cannot run on CPU: "
                             f"{err or f'blocksize must be {BLOCKSIZE}'}")
        flat = packed.contiguous().view(torch.uint8)  # a tensor of its own, not a view: no base kept alive
        codes = torch.empty(0, dtype=torch.uint8, device=flat.device).set_(
            flat.untyped_storage(), flat.storage_offset(), (self.out_features, self.in_features // 2))
        self.register_buffer("codes", codes)
        self.register_buffer("table", state.quant_map.float().contiguous())
        self.register_buffer("absmax", None)
        self.state: State4bit | None = state
        self.quant_type = state.quant_type
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def pack(self, empty: Empty | None = None) -> bool:
        """Replace bitsandbytes' state by the bf16 absmax the kernel reads (in storage from `empty`, e.g. the
        weight arena's, where it gives some); False when already done."""
        if self.state is None:
            return False
        absmax = self.state.absmax_fp32().view(self.out_features, self.in_features // BLOCKSIZE)
        into = empty(absmax.shape,
                     torch.bfloat16) if empty is not None and absmax.device.type == "cpu" else None
        self.absmax = into.copy_(absmax) if into is not None else absmax.to(torch.bfloat16).contiguous()
        self.state = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state is not None:
            self.pack()
        return nf4_kernels.nf4_linear(x, self.codes, self.absmax, self.table, self.bias)

    def stack_linear(self):
        """This linear for kernels.decode_stack (packed first, as `forward` would), or None where the stack
        would not run it as `forward` does."""
        if self.state is not None:
            self.pack()
        return decode_stack.nf4_stack_linear(self.codes, self.absmax, self.table, self.bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """bitsandbytes' Linear4bit keys: weight (the packed codes [n, 1]), weight.<state>, bias."""
        if self.state is None:
            raise RuntimeError(
                "a packed 4-bit linear no longer holds bitsandbytes' state: save before packing")
        destination[prefix + "weight"] = self.codes.reshape(-1, 1)
        for key, value in self.state.as_dict().items():
            destination[f"{prefix}weight.{key}"] = value
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"quant_type={self.quant_type}")


def pack_for_cpu(model: nn.Module, empty: Empty | None = None) -> int:
    """`pack()` every Linear4bitCpu of a model (at load: the kernels' absmax, bitsandbytes' state freed;
    `empty`: where the absmax goes); returns how many it packed."""
    return sum(mod.pack(empty) for mod in model.modules() if isinstance(mod, Linear4bitCpu))
