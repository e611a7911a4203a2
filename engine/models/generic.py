"""Any decoder checkpoint transformers builds, run by its own modules inside our continuous batch.

Our paged attention is registered as a transformers attention implementation (ATTN_IMPL): the Hugging Face
model runs once per step over one packed sequence of every scheduled token (positions from our metadata), and
each attention layer, instead of attending over its inputs, writes its keys/values into our paged KV blocks
and attends over the cached context of each token's own request. Prefix caching, chunked prefill, preemption
and int8 KV therefore work as for the native forward; sliding windows (per layer, Gemma 2/3) and attention
logit soft-capping run in a masked attention of our own; what neither serves is refused by name
(`check_generic`).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
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
        raise ValueError(
            f"{archs[0]} needs trust_remote_code (custom modeling code), which Sluice does not run")
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
        raise ValueError(
            f"{cls.__name__} is not supported: layer types {', '.join(other)} (only attention layers)")
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
    """The fields of our ModelConfig (what the KV pool, scheduler and sampler need) for a checkpoint on the
    generic path (models.llama builds it: this module does not import it)."""
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
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention implementation: query/key/value [1, heads, T, D] of the packed step; writes the
    keys/values into this layer's paged cache and attends over each token's cached context ([1, T, H, D])."""
    if query.shape[0] != 1:
        raise RuntimeError(
            f"{ATTN_IMPL} runs one packed sequence per forward, got a batch of {query.shape[0]}")
    if kwargs.get("s_aux") is not None or kwargs.get("is_causal") is False:
        raise ValueError("attention sinks / non-causal attention are not supported on the generic path")
    q = query[0].transpose(0, 1).contiguous()
    out = step_attention(q, _token_rows(key), _token_rows(value), scaling, sliding_window, softcap)
    return out[None], None


def step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The next attention layer of the running step: writes keys/values [T, Hkv, D] into its paged cache and
    attends with q [T, H, D] over each token's cached context ([T, H, D])."""
    step = _STEP.get()
    i = step.calls
    step.calls += 1
    cache = step.caches[i]
    if k.shape[1:] != cache.k.shape[::3]:
        raise ValueError(f"layer {i} keys are {list(k.shape[1:])} per token, the KV pool holds "
                         f"{list(cache.k.shape[::3])} (heads, head dim): an attention the generic path does "
                         "not model")
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    cache.write(k, v, step.meta.slot_mapping)
    window = sliding_window or step.windows[i]
    if window or softcap:
        if not isinstance(step.meta, FlatMetadata):
            raise RuntimeError("a windowed or soft-capped attention layer needs the flat step layout")
        return masked_attention(q, cache, step.meta, scale, window, softcap)
    return cache.attend(q, k, v, step.meta, scale)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """[1, heads, T, D] as [T, heads, D] with each token's heads one row, copied only where they are not (the
    values of a sibling product are already: a slice of each row of the wider product, as the native
    forward's)."""
    t = x[0].transpose(0, 1)
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def _gather(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, dtype) -> torch.Tensor:
    """Keys or values at `slots` [T, S] as [Hkv, T, S, D]: in the cache's dtype, an int8 cache's in fp32 times
    its scales."""
    hk, d = cache.shape[0], cache.shape[-1]
    x = cache.view(hk, -1, d)[:, slots]
    if scales is not None:
        x = x.float() * scales.view(hk, -1)[:, slots].float()[..., None]
    return x


