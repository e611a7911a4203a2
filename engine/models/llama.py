"""Our forward pass for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sluice import kernels
from sluice.engine.kv_cache import LayerKVCache
from sluice.engine.models.fused_layout import FUSED as FUSED_LAYOUT
from sluice.engine.models.generic import generic_config_fields
from sluice.engine.models.moe import MOE_LAYOUTS, SparseMoe
from sluice.engine.models.paths import GENERIC, NATIVE_ARCHITECTURES, model_path_for
from sluice.engine.models.rope import RotaryEmbedding, rope_parameters
from sluice.engine.models.vl_generic import vl_config_fields
from sluice.engine.multimodal.vl_config import is_generic_vision, text_config_of
from sluice.kernels import decode_stack, dispatch
from sluice.kernels.linear import Linear, linear

ARCHITECTURES = NATIVE_ARCHITECTURES


@dataclass(slots=True)
class ModelConfig:
    """The parts of an HF config.json our forward needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: dict[str, Any]
    sliding_window: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None
    # paths.NATIVE: this module's forward; paths.GENERIC: transformers' modules (generic.py)
    path: str = "native"
    num_experts: int = 0  # sparse MoE (moe.py): experts per MoE layer, 0 for a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the sparse MoE block

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read an HF config dict: a native architecture's, else the generic path's (generic.py); refuse what
        neither serves, naming the architecture or feature."""
        if is_generic_vision(cfg):  # transformers' vision-language model (models.vl_generic)
            return cls(**vl_config_fields(cfg))
        cfg = text_config_of(cfg)  # a vision-language checkpoint's language model
        archs = cfg.get("architectures") or []
        try:
            path, _ = model_path_for(cfg)
        except ValueError as e:
            raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r}: {e}; natively "
                             f"supported: {', '.join(ARCHITECTURES)}") from None
        if path == GENERIC:
            return cls(**generic_config_fields(cfg))
        arch = next(a for a in archs if a in ARCHITECTURES)
        family = ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window",
                                                      family in ("mistral", "mixtral")) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            rope=rope_parameters(cfg),
            sliding_window=window,
            eos_token_ids=[eos] if isinstance(eos := cfg.get("eos_token_id"), int) else list(eos or []),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            **_moe_fields(family, cfg),
        )


def _moe_fields(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE settings of a Mixtral or Qwen3-MoE config (none for a dense family)."""
    layers, n = cfg["num_hidden_layers"], cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if family == "mixtral":
        return dict(num_experts=n, num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                    moe_layers=tuple(range(layers)))
    if family == "qwen3_moe":
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        return dict(num_experts=n, num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"],
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    moe_layers=tuple(i for i in range(layers) if n > 0 and i not in dense
                                     and (i + 1) % step == 0))
    return {}


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as HF does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm over x's last dim, any leading shape (Qwen3's per-head q/k norm: rows of a strided qkv
        view, copied to one contiguous [rows, dim] block so the fused kernel takes them, not torch's reference
        ops)."""
        return kernels.add_rms_norm(x.reshape(-1, x.shape[-1]), None, self.weight, self.eps)[1].view(x.shape)

    def add(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)) in one pass where a fused kernel serves; delta None: (x, norm(x))."""
        return kernels.add_rms_norm(x, delta, self.weight, self.eps)


class Attention(nn.Module):
    """Fused qkv projection, rotary embedding, paged attention, output projection."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.scale = c.head_dim**-0.5

    def forward(self, x, cos_sin, kv_cache, meta) -> torch.Tensor:
        """Attention over the step's tokens x [T, hidden]; cos_sin: the step's rotary tables."""
        t, nh = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x).view(t, -1, self.head_dim)  # [T, H + 2 Hkv, D]
        nqk = nh + self.num_kv_heads
        qk = qkv
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qkv[:, :nh]), self.k_norm(qkv[:, nh:nqk])], 1)
        q, k = kernels.rope_qk(qk, *cos_sin, nh, self.num_kv_heads)  # one pass, q and k contiguous
        v = qkv[:, nqk:]
        kv_cache.write(k, v, meta.slot_mapping)
        o = kv_cache.attend(q, k, v, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU with fused gate/up projection."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp_name = "mlp"
        if index in c.moe_layers:  # under the checkpoint's own name (Mixtral: block_sparse_moe)
            family = ARCHITECTURES[c.architecture]
            self.mlp_name = MOE_LAYOUTS[family][0]
            setattr(self, self.mlp_name, SparseMoe(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                                                   c.num_experts_per_tok, c.norm_topk_prob, family))
        else:
            self.mlp = MLP(c)

    def forward(self, x, delta, cos_sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x + delta through this layer: (stream after attention, MLP output to add)."""
        x, h = self.input_layernorm.add(x, delta)
        x, h = self.post_attention_layernorm.add(x, self.self_attn(h, cos_sin, kv_cache, meta))
        return x, getattr(self, self.mlp_name)(h)

    def stack_layer(self, cache) -> list | None:
        """This layer in kernels.decode_stack's order, or None where the stack cannot stand in for it: qk
        norm, a linear it has no kernel for (bitsandbytes), a cache other than LayerKVCache (int8)."""
        a, m = self.self_attn, getattr(self, self.mlp_name)
        if a.q_norm is not None or type(cache) is not LayerKVCache or not isinstance(m, MLP):
            return None
        qkv, o, gate_up, down = (stack_linear(p) for p in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj))
        if None in (qkv, o, gate_up, down):
            return None
        return [self.input_layernorm.weight, qkv, o, self.post_attention_layernorm.weight, gate_up, down,
                cache.k, cache.v]


