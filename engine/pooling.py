"""Embeddings: a prompt's final hidden states pooled during its prefill, in the same batch as generation.

An embedding request is a `PoolingRequest`: the scheduler computes its prompt like any other (chunked when it
does not fit a step), the runner returns the final-norm hidden states of the rows its pooling needs instead of
logits, and once the last prompt token is computed the request finishes: no decode step, its KV blocks freed
at once (full blocks stay in the prefix cache for later prompts).

Which pooling a checkpoint takes (`pooler_for`), in order:
1. a sentence-transformers `modules.json` whose Pooling module's `config.json` sets `pooling_mode_lasttoken`,
   `pooling_mode_mean_tokens` or `pooling_mode_cls_token` (Qwen3-Embedding ships one: last token);
2. a bare decoder (`architectures` names a `...Model`, no LM head, as e5-mistral's `MistralModel`): last
   token;
3. otherwise mean over the prompt's tokens.
The pooled vector is L2-normalized (vLLM's default for embeddings; OpenAI's are unit length); `dimensions`
keeps the first d components (Matryoshka) and normalizes again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sluice.engine.outputs import EmbeddingOutput
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams

POOLING_TYPES = ("mean", "last", "cls")
TASKS = ("embed", "classify", "score")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
# A prefill only: no proposals (the speculative budget is max_tokens - 1) and nothing sampled.
_PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0)


class PoolingError(ValueError):
    """An embedding request this checkpoint or these parameters cannot serve."""


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """vLLM's PoolingParams: `task` embed (a vector), classify (class probabilities) or score (a
    cross-encoder's relevance of a pair); `dimensions` truncates (Matryoshka) before normalizing; `normalize`
    None follows the checkpoint (sentence-transformers' Normalize module; decoders: always); `pooling`
    overrides the checkpoint's rule (mean, last or cls)."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling: str | None = None
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise PoolingError(f"dimensions ({self.dimensions}) must be >= 1")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise PoolingError(f"pooling must be one of {', '.join(POOLING_TYPES)}, not {self.pooling!r}")
        if self.task not in TASKS:
            raise PoolingError(f"task must be one of {', '.join(TASKS)}, not {self.task!r}")


def _sentence_transformers_pooling(folder: Path) -> str | None:
    """The pooling a sentence-transformers checkpoint declares, None without modules.json."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if module.get("type", "").endswith("Pooling"):
            config = json.loads((folder / module.get("path", "") / "config.json").read_text())
            chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
            unknown = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v
                             and k not in _ST_MODES)
            if unknown or len(chosen) != 1:
                raise PoolingError(f"{modules.parent.name}: sentence-transformers pooling "
                                   f"{unknown or chosen} is not supported (one of {', '.join(_ST_MODES)})")
            return chosen[0]
    return None


ENCODER_POOLING = {**_ST_MODES, "pooling_mode_max_tokens": "max"}
ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
DENSE_ACTIVATIONS = {"Identity": lambda x: x, "Tanh": torch.tanh, "ReLU": torch.relu,
                     "Sigmoid": torch.sigmoid, "GELU": torch.nn.functional.gelu}


@dataclass(frozen=True, slots=True)
class EncoderPooling:
    """How an encoder checkpoint turns hidden states into its embedding: sentence-transformers' Pooling mode
    (cls, mean, max or last), the folders of the Dense modules after it, whether a Normalize module follows,
    its max_seq_length (None: the model's)."""

    mode: str = "cls"
    normalize: bool = True
    max_seq_length: int | None = None
    dense: tuple[Path, ...] = ()

    @classmethod
    def read(cls, model_dir: str | Path) -> EncoderPooling:
        """From modules.json, the Pooling module's config.json and sentence_bert_config.json; a folder
        without modules.json pools the first token ([CLS], vLLM's default for BERT) and normalizes. A module
        type other than Transformer, Pooling, Dense and Normalize is refused by name."""
        folder = Path(model_dir)
        st_config = folder / "sentence_bert_config.json"
        max_len = json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
        if not (folder / "modules.json").is_file():
            return cls(max_seq_length=max_len)
        modules = json.loads((folder / "modules.json").read_text())
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        unknown = sorted({k for k in kinds if k not in ST_MODULES})
        if unknown:
            raise PoolingError(f"{folder.name}: sentence-transformers module(s) {', '.join(unknown)} not "
                               f"supported (supported: {', '.join(ST_MODULES)})")
        mode = "cls"
        for module, kind in zip(modules, kinds, strict=True):
            if kind == "Pooling":
                mode = _encoder_mode(folder.name, json.loads((folder / module.get("path", "") / "config.json")
                                                             .read_text()))
        dense = tuple(folder / m.get("path", "") for m, kind in zip(modules, kinds, strict=True)
                      if kind == "Dense")
        return cls(mode, "Normalize" in kinds, max_len, dense)


class Dense(torch.nn.Module):
    """sentence-transformers' Dense module: a linear projection of the pooled vector and its activation."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        config = json.loads((folder / "config.json").read_text())
        name = str(config.get("activation_function", "Identity")).rsplit(".", 1)[-1]
        if name not in DENSE_ACTIVATIONS:
            raise PoolingError(f"{folder.name}: Dense activation {name} is not supported "
                               f"({', '.join(DENSE_ACTIVATIONS)})")
        if not (folder / "model.safetensors").is_file():
            raise PoolingError(f"{folder.name}: Dense weights are read from model.safetensors, which is "
                               "missing")
        from safetensors.torch import load_file

        weights = load_file(folder / "model.safetensors")
        bias = config.get("bias", True)
        self.linear = torch.nn.Linear(config["in_features"], config["out_features"], bias=bias)
        self.linear.load_state_dict({k.removeprefix("linear."): v.float() for k, v in weights.items()})
        self.linear.requires_grad_(False)
        self.activation = DENSE_ACTIVATIONS[name]

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(pooled))


def _encoder_mode(name: str, config: dict) -> str:
    chosen = [mode for key, mode in ENCODER_POOLING.items() if config.get(key)]
    unknown = sorted(k for k, v in config.items()
                     if k.startswith("pooling_mode") and v and k not in ENCODER_POOLING)
    if unknown or len(chosen) != 1:
        raise PoolingError(f"{name}: sentence-transformers pooling {unknown or chosen} is not supported "
                           f"(one of {', '.join(ENCODER_POOLING)})")
    return chosen[0]


def pooler_for(model_dir: str | Path, hf_config: dict) -> str:
    """The checkpoint's pooling (module docstring): sentence-transformers config, bare decoder, else mean."""
    folder = Path(model_dir)
    declared = _sentence_transformers_pooling(folder) if folder.is_dir() else None
    if declared is not None:
        return declared
    architectures = hf_config.get("architectures") or []
    if architectures and all(a.endswith("Model") for a in architectures):
        return "last"
    return "mean"


class PoolingRequest(Request):
    """A prompt whose final hidden states are pooled into one vector; finishes when its prefill does."""

    __slots__ = ("pooling", "pooling_params", "pooled", "embedding")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                 pooling: str) -> None:
        super().__init__(request_id, prompt_token_ids, _PREFILL_ONLY)
        self.pooling_params, self.pooling = params, params.pooling or pooling
        self.want_prompt_logits = self.pooling != "last"  # every row is needed: no prefix-cache hits
        self.pooled: torch.Tensor | None = None
        self.embedding: list[float] | None = None

    def pool_rows(self, start: int, n: int) -> tuple[int, int]:
        """First position and count of the rows of positions [start, start + n) that the pooling reads."""
        if self.pooling == "mean":
            return start, n
        if self.pooling == "cls":
            return start, int(start == 0)
        first = max(start, self.num_tokens - 1)
        return first, max(0, start + n - first)

    def accumulate(self, total: torch.Tensor, first_pos: int) -> None:
        """Add the float32 sum of this step's rows (`pool_rows`: one row for last and cls pooling); a prefill
        restarted from position 0 after preemption starts over."""
        if self.pooling == "mean" and first_pos > 0 and self.pooled is not None:
            self.pooled = self.pooled + total
        else:
            self.pooled = total

    def finish_embedding(self) -> list[float]:
        """The pooled vector: averaged (mean), truncated to `dimensions`, L2-normalized."""
        assert self.pooled is not None, "finished before any row was pooled"
        vec = self.pooled / self.num_tokens if self.pooling == "mean" else self.pooled
        dims = self.pooling_params.dimensions
        if dims is not None:
            vec = vec[:dims]
        if self.pooling_params.normalize is not False:
            vec = torch.nn.functional.normalize(vec, dim=0)
        self.embedding = vec.cpu().tolist()
        self.pooled = None
        return self.embedding


def segment_sums(hidden: torch.Tensor, starts: list[int], counts: list[int]) -> torch.Tensor:
    """float32 [len(starts), hidden] sums of the row ranges [start, start + count) of `hidden`, in one op."""
    seg = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(counts))
    rows = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts, strict=True)])
    if rows.numel() == hidden.shape[0] and bool((rows == torch.arange(hidden.shape[0])).all()):
        src = hidden  # every row, in order (mean pooling alone in the step): no gather
    else:
        src = hidden.index_select(0, rows.to(hidden.device))
    out = torch.zeros(len(starts), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, seg.to(hidden.device), src.float())


