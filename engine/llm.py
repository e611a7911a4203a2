"""The offline API: LLM(model, ...).generate(prompts, params) with a progress bar."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from sluice.engine.config import EngineConfig
from sluice.engine.engine import Engine
from sluice.engine.lora.lora_request import LoRARequest
from sluice.engine.models.bert import is_encoder
from sluice.engine.models.loader import read_config
from sluice.engine.outputs import ClassificationOutput, EmbeddingOutput, RequestOutput
from sluice.engine.pooling import PoolingParams, split_inputs
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.weight_reserve import WeightReservation

Prompt = str | list[int] | dict  # a dict: {"prompt" | "prompt_token_ids", "multi_modal_data": {"image": ...}}
# Called after every `LLM.step` with the step's outputs and its duration in seconds.
StepObserver = Callable[[list[RequestOutput | EmbeddingOutput], float], None]


class LLM:
    """A model loaded into the engine, with batch generate, chat and stats."""

    def __init__(self, model: str, weight_reservation: WeightReservation | None = None,
                 **kwargs: Any) -> None:
        """Load `model` with the EngineConfig fields given as keywords; `weight_reservation`: the CPU weight
        arena reserved for it at the process's start (engine.weight_reserve), taken where it fits."""
        self.config = EngineConfig.from_kwargs(str(model), **kwargs)
        self.engine = _engine_for(self.config, weight_reservation)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0
        self._observers: list[StepObserver] = []

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation (and the tools offered) through the tokenizer's chat template, ready
        for the reply."""
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. `lora_request`: one adapter for
        every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRARequests for {len(prompts)} prompts")
        ids = []
        for prompt, p, lora in zip(prompts, plist, loras, strict=True):
            self._counter += 1
            rid = f"gen-{self._counter}"
            self.engine.add_request(rid, prompt, p, lora_request=lora)
            ids.append(rid)
        return self._drain(ids, progress)

    def embed(self, inputs: str | list[int] | Sequence[Prompt], dimensions: int | None = None,
              params: PoolingParams | None = None, progress: bool = True) -> list[EmbeddingOutput]:
        """One embedding per input (a string, token ids, or a list of either), in input order, pooled as the
        checkpoint says (engine.pooling); `dimensions` truncates and renormalizes."""
        params = params or PoolingParams(dimensions=dimensions)
        ids = []
        for prompt in split_inputs(inputs):
            self._counter += 1
            rid = f"embed-{self._counter}"
            self.engine.add_request(rid, prompt, params)
            ids.append(rid)
        return self._drain(ids, progress)

    def classify(self, inputs: str | list[int] | Sequence[Prompt],
                 progress: bool = True) -> list[ClassificationOutput]:
        """Class probabilities of each input (a ...ForSequenceClassification checkpoint), in input order."""
        return self._pool(split_inputs(inputs), PoolingParams(task="classify"), "classify", progress)

    def _pool(self, inputs: list, params: PoolingParams, kind: str, progress: bool) -> list:
        """One pooling request per input, drained; outputs in input order."""
        if self.runner_type != "pooling":
            raise ValueError(f"{kind} needs an encoder checkpoint with a sequence-classification head")
        ids = []
        for prompt in inputs:
            self._counter += 1
            rid = f"{kind}-{self._counter}"
            self.engine.add_request(rid, prompt, params)
            ids.append(rid)
        return self._drain(ids, progress)

    @property
    def runner_type(self) -> str:
        """'pooling' for an encoder checkpoint (embed, classify, score), else 'generate' (vLLM's names)."""
        return "generate" if isinstance(self.engine, Engine) else "pooling"

    def _drain(self, ids: list[str], progress: bool) -> list:
        results: dict[str, RequestOutput | EmbeddingOutput] = {}
        with tqdm(total=len(ids), disable=not progress, desc="generate", unit="req") as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        return [results[i] for i in ids]

    def chat(
        self,
        messages_list: Sequence[list[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = True,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        image_loader: Callable[[str], Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant reply for each conversation (`tools` go to the chat template; image_url and
        image_pil parts go to a vision-language model, image_url ones read by `image_loader` (URL -> PIL
        image; by default data: URLs only, engine.multimodal.image_decode); `lora_request` as for
        generate)."""
        if messages_list and isinstance(messages_list[0], dict):
            messages_list = [messages_list]  # type: ignore[list-item]
        prompts = [self._chat_prompt(m, tools, image_loader) for m in messages_list]
        return self.generate(prompts, params, progress, lora_request)

    def _chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     image_loader: Callable[[str], Any] | None = None) -> Prompt:
        """A conversation's engine prompt: its ids, with its images (engine.multimodal.chat) if any."""
        if not any(isinstance(m.get("content"), list) for m in messages):
            return self.encode_chat(messages, tools)
        from sluice.engine.multimodal.chat import chat_images, image_prompt
        from sluice.engine.multimodal.image_decode import load_data_url

        rendered, images = chat_images(messages, image_loader or load_data_url)
        return image_prompt(self.encode_chat(rendered, tools), images)

    def takes_images(self) -> bool:
        """Whether the model takes images in its prompts (a vision-language model)."""
        return hasattr(self.engine.model, "prepare_step")

    def score(self, prompts: Sequence[Prompt] | str, data_2: str | Sequence[str] | None = None,
              progress: bool = False, lora_request: LoRARequest | None = None) -> list[Any]:
        """vLLM's score with `data_2`: a cross-encoder's relevance of each (data_1, data_2) pair (one side
        may be a single text, paired with every text of the other), as ClassificationOutput (`.score`).
        Without it, on a generative model: the logits [len, vocab] at every prompt position (with an
        adapter: `lora_request`)."""
        if data_2 is not None:
            return self._pool(_pairs(prompts, data_2), PoolingParams(task="score"), "score", progress)
        ids = []
        for prompt in prompts:
            self._counter += 1
            rid = f"score-{self._counter}"
            params = SamplingParams(max_tokens=1, temperature=0)
            self.engine.add_request(rid, prompt, params, lora_request=lora_request)
            self.engine.requests[rid].want_prompt_logits = True
            ids.append(rid)
        return [out.prompt_logits for out in self._drain(ids, progress)]

    # The serving surface: what a worker loop drives (one continuous batch, requests added and aborted by id).
    @property
    def max_num_seqs(self) -> int:
        """How many requests may run at once."""
        return self.config.max_num_seqs

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request under request_id (with an adapter); raise RequestRejected if it can never run."""
        adapter = {} if lora_request is None else {"lora_request": lora_request}  # encoders take none
        self.engine.add_request(request_id, prompt, params, **adapter)

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; the outputs of the requests that finished in it (observers see them)."""
        if not self._observers:
            return self.engine.step()
        start = time.perf_counter()
        outs = self.engine.step()
        seconds = time.perf_counter() - start
        for observe in self._observers:
            observe(outs, seconds)
        return outs

    def add_step_observer(self, observer: StepObserver) -> None:
        """Have `observer(outputs, seconds)` called after every `step` (a worker's metrics, for one)."""
        self._observers.append(observer)

    def abort(self, request_id: str) -> None:
        """Stop a request; its partial output comes back from the next step()."""
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting, running or has an abort to report."""
        return self.engine.has_unfinished()

    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return self.engine.num_unfinished()

    def stats(self) -> dict[str, Any]:
        """KV cache use, prefix-cache hit rate, queue sizes and token counters."""
        return self.engine.stats()


def _engine_for(config: EngineConfig, weight_reservation: WeightReservation | None = None) -> Any:
    """The paged engine; for an encoder checkpoint (BERT, RoBERTa, XLM-R), which it refuses as it reads
    config.json, the encoder engine (a decoder's config.json is read once)."""
    try:
        return Engine(config, weight_reservation)
    except ValueError:
        if not is_encoder(read_config(config.model)):
            raise
    from sluice.engine.encoder_engine import EncoderEngine

    return EncoderEngine(config)


def _pairs(data_1: Any, data_2: Any) -> list[tuple[str, str]]:
    """vLLM's score pairing: one text against many, many against one, or n against n."""
    one, two = ([d] if isinstance(d, str) else list(d) for d in (data_1, data_2))
    if len(one) == 1:
        one = one * len(two)
    elif len(two) == 1:
        two = two * len(one)
    if len(one) != len(two):
        raise ValueError(f"score pairs {len(one)} texts with {len(two)}: give one, or as many on each side")
    return list(zip(one, two, strict=True))