def masked_attention(q: torch.Tensor, cache, meta: FlatMetadata, scale: float, window: int | None,
                     softcap: float | None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each token's cached context, keys within `window` positions
    (transformers' kv > q - window) and scores soft-capped as tanh(s / cap) * cap; the products in the cache's
    dtype (fp32 over an int8 cache), the softmax in fp32, queries in chunks."""
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
        # as transformers' eager: q.k in q's dtype
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
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
        """Logits [len(logits_indices), vocab] for the selected flat positions (None: every position, in
        order); `plan` (kernels.dispatch.StepPlan) is unused: transformers' modules run as they are."""
        step = Step(kv_caches, meta, self.windows)
        token = _STEP.set(step)
        try:
            out = self.hf(**self.hf_inputs(input_ids), position_ids=positions[None], use_cache=False,
                          logits_to_keep=0 if logits_indices is None else logits_indices)
        finally:
            _STEP.reset(token)
        if step.calls != len(kv_caches):
            raise ValueError(f"{self.config.architecture} ran {step.calls} attention layers for "
                             f"{len(kv_caches)} KV caches: layers outside the attention interface are not "
                             "supported")
        return out.logits[0]

    def hf_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The token inputs of the transformers forward: the step's ids as one packed sequence."""
        return {"input_ids": input_ids[None]}


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
    """LlamaMLP.forward with SiLU as the native MLP runs it: gate and up one product, silu(gate) * up one
    kernel call."""
    g = self.gate_proj.group
    gate_up = linear(x, g.weight, g.bias)
    return self.down_proj(kernels.silu_mul(gate_up.reshape(-1, gate_up.shape[-1])).view(*x.shape[:-1], -1))


@functools.cache
def _llama_layer_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return inspect.getsource(LlamaDecoderLayer.forward)


def _decoder_layer_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                           cache=None, use_cache: bool | None = False, position_embeddings=None,
                           **kwargs) -> torch.Tensor:
    """LlamaDecoderLayer.forward with the attention's residual added inside the post-attention norm: one
    kernels.add_rms_norm pass (the sum rounded to the activations' dtype first, as transformers' add), as the
    native forward does."""
    attn, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                             position_ids=position_ids, cache=cache, use_cache=use_cache,
                             position_embeddings=position_embeddings, **kwargs)
    norm, shape = self.post_attention_layernorm, hidden_states.shape
    x, h = kernels.add_rms_norm(hidden_states.reshape(-1, shape[-1]), attn.reshape(-1, shape[-1]),
                                norm.weight, norm.variance_epsilon)
    return x.view(shape) + self.mlp(h.view(shape))