def can_pool(model: torch.nn.Module) -> bool:
    """Whether the model gives final hidden states: the native forward's own, or a transformers model's
    (generic path) through a hook on its base model."""
    return hasattr(model, "hidden_states") or hasattr(getattr(model, "hf", None), "base_model")


def logits_and_hidden(model: torch.nn.Module, args: tuple, num_logits: int,
                      plan: object) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over `args` (ids, positions, kv caches, metadata, rows index): the logits of the index's
    first `num_logits` rows and the final hidden states of the rest."""
    *step, index = args
    if hasattr(model, "hidden_states"):
        hidden = model.hidden_states(*step, index, plan=plan)
        logits = (model.compute_logits(hidden[:num_logits]) if num_logits
                  else hidden.new_empty((0, model.config.vocab_size)))
        return logits, hidden[num_logits:]
    kept: list[torch.Tensor] = []  # the generic path: its base model's output, the LM head's input
    hook = model.hf.base_model.register_forward_hook(lambda module, inputs, out: kept.append(out[0]))
    try:
        logits = model(*step, index[:num_logits], plan=plan)  # the model's own head (softcapping, scaling)
    finally:
        hook.remove()
    return logits, kept[-1][0].index_select(0, index[num_logits:])


def check_input(ids: list[int], vocab: int, max_len: int, capacity: int, hidden: int,
                params: PoolingParams) -> str | None:
    """Why an embedding input can never run, or None."""
    if params.task != "embed":
        return f"task {params.task!r} needs a sequence-classification encoder; this model only embeds"
    if not ids:
        return "empty input"
    if min(ids) < 0 or max(ids) >= vocab:
        return f"input token ids must be in [0, {vocab})"
    if len(ids) > min(max_len, capacity):
        return f"input ({len(ids)} tokens) exceeds the {min(max_len, capacity)} tokens this model takes"
    if params.dimensions is not None and params.dimensions > hidden:
        return f"dimensions ({params.dimensions}) exceeds the model's embedding size ({hidden})"
    return None


def embedding_output(req: PoolingRequest) -> EmbeddingOutput:
    """The engine's output for one finished (or aborted) embedding input."""
    ok = req.finish_reason == "stop" and req.error is None
    return EmbeddingOutput(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                           embedding=req.finish_embedding() if ok else None, finish_reason=req.finish_reason,
                           metrics=req.metrics, error=req.error)


