"""Adapters in working memory: `max_loras` slots of stacked low-rank weights per decoder projection, and the
step's mapping of tokens to slots that the LoRA projections read."""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine.lora.adapter import PROJECTIONS, LoRAAdapter
from sluice.kernels.lora_groups import Rows, add_lora, token_groups


class LoRASlots:
    """Per (layer, projection): A [max_loras, parts * max_rank, in] and B [max_loras, out, parts * max_rank];
    part p of a fused projection owns rank rows [p * max_rank, (p + 1) * max_rank) and its own output rows."""

    def __init__(self, max_loras: int, max_rank: int, shapes: dict[str, list[tuple[int, int]]],
                 num_layers: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras, self.max_rank, self.shapes = max_loras, max_rank, shapes
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(num_layers):
            for proj, parts in shapes.items():
                inp, out = parts[0][1], sum(o for o, _ in parts)
                width = len(parts) * max_rank
                self.a[layer, proj] = torch.zeros(max_loras, width, inp, dtype=dtype, device=device)
                self.b[layer, proj] = torch.zeros(max_loras, out, width, dtype=dtype, device=device)
        # projections each slot's adapter changes
        self.serves: list[set[str]] = [set() for _ in range(max_loras)]
        self.groups: dict[str, list[tuple[int, Rows]]] = {}
        self.token_slots: torch.Tensor | None = None  # each flat token's slot (-1: none), for the CUDA kernel

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into a slot (zeros where it has no pair), its scaling folded into B."""
        for key in self.a:
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
        self.serves[slot] = set()
        for (layer, proj, part), pair in adapter.pairs.items():
            r, lo = pair.rank, part * self.max_rank
            first = sum(o for o, _ in self.shapes[proj][:part])
            out = self.shapes[proj][part][0]
            a, b = self.a[layer, proj], self.b[layer, proj]
            a[slot, lo:lo + r].copy_(pair.a)
            b[slot, first:first + out, lo:lo + r].copy_(pair.b.float() * pair.scaling)
            self.serves[slot].add(proj)

    def set_step(self, token_slots: list[int] | None, device: torch.device) -> None:
        """The mapping of the coming forward: each flat token's slot (-1 or None throughout: no adapter)."""
        if not token_slots or max(token_slots) < 0:
            self.groups, self.token_slots = {}, None
            return
        groups = token_groups(token_slots, device)
        if device.type == "cuda":
            self.token_slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
        self.groups = {proj: [g for g in groups if proj in self.serves[g[0]]] for proj in self.shapes}

    @property
    def active(self) -> bool:
        """Whether the coming forward adds any adapter's update."""
        return any(self.groups.values())

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus the step's adapters' updates of this projection."""
        groups = self.groups.get(proj)
        if not groups:
            return y
        return add_lora(y, x, self.a[layer, proj], self.b[layer, proj], groups, self.token_slots)


class LoRALinear(nn.Module):
    """A decoder projection with the step's adapter updates added to its base output."""

    def __init__(self, base: nn.Module, slots: LoRASlots, layer: int, proj: str) -> None:
        super().__init__()
        self.base, self.slots, self.layer, self.proj = base, slots, layer, proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self.slots.apply(self.layer, self.proj, rows, self.base(x).reshape(rows.shape[0], -1)).view(
            *x.shape[:-1], -1)

    def stack_linear(self):
        """The base linear for the decode stack (which runs only the steps without adapters)."""
        from sluice.engine.models.llama import stack_linear

        return stack_linear(self.base)


def projection_shapes(config) -> dict[str, list[tuple[int, int]]]:
    """(out, in) of each part of each decoder projection of a native model
    (engine.models.llama.ModelConfig)."""
    h, q, kv, inter = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim, config.intermediate_size
    shapes = {"self_attn.qkv_proj": [(q, h), (kv, h), (kv, h)], "self_attn.o_proj": [(h, q)],
              "mlp.gate_up_proj": [(inter, h), (inter, h)], "mlp.down_proj": [(h, inter)]}
    assert all(len(shapes[p]) == n for p, n in PROJECTIONS.items())
    return shapes
