"""Which implementation serves a step: decided here, once, into a `StepPlan` that the runner and the model
read.

A runner's plan is built once from its device, the model's dtype, the KV dtype, the model's needs and the CPU
ISA tier (`plan`); each step then only settles what depends on the step's shape (`StepPlan.for_step`): whether
the whole decoder stack runs as one C++ call. Per-op choices that depend on one call's row count (which GEMV
or matmul a linear runs) stay inside the kernel modules, which the plan's `gemv` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from sluice.kernels import cpu_attention, cpu_isa, decode_stack
from sluice.kernels.attention import AttentionMetadata
from sluice.kernels.device_path import flat_layout, triton_on
from sluice.kernels.linear import gemv_available


@dataclass(frozen=True, slots=True)
class StepPlan:
    """How a step runs: its metadata's layout, its attention kernel, its linears' kernels, the decode
    stack."""

    tier: str  # the CPU ISA tier the C++ kernels are built for ("cuda" on a GPU)
    dtype: torch.dtype  # the model's activations
    kv_dtype: torch.dtype  # the KV pool's
    flat: bool  # FlatMetadata steps: Triton on CUDA (device_path), its sync-free torch reference elsewhere
    triton: bool  # Triton kernels serve this device
    fused_attention: bool  # short queries (decode, verify) on the fused C++ attention (plain or int8 cache)
    gemv: bool  # bf16 linears at decode rows on the C++ GEMV (kernels.linear decides the rows)
    fused_prefill: bool = False  # long queries (prefills) on it too (cpu_attention.serves_prefill)
    decode_stack: bool = False  # this step's layers as one C++ call (kernels.decode_stack)
    # this plan with decode_stack set, made once by `plan` where a stack can serve (a step only picks it)
    stacked: StepPlan | None = field(default=None, repr=False, compare=False)

    def for_step(self, ids: torch.Tensor, meta) -> StepPlan:
        """This plan for one step of token ids [T] over metadata `meta` (built with `fused_attention`)."""
        if self.stacked is not None and decode_stack.step_fits(ids, self.dtype, meta):
            return self.stacked
        return self


def plan(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
         flat_model: bool = False) -> StepPlan:
    """The plan of a runner on `device` with a model in `dtype` over a `kv_dtype` pool; `flat_model`: the
    model needs FlatMetadata wherever it runs (the generic path's windowed layers)."""
    cpu = device.type == "cpu"
    flat = flat_layout(device) or flat_model
    same_or_int8 = kv_dtype == dtype or kv_dtype == torch.int8
    fused = cpu and not flat and same_or_int8 and cpu_attention.available()
    gemv = cpu and dtype == torch.bfloat16 and gemv_available()
    fields = (cpu_isa.tier() if cpu else device.type, dtype, kv_dtype, flat, triton_on(device), fused, gemv,
              fused and cpu_attention.serves_prefill(dtype, kv_dtype))
    return StepPlan(*fields, stacked=StepPlan(*fields, decode_stack=True) if fused and gemv else None)


def plan_of_step(ids: torch.Tensor, dtype: torch.dtype, kv_dtype: torch.dtype, meta) -> StepPlan:
    """The plan of a step whose metadata was built without one (a model called directly: tests, CUDA graphs):
    fused attention as `meta` has it."""
    base = plan(ids.device, dtype, kv_dtype, flat_model=not isinstance(meta, AttentionMetadata))
    if base.fused_attention and getattr(meta, "fused_short", None) is None:
        base = replace(base, fused_attention=False, stacked=None)
    return base.for_step(ids, meta)