def split_inputs(inputs: object) -> list[str | list[int]]:
    """OpenAI's `input`: a string, token ids, or a list of either; one entry per embedding."""
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
        return [inputs]  # type: ignore[list-item]
    if isinstance(inputs, list | tuple) and inputs:
        return list(inputs)
    raise PoolingError("input must be a string, token ids, or a non-empty list of either")


@dataclass(slots=True)
class EmbeddingGroup:
    """A request with several inputs: one PoolingRequest per input, merged into one output (data in order)."""

    request_id: str
    sequences: list[Request]
    followers: list[Request] = field(default_factory=list)
    done: dict[str, EmbeddingOutput] = field(default_factory=dict)

    def finish(self, out: EmbeddingOutput) -> EmbeddingOutput | None:
        """Keep one input's output; the merged output once all are done (the first failure names the
        error)."""
        self.done[out.request_id] = out
        if len(self.done) < len(self.sequences):
            return None
        items = [self.done[s.request_id] for s in self.sequences]
        failed = next((o for o in items if o.finish_reason != "stop" or o.error), None)
        head = failed or items[0]
        return EmbeddingOutput(request_id=self.request_id, prompt_token_ids=items[0].prompt_token_ids,
                               embedding=items[0].embedding, finish_reason=head.finish_reason,
                               metrics=items[0].metrics, error=head.error, items=items)
