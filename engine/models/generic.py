"""Any decoder checkpoint transformers builds, run by its own modules inside our continuous batch.

Our paged attention is registered as a transformers attention implementation (ATTN_IMPL): the Hugging Face
model runs once per step over one packed sequence of every scheduled token (positions from our metadata), and
each attention layer, instead of attending over its inputs, writes its keys/values into our paged KV blocks and
attends over the cached context of each token's own request. Prefix caching, chunked prefill, preemption and
int8 KV therefore work as for the native forward; sliding windows (per layer, Gemma 2/3) and attention logit
soft-capping run in a masked attention of our own; what neither serves is refused by name (`check_generic`).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sluice import kernels
from sluice.engine.models.rope import rope_parameters
from sluice.kernels.flat_metadata import FlatMetadata
from sluice.kernels.linear import Linear, linear

ATTN_IMPL = "sluice_paged"
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Config keys of features the paged attention cannot honor, with the name the refusal gives them.
UNSUPPORTED_KEYS = {
    "kv_lora_rank": "multi-head latent attention (MLA)",
    "attention_chunk_size": "chunked local attention",
    "num_kv_shared_layers": "KV sharing across layers",
    "use_bidirectional_attention": "bidirectional attention",
}
UNSUPPORTED_TYPES = {"gpt_oss": "attention sinks"}
LENGTH_CAPPED_ROPE = ("dynamic", "longrope")  # length-dependent: served only up to the original context
TILE_ELEMENTS = 1 << 24  # gathered key elements per chunk of queries in the masked attention


def _hf_config(cfg: dict[str, Any]):
    """transformers' config object for a config.json dict (ValueError where transformers lacks the type)."""
    from transformers import CONFIG_MAPPING

    kind = cfg.get("model_type")
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"model_type {kind!r} is unknown to the installed transformers")
    return CONFIG_MAPPING[kind].from_dict(cfg)


def _causal_lm_class(conf):
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(conf)]
    except KeyError:
        raise ValueError(f"model_type {conf.model_type!r} has no AutoModelForCausalLM class") from None


def check_generic(cfg: dict[str, Any]) -> str:
    """The class the generic path builds for this config.json; ValueError naming what it cannot serve."""
    archs = cfg.get("architectures") or [cfg.get("model_type")]
    if cfg.get("auto_map"):
        raise ValueError(f"{archs[0]} needs trust_remote_code (custom modeling code), which Sluice does not run")
    conf = _hf_config(cfg)
    cls = _causal_lm_class(conf)
    if cfg.get("architectures") and cls.__name__ not in archs:
        raise ValueError(f"{archs[0]} is not what transformers builds for model_type {conf.model_type!r} "
                         f"({cls.__name__})")
    text = conf.get_text_config()
    reason = UNSUPPORTED_TYPES.get(conf.model_type)
    reason = reason or next((why for key, why in UNSUPPORTED_KEYS.items() if getattr(text, key, None)), None)
    if reason is not None:
        raise ValueError(f"{cls.__name__} is not supported: {reason}")
    other = sorted(set(getattr(text, "layer_types", None) or []) - set(ATTENTION_LAYER_TYPES))
    if other:
        raise ValueError(f"{cls.__name__} is not supported: layer types {', '.join(other)} (only attention layers)")
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(f"{cls.__name__} is not supported: its attention does not go through transformers' "
                         f"attention interface")
    return cls.__name__