@functools.cache
def _llama_attention_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaAttention

    return inspect.getsource(LlamaAttention.forward)


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                       cache=None, **kwargs) -> tuple[torch.Tensor, None]:
    """LlamaAttention.forward over a q/k/v SiblingGroup whose rotary slot runs `fused_rope`: the same
    products, rotation and attention, without the [1, H, T, D] layout and the attention interface's lookup in
    between."""
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    d, shape = self.head_dim, hidden_states.shape
    if cos is None or shape[0] != 1 or cos.shape != (1, shape[1], d) or sin.shape != cos.shape:
        original = super(type(self), self).forward
        return original(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
    g = self.q_proj.group
    qkv = linear(hidden_states[0], g.weight, g.bias).view(shape[1], -1, d)
    h, hk = g.sizes[0] // d, g.sizes[1] // d
    q, k = kernels.rope_qk(qkv, cos[0][:, None], sin[0][:, None], h, hk)
    out = step_attention(q, k, qkv[:, h + hk:], self.scaling)
    return self.o_proj(out.view(*shape[:-1], -1)), None


def _qkv_attention(mod: nn.Module) -> bool:
    """Whether `mod` has q/k/v projections as one SiblingGroup in that order, a head_dim, and a rotary slot
    that runs `fused_rope` (checked against its own function): what `_attention_forward` needs."""
    q, k, v = (getattr(mod, n, None) for n in ("q_proj", "k_proj", "v_proj"))
    slot = (vars(mod).get("_kernel_funcs") or {}).get(ROPE_SLOT)
    return (isinstance(q, SiblingLinear) and isinstance(k, SiblingLinear) and isinstance(v, SiblingLinear)
            and q.group is k.group is v.group and (q.index, k.index, v.index) == (0, 1, 2)
            and isinstance(getattr(mod, "head_dim", None), int) and slot is not None
            and "forward" not in vars(slot) and type(slot).forward is fused_rope)


def _fused_norm(mod: nn.Module | None) -> bool:
    """Whether `mod` is a norm `use_our_kernels` gave the fused forward (`_rms_norm_forward`)."""
    return mod is not None and "forward" not in vars(mod) and type(mod).forward is _rms_norm_forward


def _same_source(mod: nn.Module, source) -> bool:
    """Whether the class of `mod` has the forward whose source `source()` returns (transformers' copies of
    Llama's)."""
    try:
        return inspect.getsource(type(mod).forward) == source()
    except (OSError, TypeError):
        return False


# Linears that transformers' modules call one after another on the same input (attention's q/k/v, the MLP's
# gate/up).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


class SiblingGroup:
    """Sibling linears' weights concatenated (each member's weight a view of its rows) and the outputs of the
    last input they were run on, handed out once per member."""

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

    def rebase(self, first: nn.Linear) -> None:
        """Point the concatenation at the storage its first member's weight (and bias) now lies in: after
        WeightArena.adopt moved the members' views of it."""
        self.weight = first.weight.as_strided(self.weight.shape, self.weight.stride(),
                                              first.weight.storage_offset())
        if self.bias is not None:
            self.bias = first.bias.as_strided(self.bias.shape, self.bias.stride(),
                                              first.bias.storage_offset())


class SiblingLinear(Linear):
    """A linear of a SiblingGroup: the first member called on an input runs every member's product in one pass
    over the group's weight (one GEMV instead of several at decode); the others take theirs while they are
    called on that same tensor, and run alone on any other."""

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
    """Make each SIBLINGS group of `module`'s plain linears (same input width, dtype, device, bias or none)
    one SiblingGroup."""
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


# The kernels-hub slot through which transformers' attention modules call their rotary function (one private
# wrapper per module, `_kernel_funcs`, whose forward `kernels.kernelize` replaces: so do we, with
# kernels.rope_qk).
ROPE_SLOT = "rotary_pos_emb"


def _rope_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether q [1, H, T, D], k [1, Hkv, T, D] and cos/sin [1, T, D] are the call `fused_rope` serves (whole
    heads rotated, one packed sequence)."""
    return (q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3
            and q.shape[0] == k.shape[0] == cos.shape[0] == 1
            and cos.shape[1:] == sin.shape[1:] == (q.shape[2], q.shape[3]) and k.shape[2:] == q.shape[2:]
            and q.dtype == k.dtype == cos.dtype == sin.dtype)


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, H, D] and k [T, Hkv, D] as one [T, H + Hkv, D] view where k's heads follow q's in every row (a
    sibling q/k/v product), else None."""
    t, h, d = q.shape
    if (q.stride() != k.stride() or q.stride(1) != d or q.stride(2) != 1
            or k.data_ptr() != q.data_ptr() + h * d * q.element_size()):
        return None
    return q.as_strided((t, h + k.shape[1], d), q.stride())


def fused_rope(slot: nn.Module, q, k, cos, sin, *args, **kwargs):
    """A rotary slot's forward that runs Llama's apply_rotary_pos_emb (q * cos + rotate_half(q) * sin, each
    step rounded) as kernels.rope_qk over q and k in one pass; the slot's own function serves every other
    call."""
    if args or kwargs or not _rope_fits(q, k, cos, sin):
        return type(slot).forward(slot, q, k, cos, sin, *args, **kwargs)
    qt, kt = q[0].transpose(0, 1), k[0].transpose(0, 1)  # [T, heads, D]: each token's heads, rows of D
    c, s = cos[0][:, None], sin[0][:, None]
    both = _adjacent(qt, kt)
    if both is not None:
        qo, ko = kernels.rope_qk(both, c, s, qt.shape[1], kt.shape[1])
    else:
        qo, ko = kernels.rope_qk(qt, c, s, qt.shape[1], 0)[0], kernels.rope_qk(kt, c, s, 0, kt.shape[1])[1]
    return qo.transpose(0, 1)[None], ko.transpose(0, 1)[None]


def _rope_samples(dtype: torch.dtype, head_dim: int) -> list[tuple[torch.Tensor, ...]]:
    """Random (q, k, cos, sin) in the layouts the attention modules pass: q/k views of one q/k/v product, and
    apart."""
    g = torch.Generator().manual_seed(0)
    t, h, hk = 5, 4, 2
    qkv = torch.randn(1, t, (h + 2 * hk) * head_dim, generator=g).to(dtype).view(1, t, -1, head_dim)
    cos, sin = (torch.randn(1, t, head_dim, generator=g).to(dtype) for _ in range(2))
    q, k = qkv[:, :, :h].transpose(1, 2), qkv[:, :, h:h + hk].transpose(1, 2)
    return [(q, k, cos, sin), (q.contiguous(), k.contiguous(), cos, sin)]


def _same_rope(original, ours, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `ours` gives bit for bit what `original` does on random whole-head calls in `dtype`."""
    with torch.inference_mode():
        for args in _rope_samples(dtype, head_dim):
            want, got = original(*args), ours(*args)
            if not all(isinstance(w, torch.Tensor) and w.shape == o.shape and torch.equal(w, o)
                       for w, o in zip(want, got, strict=True)):
                return False
    return True


def _use_fused_rope(model: nn.Module) -> None:
    """Give every attention module whose rotary slot (ROPE_SLOT) computes Llama's rotation `fused_rope`,
    checked bit for bit against its own function once per function, in the model's dtype and head size."""
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    checked: dict[type, bool] = {}
    for mod in model.modules():
        slot = (vars(mod).get("_kernel_funcs") or {}).get(ROPE_SLOT)
        if slot is None or "forward" in vars(slot) or type(slot).forward is fused_rope:
            continue
        if type(slot) not in checked:  # the wrapper class's own forward: transformers' function
            checked[type(slot)] = _same_rope(functools.partial(type(slot).forward, slot),
                                             functools.partial(fused_rope, slot), model.dtype, head_dim)
        if checked[type(slot)]:
            slot.__class__ = with_forward(type(slot), fused_rope)


def use_our_kernels(model: nn.Module) -> nn.Module:
    """Run the model's plain linears through kernels.linear (our bf16 GEMV at decode row counts), sibling
    linears on one input as one (SiblingLinear), every norm whose forward is LlamaRMSNorm's own source through
    kernels.add_rms_norm and every SiLU MLP whose forward is LlamaMLP's through kernels.silu_mul: the same
    results, as the native forward gets them; anything else stays transformers' own."""
    for mod in list(model.modules()):
        _fuse_siblings(mod)
    _use_fused_rope(model)
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = Linear
        elif type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):
            if _same_source(mod, _llama_norm_source):
                mod.__class__ = with_forward(type(mod), _rms_norm_forward)
        elif _swiglu(mod) and _same_source(mod, _llama_mlp_source):
            mod.__class__ = with_forward(type(mod), _swiglu_forward)
    for mod in model.modules():  # after the norms and the rotary: what these forwards build on is in place
        if _fused_norm(getattr(mod, "post_attention_layernorm",
                               None)) and _same_source(mod, _llama_layer_source):
            mod.__class__ = with_forward(type(mod), _decoder_layer_forward)
        elif _qkv_attention(mod) and _same_source(mod, _llama_attention_source):
            mod.__class__ = with_forward(type(mod), _attention_forward)
    return model


@functools.cache
def with_forward(cls: type, forward: Callable) -> type:
    """`cls` with `forward` as its forward: the class a transformers module becomes where our kernels run its
    forward (one subclass per class and forward; its name and module are the original's)."""
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "kernel_forward_of": cls})


