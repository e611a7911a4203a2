"""The native models' fused projections: each linear of a layer that concatenates checkpoint linears, and those
linears in order (engine.models.llama.LlamaModel.FUSED; the loader and quantization build them from the parts).

Torch-free on purpose: the worker's read-ahead (engine.weight_reserve) lays the parts back to back before torch is
imported, so that each fused weight is one view of the arena.
"""

from __future__ import annotations

FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