def _rope_list(text) -> list[dict[str, Any]]:
    """Every rope parameter set of the config (one per attention type where they differ, as Gemma 3's)."""
    params = getattr(text, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return list(params.values())
    return [rope_parameters(text.to_dict())]


def generic_config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of our ModelConfig (what the KV pool, scheduler and sampler need) for a checkpoint on the generic
    path (models.llama builds it: this module does not import it)."""
    check_generic(cfg)
    text = _hf_config(cfg).get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    max_pos = getattr(text, "max_position_embeddings", None) or 2048
    ropes = _rope_list(text)
    for rope in ropes:  # length-dependent scalings keep their short-context frequencies: cap the length there
        if rope.get("rope_type") in LENGTH_CAPPED_ROPE:
            max_pos = min(max_pos, int(rope.get("original_max_position_embeddings") or max_pos))
    eos = cfg.get("eos_token_id", getattr(text, "eos_token_id", None))
    return dict(
        architecture=(cfg.get("architectures") or [type(text).__name__])[0],
        vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", None) or 0, num_layers=text.num_hidden_layers,
        num_heads=heads, num_kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6), max_position_embeddings=max_pos,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)), qkv_bias=False, qk_norm=False,
        rope=ropes[0], sliding_window=None, eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"), path="generic",
    )


@dataclass(slots=True)
class Step:
    """What the registered attention needs during one forward: the layer caches, the step's metadata, and how
    many attention calls have run (the n-th call is layer n)."""

    caches: list
    meta: Any
    windows: list[int | None]
    calls: int = 0
    seen: list = field(default_factory=list)


_STEP: contextvars.ContextVar[Step] = contextvars.ContextVar("sluice_generic_step")


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention implementation: query/key/value [1, heads, T, D] of the packed step; writes the
    keys/values into this layer's paged cache and attends over each token's cached context ([1, T, H, D])."""
    step = _STEP.get()
    if query.shape[0] != 1:
        raise RuntimeError(f"{ATTN_IMPL} runs one packed sequence per forward, got a batch of {query.shape[0]}")
    if kwargs.get("s_aux") is not None or kwargs.get("is_causal") is False:
        raise ValueError("attention sinks / non-causal attention are not supported on the generic path")
    i = step.calls
    step.calls += 1
    cache = step.caches[i]
    q = query[0].transpose(0, 1).contiguous()
    k, v = key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous()
    if k.shape[1:] != cache.k.shape[::3]:
        raise ValueError(f"layer {i} keys are {list(k.shape[1:])} per token, the KV pool holds "
                         f"{list(cache.k.shape[::3])} (heads, head dim): an attention the generic path does not model")
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    cache.write(k, v, step.meta.slot_mapping)
    window = sliding_window or step.windows[i]
    if window or softcap:
        if not isinstance(step.meta, FlatMetadata):
            raise RuntimeError("a windowed or soft-capped attention layer needs the flat step layout")
        out = masked_attention(q, cache, step.meta, scale, window, softcap)
    else:
        out = cache.attend(q, k, v, step.meta, scale)
    return out[None], None


def _gather(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, dtype) -> torch.Tensor:
    """Keys or values at `slots` [T, S] as [Hkv, T, S, D]: in the cache's dtype, an int8 cache's in fp32 times its
    scales."""
    hk, d = cache.shape[0], cache.shape[-1]
    x = cache.view(hk, -1, d)[:, slots]
    if scales is not None:
        x = x.float() * scales.view(hk, -1)[:, slots].float()[..., None]
    return x


def masked_attention(q: torch.Tensor, cache, meta: FlatMetadata, scale: float, window: int | None,
                     softcap: float | None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each token's cached context, keys within `window` positions
    (transformers' kv > q - window) and scores soft-capped as tanh(s / cap) * cap; the products in the cache's dtype
    (fp32 over an int8 cache), the softmax in fp32, queries in chunks."""
    t, h, d = q.shape
    hk, _, bs, _ = cache.k.shape
    seq = meta.token_seq.long()
    qpos = (meta.seq_len.long() - meta.query_len.long())[seq] + torch.arange(t, device=q.device) \
        - meta.query_start.long()[seq]
    width = meta.block_tables.shape[1] * bs
    chunk = max(1, TILE_ELEMENTS // max(1, width * d * hk))
    out = torch.empty_like(q)
    kpos = torch.arange(width, device=q.device)
    for a in range(0, t, chunk):
        rows = slice(a, min(t, a + chunk))
        tables = meta.block_tables.long()[seq[rows]]
        slots = (tables[:, :, None] * bs + torch.arange(bs, device=q.device)).view(tables.shape[0], -1)
        mask = kpos[None, :] <= qpos[rows, None]
        if window:
            mask &= kpos[None, :] > qpos[rows, None] - window
        keys = _gather(cache.k, getattr(cache, "k_scale", None), slots, q.dtype)
        vals = _gather(cache.v, getattr(cache, "v_scale", None), slots, q.dtype)
        n = keys.shape[1]
        qg = q[rows].view(n, hk, h // hk, d).transpose(0, 1).to(keys.dtype)  # [Hkv, n, grp, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # as transformers' eager: q.k in q's dtype
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        probs = scores.masked_fill(~mask[None, :, None, :], float("-inf")).softmax(-1)
        out[rows] = torch.matmul(probs.to(vals.dtype), vals).transpose(0, 1).reshape(n, h, d).to(q.dtype)
    return out


def register() -> None:
    """Register ATTN_IMPL with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, paged_attention_forward)


def _layer_windows(text) -> list[int | None]:
    """Each layer's sliding window by the config's layer_types (the attention call's own argument wins)."""
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    return [window if kind == "sliding_attention" else None for kind in types]


class GenericModel(nn.Module):
    """A transformers causal LM behind our model interface: forward(ids, positions, kv_caches, meta, rows)."""

    cuda_graphs = False  # transformers' modules are not known to be capturable

    def __init__(self, hf_model: nn.Module, config) -> None:
        super().__init__()
        self.hf, self.config = hf_model, config
        text = hf_model.config.get_text_config()
        self.windows = _layer_windows(text)
        softcap = getattr(text, "attn_logit_softcapping", None)
        window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
        self.needs_flat_metadata = bool(softcap or window or any(self.windows))

    @property
    def embed_tokens(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices, plan=None) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] for the selected flat positions (None: every position, in order);
        `plan` (kernels.dispatch.StepPlan) is unused: transformers' modules run as they are."""
        step = Step(kv_caches, meta, self.windows)
        token = _STEP.set(step)
        try:
            out = self.hf(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                          logits_to_keep=0 if logits_indices is None else logits_indices)
        finally:
            _STEP.reset(token)
        if step.calls != len(kv_caches):
            raise ValueError(f"{self.config.architecture} ran {step.calls} attention layers for "
                             f"{len(kv_caches)} KV caches: layers outside the attention interface are not supported")
        return out.logits[0]


@functools.cache
def _llama_norm_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return inspect.getsource(LlamaRMSNorm.forward)


def _rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward through our kernel (one fused pass on CPU, the same rounding)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # a sibling linear's output is a view of a wider product
    return kernels.add_rms_norm(rows, None, self.weight, self.variance_epsilon)[1].view(x.shape)


@functools.cache
def _llama_mlp_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaMLP

    return inspect.getsource(LlamaMLP.forward)


def _swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP.forward with SiLU as the native MLP runs it: gate and up one product, silu(gate) * up one kernel call."""
    g = self.gate_proj.group
    gate_up = linear(x, g.weight, g.bias)
    return self.down_proj(kernels.silu_mul(gate_up.reshape(-1, gate_up.shape[-1])).view(*x.shape[:-1], -1))


def _same_source(mod: nn.Module, source) -> bool:
    """Whether the class of `mod` has the forward whose source `source()` returns (transformers' copies of Llama's)."""
    try:
        return inspect.getsource(type(mod).forward) == source()
    except (OSError, TypeError):
        return False


# Linears that transformers' modules call one after another on the same input (attention's q/k/v, the MLP's gate/up).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


class SiblingGroup:
    """Sibling linears' weights concatenated (each member's weight a view of its rows) and the outputs of the last
    input they were run on, handed out once per member."""

    __slots__ = ("weight", "bias", "sizes", "x", "outs")

    def __init__(self, members: list[nn.Linear]) -> None:
        self.weight = torch.cat([m.weight.detach() for m in members])
        self.bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        self.sizes = [m.out_features for m in members]
        self.x, self.outs = None, []
        start = 0
        for m, n in zip(members, self.sizes, strict=True):
            m.weight = nn.Parameter(self.weight[start:start + n], requires_grad=False)
            if self.bias is not None:
                m.bias = nn.Parameter(self.bias[start:start + n], requires_grad=False)
            start += n


class SiblingLinear(Linear):
    """A linear of a SiblingGroup: the first member called on an input runs every member's product in one pass over
    the group's weight (one GEMV instead of several at decode); the others take theirs while they are called on
    that same tensor, and run alone on any other."""

    group: SiblingGroup
    index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        if g.x is x and g.outs[self.index] is not None:
            out, g.outs[self.index] = g.outs[self.index], None
            return out
        outs = list(linear(x, g.weight, g.bias).split(g.sizes, dim=-1))  # views: transformers reshapes them
        out, outs[self.index] = outs[self.index], None
        g.x, g.outs = x, outs
        return out


def _fuse_siblings(module: nn.Module) -> None:
    """Make each SIBLINGS group of `module`'s plain linears (same input width, dtype, device, bias or none) one
    SiblingGroup."""
    for names in SIBLINGS:
        members = [getattr(module, n, None) for n in names]
        if not all(type(m) is nn.Linear for m in members):
            continue
        first = members[0]
        if all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in members):
            group = SiblingGroup(members)
            for i, m in enumerate(members):
                m.__class__, m.group, m.index = SiblingLinear, group, i


def use_our_kernels(model: nn.Module) -> nn.Module:
    """Run the model's plain linears through kernels.linear (our bf16 GEMV at decode row counts), sibling linears
    on one input as one (SiblingLinear), every norm whose forward is LlamaRMSNorm's own source through
    kernels.add_rms_norm and every SiLU MLP whose forward is LlamaMLP's through kernels.silu_mul: the same results,
    as the native forward gets them; anything else stays transformers' own."""
    for mod in list(model.modules()):
        _fuse_siblings(mod)
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = Linear
        elif type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):
            if _same_source(mod, _llama_norm_source):
                mod.forward = _rms_norm_forward.__get__(mod)
        elif _swiglu(mod) and _same_source(mod, _llama_mlp_source):
            mod.forward = _swiglu_forward.__get__(mod)
    return model


def _swiglu(mod: nn.Module) -> bool:
    """Whether `mod` has SiLU as act_fn and gate_proj/up_proj as one SiblingGroup, gate first."""
    gate, up = getattr(mod, "gate_proj", None), getattr(mod, "up_proj", None)
    act = type(getattr(mod, "act_fn", None)).__name__
    return (act in ("SiLUActivation", "SiLU") and isinstance(gate, SiblingLinear) and isinstance(up, SiblingLinear)
            and gate.group is up.group and gate.index == 0 and len(gate.group.sizes) == 2)


def load_generic(path: str | Path, dtype: torch.dtype, device: torch.device, config,
                 linear_hook=None) -> GenericModel:
    """transformers' model for the checkpoint, its attention ours, on `device` in `dtype`; `linear_hook` (the
    engine's quantization) swaps its linears for quantized ones after it is on `device`."""
    from transformers import AutoModelForCausalLM

    register()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPL).to(device).eval()
    if linear_hook is not None:
        linear_hook.quantize_module(hf, config.architecture)
    return GenericModel(use_our_kernels(hf), config).eval()
