"""Our forward pass for BERT-style encoders (BERT, RoBERTa, XLM-R) over an unpadded flat batch.

Every token of a step's sequences sits in one [tokens, hidden] tensor: embeddings (word + absolute position +
token type, LayerNorm), post-LN layers (bidirectional attention, GELU MLP) and the heads of
`...ForSequenceClassification` (BERT: pooler tanh then classifier; RoBERTa and XLM-R: dense, tanh, out_proj on
the first token). The linears run over the real tokens only; attention runs per sequence, sequences of
similar length padded into one call with a key mask (`AttentionPlan`), planned once per step and served to
every layer. A step's large activations go into buffers kept from step to step (`Workspace`): the bias and
the residual are summed first and each output projection's GEMM adds its product to them, GELU runs in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels.linear import linear_into, residual_linear
from sluice.kernels.varlen_attention import varlen_attention, varlen_serves

# architecture: (family, head); family "roberta" counts positions from padding_idx + 1.
ENCODER_ARCHITECTURES = {
    "BertModel": ("bert", None), "BertForMaskedLM": ("bert", None),
    "BertForSequenceClassification": ("bert", "bert"),
    "RobertaModel": ("roberta", None), "RobertaForMaskedLM": ("roberta", None),
    "RobertaForSequenceClassification": ("roberta", "roberta"),
    "XLMRobertaModel": ("roberta", None), "XLMRobertaForMaskedLM": ("roberta", None),
    "XLMRobertaForSequenceClassification": ("roberta", "roberta"),
}
ACTIVATIONS = {  # in place, on the up projection's output
    "gelu": torch.ops.aten.gelu_, "relu": torch.relu_, "silu": partial(F.silu, inplace=True),
    "swish": partial(F.silu, inplace=True), "gelu_new": partial(torch.ops.aten.gelu_, approximate="tanh"),
    "gelu_pytorch_tanh": partial(torch.ops.aten.gelu_, approximate="tanh"),
}
MAX_PADDING = 0.5  # padded tokens an attention call may add, as a share of its real ones


def is_encoder(hf_config: dict[str, Any]) -> bool:
    """Whether config.json names an encoder architecture this module serves."""
    return any(a in ENCODER_ARCHITECTURES for a in hf_config.get("architectures") or [])


@dataclass(slots=True, frozen=True)
class EncoderConfig:
    """The parts of a BERT / RoBERTa / XLM-R config.json our forward needs."""

    architecture: str
    family: str
    head: str | None
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    position_offset: int
    num_labels: int
    id2label: dict[int, str] = field(default_factory=dict)
    problem_type: str | None = None
    torch_dtype: str | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> EncoderConfig:
        """Read an HF config dict, refusing what the forward does not implement by name."""
        arch = next((a for a in cfg.get("architectures") or [] if a in ENCODER_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"not an encoder architecture: {cfg.get('architectures')!r}; encoders served: "
                             f"{', '.join(ENCODER_ARCHITECTURES)}")
        family, head = ENCODER_ARCHITECTURES[arch]
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{arch}: position_embedding_type {cfg['position_embedding_type']!r} is not "
                             "supported (absolute only)")
        if cfg.get("hidden_act", "gelu") not in ACTIVATIONS:
            raise ValueError(f"{arch}: hidden_act {cfg['hidden_act']!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        id2label = {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
        num_labels = len(id2label) or int(cfg.get("num_labels", 2))
        pad = cfg.get("pad_token_id")
        return cls(
            architecture=arch, family=family, head=head, vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
            hidden_act=cfg.get("hidden_act", "gelu"), layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            max_position_embeddings=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            position_offset=(pad + 1) if family == "roberta" and pad is not None else 0,
            num_labels=num_labels, id2label=id2label or {i: f"LABEL_{i}" for i in range(num_labels)},
            problem_type=cfg.get("problem_type"), torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @property
    def max_len(self) -> int:
        """Longest sequence the position table takes."""
        return self.max_position_embeddings - self.position_offset


@dataclass(slots=True)
class PaddedGroup:
    """Consecutive sequences of similar length, from flat row `start` on (`num_tokens` rows), padded to
    `width`: the flat row of each padded slot, the [size, width] mask of the real ones and the padded slot of
    each real token, in order (all None when every sequence is `width` long: the rows are read in place)."""

    start: int
    num_tokens: int
    size: int
    width: int
    index: torch.Tensor | None
    valid: torch.Tensor | None
    slots: torch.Tensor | None


class AttentionPlan:
    """Bidirectional attention of one step's sequences, sorted by length and back to back in the flat batch:
    on CPU one call of kernels.varlen_attention, unpadded; elsewhere consecutive sequences of similar length
    share one SDPA call, padded with a key mask."""

    def __init__(self, lens: list[int], device: torch.device) -> None:
        assert lens == sorted(lens), "the sequences of a step come sorted by length"
        self.lens, self.device = lens, device

    @cached_property
    def groups(self) -> list[PaddedGroup]:
        """The padded SDPA calls, made on first use (the unpadded kernel needs none)."""
        groups: list[PaddedGroup] = []
        start = 0
        for lo, hi in self._cut(self.lens):
            groups.append(self._group(start, self.lens[lo:hi], self.device))
            start += groups[-1].num_tokens
        return groups

    @staticmethod
    def _cut(lens: list[int]) -> list[tuple[int, int]]:
        """[lo, hi) ranges of the sorted lengths, cut where padding to the longest would pass MAX_PADDING."""
        out: list[tuple[int, int]] = []
        lo, real = 0, 0
        for i, n in enumerate(lens):
            if i > lo and (i - lo + 1) * n > (1 + MAX_PADDING) * (real + n):
                out.append((lo, i))
                lo, real = i, 0
            real += n
        return [*out, (lo, len(lens))] if lens else out

    @staticmethod
    def _group(start: int, lens: list[int], device: torch.device) -> PaddedGroup:
        width, total = lens[-1], sum(lens)
        if lens[0] == width:
            return PaddedGroup(start, total, len(lens), width, None, None, None)
        cols = torch.arange(width)
        valid = cols[None, :] < torch.tensor(lens)[:, None]
        firsts = torch.tensor([start, *lens[:-1]]).cumsum(0)
        index = torch.where(valid, firsts[:, None] + cols[None, :], start).flatten()
        slots = valid.flatten().nonzero().flatten()
        index, valid, slots = (t.to(device) for t in (index, valid, slots))
        return PaddedGroup(start, total, len(lens), width, index, valid, slots)

    def attend(self, qkv: torch.Tensor, num_heads: int, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of each token over its own sequence's tokens: qkv [tokens, 3 * hidden] (query, key and
        value, heads within each) to [tokens, hidden] (into `out` if given)."""
        hidden = qkv.shape[1] // 3
        out = qkv.new_empty(qkv.shape[0], hidden) if out is None else out
        q, k, v = qkv.view(len(qkv), 3, num_heads, -1).unbind(1)
        if varlen_serves(q):  # on CPU: no padding at all (kernels.varlen_attention)
            varlen_attention(q, k, v, self.lens, scale, out.view(len(qkv), num_heads, -1))
            return out
        for g in self.groups:
            rows = qkv[g.start: g.start + g.num_tokens] if g.index is None else qkv.index_select(0, g.index)
            q, k, v = rows.view(g.size, g.width, 3, num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
            mask = None if g.valid is None else g.valid[:, None, None, :]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)
            dest = out[g.start: g.start + g.num_tokens]
            if g.slots is None:
                dest.view(g.size, g.width, num_heads, -1).copy_(o)
            else:
                torch.index_select(o.reshape(g.size * g.width, hidden), 0, g.slots, out=dest)
        return out


