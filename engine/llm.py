"""The offline API: LLM(model, ...).generate(prompts, params) with a progress bar."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from sluice.engine.config import EngineConfig
from sluice.engine.engine import Engine
from sluice.engine.outputs import EmbeddingOutput, RequestOutput
from sluice.engine.pooling import PoolingParams, split_inputs
from sluice.engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict  # a dict: {"prompt" | "prompt_token_ids", "multi_modal_data": {"image": ...}}


class LLM:
    """A model loaded into the engine, with batch generate, chat and stats."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(str(model), **kwargs)
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation (and the tools offered) through the tokenizer's chat template, ready for
        the reply."""
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, plist, strict=True):
            self._counter += 1
            rid = f"gen-{self._counter}"
            self.engine.add_request(rid, prompt, p)
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
    ) -> list[RequestOutput]:
        """Generate the assistant reply for each conversation (`tools` go to the chat template; image_url and
        image_pil parts go to a vision-language model, URLs fetched as SLUICE_IMAGE_* allows)."""
        if messages_list and isinstance(messages_list[0], dict):
            messages_list = [messages_list]  # type: ignore[list-item]
        return self.generate([self._chat_prompt(m, tools) for m in messages_list], params, progress)

    def _chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Prompt:
        """A conversation's engine prompt: its ids, with its images (engine.multimodal.chat) if any."""
        if not any(isinstance(m.get("content"), list) for m in messages):
            return self.encode_chat(messages, tools)
        from sluice.contract.images import ImageSettings
        from sluice.contract.settings import get_settings
        from sluice.engine.multimodal.chat import chat_images, image_prompt

        rendered, images = chat_images(messages, ImageSettings.of(get_settings()))
        return image_prompt(self.encode_chat(rendered, tools), images)

    def takes_images(self) -> bool:
        """Whether the model takes images in its prompts (a vision-language model)."""
        return hasattr(self.engine.model, "prepare_step")

    def score(self, prompts: Sequence[Prompt], progress: bool = False) -> list[Any]:
        """Logits [len, vocab] at every prompt position, computed through the paged engine."""
        ids = []
        for prompt in prompts:
            self._counter += 1
            rid = f"score-{self._counter}"
            self.engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0))
            self.engine.requests[rid].want_prompt_logits = True
            ids.append(rid)
        return [out.prompt_logits for out in self._drain(ids, progress)]

    # The serving surface: what a worker loop drives (one continuous batch, requests added and aborted by id).
    @property
    def max_num_seqs(self) -> int:
        """How many requests may run at once."""
        return self.config.max_num_seqs

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """Queue a request under request_id; raise RequestRejected if it can never run."""
        self.engine.add_request(request_id, prompt, params)

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; the outputs of the requests that finished in it."""
        return self.engine.step()

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