def restore_forward(mod: nn.Module) -> None:
    """Put transformers' own forward back where `use_our_kernels` gave `mod` ours (to compare the two)."""
    original = getattr(type(mod), "kernel_forward_of", None)
    if original is not None:
        mod.__class__ = original


def _swiglu(mod: nn.Module) -> bool:
    """Whether `mod` has SiLU as act_fn and gate_proj/up_proj as one SiblingGroup, gate first."""
    gate, up = getattr(mod, "gate_proj", None), getattr(mod, "up_proj", None)
    act = type(getattr(mod, "act_fn", None)).__name__
    return (act in ("SiLUActivation", "SiLU") and isinstance(gate, SiblingLinear)
            and isinstance(up, SiblingLinear)
            and gate.group is up.group and gate.index == 0 and len(gate.group.sizes) == 2)


def into_arena(model: nn.Module) -> None:
    """On CPU, the model's weights moved into one arena of huge pages (engine.weight_memory), as the native
    loader keeps its own, for the engine to settle (`model.weight_arena`); left where they are if the map
    cannot be had."""
    from sluice.engine.weight_memory import WeightArena

    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device.type != "cpu" for t in tensors):
        return
    nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    try:
        arena = WeightArena(nbytes + nbytes // 64 + (64 << 20))
    except OSError:
        return
    arena.adopt(model)
    for mod in model.modules():
        if isinstance(mod, SiblingLinear) and mod.index == 0:
            mod.group.rebase(mod)
    model.weight_arena = arena


def load_generic(path: str | Path, dtype: torch.dtype, device: torch.device, config, linear_hook=None,
                 huge_pages: bool = True) -> GenericModel:
    """transformers' model for the checkpoint, its attention ours, on `device` in `dtype`; `linear_hook` (the
    engine's quantization) swaps its linears for quantized ones after it is on `device`; `huge_pages`: on CPU,
    its weights in one arena of huge pages, `model.weight_arena` (as models.loader's native models)."""
    from transformers import AutoModelForCausalLM

    register()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                              attn_implementation=ATTN_IMPL).to(device).eval()
    if linear_hook is not None:
        linear_hook.quantize_module(hf, config.architecture)
    model = GenericModel(use_our_kernels(hf), config).eval()
    if huge_pages:
        into_arena(model)
    return model