class Workspace:
    """The large activations of a step in buffers kept from step to step and shared by the layers, so that
    each layer writes into memory already mapped rather than freshly allocated (and page-faulted) tensors."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, cols] tensor of like's dtype and device out of buffer `name`, grown when too small."""
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < rows * cols or buf.dtype != like.dtype or buf.device != like.device:
            buf = self.buffers[name] = like.new_empty(rows * cols)
        return buf[: rows * cols].view(rows, cols)


class EncoderLayer(nn.Module):
    """Post-LN transformer layer: x = LN(x + attn(x)); x = LN(x + down(act(up(x))))."""

    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.num_heads, self.head_dim = c.num_heads, h // c.num_heads
        self.qkv_proj = nn.Linear(h, 3 * h)
        self.o_proj = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.up_proj = nn.Linear(h, c.intermediate_size)
        self.down_proj = nn.Linear(c.intermediate_size, h)
        self.mlp_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor, plan: AttentionPlan, ws: Workspace) -> torch.Tensor:
        qkv = _linear(self.qkv_proj, x, ws.take("qkv", len(x), self.qkv_proj.out_features, x))
        attn = plan.attend(qkv, self.num_heads, self.head_dim**-0.5, ws.take("attn", *x.shape, x))
        x = self.attn_norm(_residual(self.o_proj, attn, x, ws.take("sum", *x.shape, x)))
        up = self.act(_linear(self.up_proj, x, ws.take("up", len(x), self.up_proj.out_features, x)))
        return self.mlp_norm(_residual(self.down_proj, up, x, ws.take("sum", *x.shape, x)))


