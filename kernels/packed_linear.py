"""fp32 linears with the weight prepacked once for oneDNN on CPU, their epilogues fused, F.linear elsewhere.

As torch's inductor does under freezing: the weight is reordered once into oneDNN's blocked layout
(`mkldnn._reorder_linear_weight`), and each call (`mkldnn._linear_pointwise`) adds the bias and applies GELU,
ReLU or SiLU, or adds a residual, while its output tile is still in cache, instead of a separate pass over
the whole activation. On any other device or dtype, or without oneDNN, the same results come from F.linear
and the plain ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# activation name (config.json's hidden_act) -> (oneDNN post-op, its algorithm argument)
FUSED_ACTIVATIONS = {
    "gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""), "silu": ("swish", ""), "swish": ("swish", ""),
}


def packable(linear: nn.Linear) -> bool:
    """Whether oneDNN can serve this linear prepacked: an fp32 weight on CPU, oneDNN built in."""
    w = linear.weight
    return (w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear:
    """One linear, prepacked for oneDNN where `packable`, else served by F.linear; `act` and `add` fuse
    an activation or a residual add into it."""

    def __init__(self, linear: nn.Linear) -> None:
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight) if packable(linear) else None

    def _usable(self, x: torch.Tensor) -> bool:
        return self.packed is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b."""
        if self._usable(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def act(self, x: torch.Tensor, name: str,
            fallback: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """fallback(x @ W.T + b), the activation `name` fused into the linear where oneDNN has it."""
        if name in FUSED_ACTIVATIONS and self._usable(x):
            attr, algorithm = FUSED_ACTIVATIONS[name]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, attr, [], algorithm)
        return fallback(F.linear(x, self.weight, self.bias))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b + residual, the add fused into the linear."""
        if self._usable(x) and residual.is_contiguous() and residual.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        return F.linear(x, self.weight, self.bias) + residual