def stack_linear(p: nn.Module):
    """A linear as a kernels.decode_stack linear: our Linear, or a weight-only quantized one by its own
    `stack_linear`; None for any other (bitsandbytes) or where the stack would not run it as its module
    does."""
    if type(p) is Linear:
        return decode_stack.bf16_stack_linear(p.weight, p.bias)
    to_stack = getattr(p, "stack_linear", None)
    return None if to_stack is None else to_stack()


class LlamaModel(nn.Module):
    """Embeddings, decoder stack, final norm and LM head over a flat batch of tokens."""

    # Each fused projection of a layer and the checkpoint linears it concatenates, in order (loader,
    # quantization).
    FUSED = FUSED_LAYOUT  # the worker's read-ahead lays their parts back to back (engine.models.fused_layout)

    @staticmethod
    def fused_sizes(c: ModelConfig) -> dict[str, list[int]]:
        """Output rows of each checkpoint linear inside each fused projection, in FUSED's order."""
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [c.intermediate_size] * 2}

    def __init__(self, c: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.cuda_graphs = not c.moe_layers  # expert grouping reads its counts on the host
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rope = RotaryEmbedding(c.head_dim, max_positions, c.rope)
        self._stack_caches: list | None = None  # the KV pool `_stack` was built over
        self._stack: decode_stack.DecodeStack | None = None

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices,
                plan: dispatch.StepPlan | None = None) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] for the selected flat positions (None: every position, in
        order); `plan`: the step's (kernels.dispatch), derived from `meta` where not given."""
        dtype = self.embed_tokens.weight.dtype
        plan = plan or dispatch.plan_of_step(input_ids, dtype, kv_caches[0].k.dtype, meta)
        stack = self._decode_stack(kv_caches, len(input_ids)) if plan.decode_stack else None
        if stack is not None and stack.has_head and logits_indices is None:
            return stack.logits(input_ids, positions, self.rope.tables(dtype), meta)
        return self.compute_logits(self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices,
                                                      stack))

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states."""
        if self.lm_head is None:
            return linear(x, self.embed_tokens.weight)
        return self.lm_head(x)

    def hidden_states(self, input_ids, positions, kv_caches, meta, indices, stack=False,
                      plan: dispatch.StepPlan | None = None) -> torch.Tensor:
        """Final-norm hidden states [len(indices), hidden] of the selected flat positions (None: every one);
        `stack`: the decode stack `forward` already chose, else the step plan decides."""
        if stack is False:
            dtype = self.embed_tokens.weight.dtype
            plan = plan or dispatch.plan_of_step(input_ids, dtype, kv_caches[0].k.dtype, meta)
            stack = self._decode_stack(kv_caches, len(input_ids)) if plan.decode_stack else None
        x, delta = self.embed_tokens(input_ids), None
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        if stack is not None:
            x, delta = stack.run(x, cos_sin, meta)
        else:
            for layer, cache in zip(self.layers, kv_caches, strict=True):
                x, delta = layer(x, delta, cos_sin, cache, meta)
        if indices is not None:
            x, delta = x[indices], delta[indices]
        return self.norm.add(x, delta)[1]

    def _decode_stack(self, kv_caches, tokens: int = 1) -> decode_stack.DecodeStack | None:
        """The layers as one C++ call over these caches (kernels.decode_stack), built once per KV pool, for a
        step of `tokens` tokens; None where a layer cannot be stacked or the step has more tokens than the
        stack takes."""
        if self._stack_caches is not kv_caches:
            layers = [layer.stack_layer(cache) for layer, cache in zip(self.layers, kv_caches, strict=True)]
            a, self._stack_caches = self.layers[0].self_attn, kv_caches
            whole_rope = self.rope.cos.shape[-1] == a.head_dim  # the C++ rope rotates whole heads only
            head = (self.embed_tokens.weight, self.norm.weight,
                    decode_stack.bf16_stack_linear(self.embed_tokens.weight, None) if self.lm_head is None
                    else stack_linear(self.lm_head))
            stackable = whole_rope and all(t is not None for t in layers)
            c = self.config
            widest = max(c.hidden_size, c.intermediate_size, a.num_heads * a.head_dim)
            self._stack = None if not stackable else decode_stack.build_stack(
                layers, a.num_heads, a.num_kv_heads, a.head_dim, c.rms_norm_eps, a.scale, head, widest)
        return self._stack if self._stack is None or tokens <= self._stack.max_tokens else None