def _linear(linear: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """linear(x) (into out where torch's BLAS multiplies: kernels.linear.linear_into)."""
    return linear_into(x, linear.weight, linear.bias, out)


def _residual(linear: nn.Linear, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """residual + linear(x) (into out where torch's BLAS multiplies: kernels.linear.residual_linear)."""
    return residual_linear(x, linear.weight, linear.bias, residual, out)


class ClassificationHead(nn.Module):
    """The sequence-classification head on each sequence's first token: BERT's pooler (dense, tanh) and
    classifier, or RoBERTa's dense, tanh, out_proj: the same two linears."""

    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.out_proj = nn.Linear(c.hidden_size, c.num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class EncoderModel(nn.Module):
    """BERT / RoBERTa / XLM-R: final hidden states of a flat batch, and the classification logits."""

    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.config = c
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.embed_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.num_layers))
        self.head = ClassificationHead(c) if c.head else None
        self.workspace = Workspace()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of the flat batch (positions from 0 in each sequence)."""
        positions = positions + self.config.position_offset
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_type_ids))
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, plan, self.workspace)
        return x

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """float32 logits [sequences, num_labels] from each sequence's first-token hidden state."""
        assert self.head is not None, "classify needs a ...ForSequenceClassification checkpoint"
        return self.head(first_tokens).float()


def _weight_names(c: EncoderConfig, names: set[str]) -> dict[str, str]:
    """Our parameter names to the checkpoint's (with or without the `bert.` / `roberta.` prefix)."""
    base = "bert." if c.family == "bert" else "roberta."
    prefix = next((p for p in (base, "") if f"{p}embeddings.word_embeddings.weight" in names), base)
    out = {"word_embeddings.weight": "embeddings.word_embeddings.weight",
           "position_embeddings.weight": "embeddings.position_embeddings.weight",
           "token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
           "embed_norm.weight": "embeddings.LayerNorm.weight", "embed_norm.bias": "embeddings.LayerNorm.bias"}
    parts = {"o_proj": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
             "up_proj": "intermediate.dense", "down_proj": "output.dense", "mlp_norm": "output.LayerNorm"}
    for i in range(c.num_layers):
        for ours, theirs in parts.items():
            for kind in ("weight", "bias"):
                out[f"layers.{i}.{ours}.{kind}"] = f"encoder.layer.{i}.{theirs}.{kind}"
    out = {k: prefix + v for k, v in out.items()}
    if c.head == "bert":
        out |= {f"head.dense.{kind}": f"{prefix}pooler.dense.{kind}" for kind in ("weight", "bias")}
        out |= {f"head.out_proj.{kind}": f"classifier.{kind}" for kind in ("weight", "bias")}
    elif c.head == "roberta":
        out |= {f"head.{m}.{kind}": f"classifier.{m}.{kind}"
                for m in ("dense", "out_proj") for kind in ("weight", "bias")}
    return out


def _legacy(name: str, names: set[str]) -> str:
    """The name as stored: old checkpoints call LayerNorm's weight and bias gamma and beta."""
    if name in names or ".LayerNorm." not in name:
        return name
    return name.replace(".weight", ".gamma").replace(".bias", ".beta")


def load_encoder(path: str | Path, c: EncoderConfig, dtype: torch.dtype,
                 device: torch.device) -> EncoderModel:
    """The encoder with the checkpoint's weights (safetensors), query/key/value fused into one projection."""
    from sluice.engine.models.loader import CheckpointReader, skip_init

    reader = CheckpointReader(path)
    names = set(reader.names())
    with skip_init():
        model = EncoderModel(c)
    mapping = _weight_names(c, names)
    state: dict[str, torch.Tensor] = {}
    for ours, theirs in mapping.items():
        stored = _legacy(theirs, names)
        if stored not in names:
            raise ValueError(f"{path}: checkpoint tensor {theirs} is missing ({c.architecture})")
        state[ours] = reader.get(stored)
    prefix = mapping["word_embeddings.weight"].removesuffix("embeddings.word_embeddings.weight")
    for i in range(c.num_layers):
        for kind in ("weight", "bias"):
            parts = [f"{prefix}encoder.layer.{i}.attention.self.{p}.{kind}"
                     for p in ("query", "key", "value")]
            missing = [p for p in parts if p not in names]
            if missing:
                raise ValueError(f"{path}: checkpoint tensor {missing[0]} is missing ({c.architecture})")
            state[f"layers.{i}.qkv_proj.{kind}"] = torch.cat([reader.get(p) for p in parts])
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
