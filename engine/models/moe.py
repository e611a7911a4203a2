"""Sparse mixture-of-experts MLP for the native forward (Mixtral, Qwen3-MoE): top-k routing, tokens grouped by
expert (one sort, then one matmul per expert over all of its tokens), results scattered back in one index_add;
on CPU in bf16 with unquantized experts, the grouping and the experts run in one C++ call per layer
(kernels.expert_kernel): every step where the holder multiplies with AMX tiles (bf16 experts of whole
multiples of 32 wide on an AMX CPU), else steps of up to CPP_MAX_TOKENS tokens (decode), longer ones (prefill)
keeping the per-expert matmuls, whose many rows per expert the matmul library multiplies faster than the C++
vector tiles (docs/benchmarks.md).

Experts are kept as the checkpoint stores them (one linear per projection per expert, under the checkpoint's
own names), so the loader reads them as any other linear and a quantization hook quantizes each expert; the
router is not a linear, so it stays in the model dtype and routing stays exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels import expert_kernel as moe_kernel
from sluice.kernels.linear import Linear

# Per architecture: the MoE block's attribute name in a decoder layer, each expert's (gate, up, down) linear
# names, and whether the routing weights stay fp32 (Mixtral) or are cast to the activations' dtype
# (Qwen3-MoE).
MOE_LAYOUTS = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), True),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), False),
}
# tokens of a step up to which the C++ vector tiles serve (past it: the per-expert matmuls)
CPP_MAX_TOKENS = 64


class Router(nn.Module):
    """The gate's [experts, hidden] weight (deliberately not a linear: quantization hooks leave it alone)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class Expert(nn.Module):
    """One SwiGLU expert under the checkpoint's linear names."""

    def __init__(self, hidden: int, inner: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        for name, (i, o) in zip(names, ((hidden, inner), (hidden, inner), (inner, hidden)), strict=True):
            setattr(self, name, Linear(i, o, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class SparseMoe(nn.Module):
    """Top-k of `num_experts` SwiGLU experts per token, weights renormalised over the k where `norm_topk`."""

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int, norm_topk: bool,
                 layout: str) -> None:
        super().__init__()
        _, names, self.fp32_weights = MOE_LAYOUTS[layout]
        self.gate = Router(num_experts, hidden)
        self.experts = nn.ModuleList(Expert(hidden, inner, names) for _ in range(num_experts))
        self.top_k, self.norm_topk = top_k, norm_topk
        # kernels.expert_kernel's holder of the expert weights once made (False: not for these)
        self.cpp_experts = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each [T, k], as transformers computes them (softmax in fp32)."""
        probs = F.linear(x, self.gate.weight).softmax(-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]: each token's weighted sum over its top-k experts."""
        weights, ids = self.route(x)
        kernel = self._kernel(x)
        if kernel is not None and (kernel.amx or x.shape[0] <= CPP_MAX_TOKENS):
            return kernel.forward(x, ids, weights)
        return self.grouped(x, weights, ids)

    def _kernel(self, x: torch.Tensor):
        """The C++ experts (kernels.expert_kernel: grouping and SwiGLU in one call, fp32 sums) for bf16
        activations on CPU over unquantized bf16 experts, made once; None elsewhere (quantized experts, other
        dtypes and devices)."""
        if x.device.type != "cpu" or x.dtype is not torch.bfloat16 or torch.is_grad_enabled():
            return None
        if self.cpp_experts is None:
            parts = [[getattr(e, n) for e in self.experts] for n in self.experts[0].names]
            plain = all(type(p) is Linear and p.weight.dtype is torch.bfloat16 for ps in parts for p in ps)
            held = moe_kernel.experts(*[[p.weight for p in ps] for ps in parts]) if plain else None
            self.cpp_experts = held if held is not None else False
        return self.cpp_experts or None

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts in torch: the (token, slot) pairs sorted by expert, one call per expert on its
        tokens."""
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        routed = x[tokens]
        scale = weights.reshape(-1)[order, None]
        ys = torch.empty(routed.shape, dtype=x.dtype, device=x.device)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                rows = slice(start, start + n)
                ys[rows] = (expert(routed[rows]) * scale[rows]).to(x.dtype)
                start += n
        return torch.zeros_like(x).index_add_(0, tokens, ys)
