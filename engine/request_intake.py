"""Request intake: a prompt and its params checked against the model and the KV pool, turned into the engine's
requests (one, an n > 1 group's sequences, or one per embedding input), each with its grammar matcher."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from sluice.engine.groups import SequenceGroup
from sluice.engine.json_schema import JsonBounds
from sluice.engine.logits_processors import LogitsProcessors
from sluice.engine.models.llama import ModelConfig
from sluice.engine.multimodal.inputs import MultiModalInputs, with_images
from sluice.engine.multimodal.processor import (
    MultiModalError,
    MultiModalProcessor,
    split_prompt,
)
from sluice.engine.multimodal.vl_families import processor_for
from sluice.engine.pooling import (
    EmbeddingGroup,
    PoolingError,
    PoolingParams,
    PoolingRequest,
    can_pool,
    check_input,
    pooler_for,
    split_inputs,
)
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured import GrammarError, StructuredOutputManager

Group = SequenceGroup | EmbeddingGroup


class RequestRejected(ValueError):
    """A request that can never run (too long, empty, duplicate id); the engine serves the rest."""


def check_prompt(ids: list[int], params: SamplingParams, vocab: int, max_model_len: int,
                 capacity: int) -> None:
    """Raise RequestRejected where a generation request can never run (empty, ids or fields out of range, too
    long for the model or for the whole KV cache)."""
    n = len(ids)
    if n == 0:
        raise RequestRejected("empty prompt")
    if min(ids) < 0 or max(ids) >= vocab:
        raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
    if params.top_k > vocab:
        raise RequestRejected(f"top_k ({params.top_k}) must be <= the vocabulary size ({vocab}); "
                              "0 disables it")
    named = [*(params.logit_bias or {}), *params.stop_token_ids]
    if named and max(named) >= vocab:
        raise RequestRejected(f"token id {max(named)} in logit_bias/stop_token_ids is outside the vocabulary "
                              f"[0, {vocab})")
    if params.seed is not None and not -(2**63) <= params.seed < 2**64:
        raise RequestRejected(f"seed ({params.seed}) must fit in 64 bits")
    need = n + (params.max_tokens or 1)
    if need > max_model_len:
        raise RequestRejected(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds max_model_len "
            f"({max_model_len})"
        )
    if need > capacity:
        raise RequestRejected(f"request needs {need} tokens of KV cache but the whole cache holds {capacity}")


@dataclass(slots=True)
class RequestIntake:
    """Turns add_request's arguments into validated requests for one model and one KV pool."""

    tokenizer: Any
    model: torch.nn.Module
    model_config: ModelConfig
    model_dir: str
    hf_config: dict
    max_model_len: int
    capacity: int  # tokens the whole KV pool holds
    processors: LogitsProcessors
    device: torch.device
    json_bounds: JsonBounds | None = None  # the length bounds of a JSON schema's values (engine.json_schema)
    pooling: str | None = None
    mm_processor: MultiModalProcessor | Any = None  # a vision-language model's, made on the first image

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (strings through the tokenizer)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def requests(self, request_id: str, prompt: object,
                 params: SamplingParams | PoolingParams) -> tuple[list[Request], Group | None]:
        """The requests to add (with their grammar matchers) and the group that merges their outputs, if any;
        raise RequestRejected if the request can never run."""
        mm = None
        if isinstance(params, PoolingParams):
            seqs, group = self._embedding(request_id, prompt, params)
        else:
            ids, mm = self._multimodal(prompt) if isinstance(prompt, dict) else (self.encode(prompt), None)
            check_prompt(ids, params, self.model_config.vocab_size, self.max_model_len, self.capacity)
            if params.n == 1 and (params.best_of or 1) == 1:
                seqs, group = [Request(request_id, ids, params)], None
            else:
                group = SequenceGroup.fan_out(request_id, ids, params)
                seqs = group.sequences
        for req in seqs:
            with_images(req, mm)
            self._attach_grammar(req)
        return seqs, group

    def _multimodal(self, prompt: dict) -> tuple[list[int], MultiModalInputs | None]:
        """Token ids (image placeholders expanded) and images of a prompt dict (engine.multimodal)."""
        try:
            text, images = split_prompt(prompt)
            if not images:
                return self.encode(text), None
            if not hasattr(self.model, "prepare_step"):
                raise MultiModalError(f"{self.model_config.architecture} takes no images (a text-only model)")
            if self.mm_processor is None:
                self.mm_processor = processor_for(self.model_dir, self.hf_config, self.tokenizer)
            return self.mm_processor.process(text, images)
        except MultiModalError as exc:
            raise RequestRejected(str(exc)) from exc

    def _embedding(self, request_id: str, inputs: object,
                   params: PoolingParams) -> tuple[list[Request], EmbeddingGroup | None]:
        """One PoolingRequest per input (several inputs come back merged into one EmbeddingOutput)."""
        if not can_pool(self.model):
            name = type(self.model).__name__
            raise RequestRejected(f"embeddings need the model's final hidden states, which {name} does not "
                                  "give")
        try:
            prompts = split_inputs(inputs)
            self.pooling = self.pooling or pooler_for(self.model_dir, self.hf_config)
        except PoolingError as exc:
            raise RequestRejected(str(exc)) from exc
        seqs: list[Request] = []
        for k, prompt in enumerate(prompts):
            ids = self.encode(prompt)
            problem = check_input(ids, self.model_config.vocab_size, self.max_model_len, self.capacity,
                                  self.model_config.hidden_size, params)
            if problem:
                raise RequestRejected(problem if len(prompts) == 1 else f"input {k}: {problem}")
            rid = request_id if len(prompts) == 1 else f"{request_id}#{k}"
            seqs.append(PoolingRequest(rid, ids, params, self.pooling))
        return seqs, EmbeddingGroup(request_id, seqs) if len(seqs) > 1 else None

    def _attach_grammar(self, req: Request) -> None:
        if req.params.structured_outputs is not None:
            try:
                req.grammar = self.structured().matcher(req.params.structured_outputs)
            except GrammarError as exc:
                raise RequestRejected(str(exc)) from exc

    def structured(self) -> StructuredOutputManager:
        """The grammar engine, started on the first structured request."""
        if self.processors.structured is None:
            # On CPU the forward owns the cores: xgrammar's fill threads would compete with it; one suffices,
            # and it fills during the forward only where a core is left over (else the forward's threads wait
            # on it).
            cpu = self.device.type == "cpu"
            so = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                   self.processors.eos_token_ids, 1 if cpu else "auto", self.json_bounds)
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            so.overlap = not cpu or torch.get_num_threads() < cores
            self.processors.structured = so
        return self.processors.structured
