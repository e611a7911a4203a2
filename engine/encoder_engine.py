"""The engine of encoder checkpoints (BERT, RoBERTa, XLM-R): embeddings, class probabilities and pair scores.

An encoder keeps no KV cache and sees every token of a sequence at once, so a sequence is never chunked: each
step takes the oldest waiting sequence and the waiting ones nearest its length, whole, up to the token budget
(max_num_batched_tokens, at most STEP_TOKENS, at least one full-length sequence) and max_num_seqs (similar
lengths: little padding in attention), runs one forward over their tokens concatenated (engine.models.bert),
and pools (sentence-transformers' Pooling and Normalize: engine.pooling.EncoderPooling) or classifies each
sequence. A request of several inputs (a list of texts, or a query's pairs with its documents) finishes when
all have run. The surface is Engine's: add_request / step / abort / has_unfinished / stats.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from sluice.engine.config import EngineConfig
from sluice.engine.engine import RequestRejected
from sluice.engine.models.bert import AttentionPlan, EncoderConfig, load_encoder
from sluice.engine.models.loader import read_config
from sluice.engine.outputs import ClassificationOutput, EmbeddingOutput, RequestMetrics
from sluice.engine.pooling import Dense, EncoderPooling, PoolingError, PoolingParams, split_inputs
from sluice.engine.resolved import resolve_device, resolve_dtype
from sluice.engine.tokenizer import load_tokenizer

Pair = tuple[str, str]
SCHEDULE_WINDOW = 1024  # waiting sequences a step picks from
# Most tokens of one step (at least one full-length sequence), below max_num_batched_tokens: smaller steps
# keep each layer's activations closer to the cache its GEMMs read them from (bench/embeddings.py --encoder).
STEP_TOKENS = 2048


@dataclass(slots=True)
class EncoderSequence:
    """One input of a request: its token ids and token type ids."""

    request: EncoderRequest
    index: int
    token_ids: list[int]
    token_type_ids: list[int]


class EncoderRequest:
    """A request's inputs, their results as they come, and why it finished."""

    __slots__ = ("request_id", "params", "sequences", "results", "remaining", "metrics", "finish_reason")

    def __init__(self, request_id: str, params: PoolingParams) -> None:
        self.request_id, self.params = request_id, params
        self.sequences: list[EncoderSequence] = []
        self.results: list[list[float] | None] = []
        self.remaining = 0
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.finish_reason: str | None = None

    def add(self, token_ids: list[int], token_type_ids: list[int]) -> EncoderSequence:
        seq = EncoderSequence(self, len(self.sequences), token_ids, token_type_ids)
        self.sequences.append(seq)
        self.results.append(None)
        self.remaining += 1
        return seq


def split_pairs(prompt: Any) -> list[Pair]:
    """A score request's input: one (text_1, text_2) pair or a list of them."""
    if _is_pair(prompt):
        return [(prompt[0], prompt[1])]
    if isinstance(prompt, list) and prompt and all(_is_pair(p) for p in prompt):
        return [(a, b) for a, b in prompt]
    raise PoolingError("a score input is a (text_1, text_2) pair of strings or a non-empty list of them")


def _is_pair(item: Any) -> bool:
    return isinstance(item, tuple | list) and len(item) == 2 and all(isinstance(t, str) for t in item)


class EncoderEngine:
    """add_request / step / abort / has_unfinished over one encoder model; no KV cache."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        hf_config = read_config(config.model)
        self.model_config = c = EncoderConfig.from_hf(hf_config)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, c.torch_dtype, self.device)
        self.pooling = EncoderPooling.read(config.model)
        self.dense = [Dense(folder).to(self.device) for folder in self.pooling.dense]
        self.embedding_size = self.dense[-1].linear.out_features if self.dense else c.hidden_size
        self.max_model_len = self._max_len(config, c, self.pooling)
        own = config.tokenizer is None
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, hf_config if own else None)
        self.model = load_encoder(config.model, c, self.dtype, self.device)
        self.labels = [c.id2label[i] for i in range(c.num_labels)]
        bad = {k: v for k, v in (config.moderation_thresholds or {}).items() if not 0 <= v <= 1}
        if bad:
            raise ValueError(f"moderation_thresholds must lie in [0, 1]: {bad}")
        self.token_budget = max(min(config.max_num_batched_tokens, STEP_TOKENS), self.max_model_len)
        self.waiting: deque[EncoderSequence] = deque()
        self.requests: dict[str, EncoderRequest] = {}
        self._aborted: list[EncoderRequest] = []
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "computed_tokens": 0}

    @staticmethod
    def _max_len(config: EngineConfig, c: EncoderConfig, pooling: EncoderPooling) -> int:
        """The position table's length, sentence-transformers' max_seq_length, max_model_len: the least."""
        if config.max_model_len is not None and config.max_model_len > c.max_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit {c.max_len}")
        return min(x for x in (c.max_len, pooling.max_seq_length, config.max_model_len) if x is not None)

    def add_request(self, request_id: str, prompt: Any, params: Any = None) -> None:
        """Queue a request (PoolingParams: embed, classify or score each input); raise RequestRejected if it
        can never run."""
        if not isinstance(params, PoolingParams):
            raise RequestRejected(f"{self.model_config.architecture} is an encoder: it embeds, classifies and"
                                  " scores (PoolingParams), it does not generate text")
        if request_id in self.requests:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        try:
            self._check_task(params)
            encoded = self._encode(prompt, params.task)
        except PoolingError as exc:
            raise RequestRejected(str(exc)) from exc
        req = EncoderRequest(request_id, params)
        for k, (ids, types) in enumerate(encoded):
            problem = self._check(ids)
            if problem:
                raise RequestRejected(problem if len(encoded) == 1 else f"input {k}: {problem}")
            req.add(ids, types)
        self.requests[request_id] = req
        self.waiting.extend(req.sequences)

    def _check_task(self, params: PoolingParams) -> None:
        c = self.model_config
        if params.task in ("classify", "score") and c.head is None:
            raise PoolingError(f"{params.task} needs a ...ForSequenceClassification checkpoint, "
                               f"not {c.architecture}")
        if params.task == "score" and c.num_labels != 1:
            raise PoolingError(f"score needs a cross-encoder with one label; this classifier has "
                               f"{c.num_labels}")
        dims = params.dimensions
        if params.task == "embed" and dims is not None and dims > self.embedding_size:
            raise PoolingError(f"dimensions ({params.dimensions}) exceeds the model's embedding size "
                               f"({self.embedding_size})")

    def _encode(self, prompt: Any, task: str) -> list[tuple[list[int], list[int]]]:
        """Token ids and token type ids of each input (pairs: the tokenizer's pair template and types)."""
        if task == "score":
            return [self._tokenize(a, b) for a, b in split_pairs(prompt)]
        out = []
        for item in split_inputs(prompt):
            if isinstance(item, str):
                out.append(self._tokenize(item))
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                out.append(([int(t) for t in item], [0] * len(item)))
            else:
                raise PoolingError("each input must be a string or a list of token ids")
        return out

    def _tokenize(self, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
        enc = self.tokenizer(text, pair, return_token_type_ids=True)
        ids = list(enc["input_ids"])
        return ids, list(enc.get("token_type_ids") or [0] * len(ids))

    def _check(self, ids: list[int]) -> str | None:
        """Why one input can never run, or None."""
        vocab, limit = self.model_config.vocab_size, self.max_model_len
        if not ids:
            return "empty input"
        if min(ids) < 0 or max(ids) >= vocab:
            return f"input token ids must be in [0, {vocab})"
        if len(ids) > limit:
            return f"input ({len(ids)} tokens) exceeds the {limit} tokens this model takes"
        return None

    def abort(self, request_id: str) -> None:
        """Stop a request; its output (finish_reason 'abort') comes back from the next step()."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.finish_reason = "abort"
            self._aborted.append(req)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or has an abort to report."""
        return bool(self.requests) or bool(self._aborted)

    def num_unfinished(self) -> int:
        """Requests not finished yet."""
        return len(self.requests)

    def step(self) -> list[EmbeddingOutput | ClassificationOutput]:
        """Run one forward over the sequences that fit; outputs of the requests that finished in it."""
        done, self._aborted = self._aborted, []
        batch = self._schedule()
        if batch:
            done += self._run(batch)
        return [self._output(r) for r in done]

    def _schedule(self) -> list[EncoderSequence]:
        """The oldest waiting sequence and, from the first SCHEDULE_WINDOW waiting ones, those nearest its
        length, whole, while the token budget and max_num_seqs allow: a step of similar lengths pads its
        attention little, and the oldest sequence always runs."""
        window = [s for s in self._take_window() if s.request.finish_reason is None]
        if not window:
            return []
        head = window[0]
        ranked = sorted(window, key=lambda s: len(s.token_ids))
        lo = hi = next(i for i, s in enumerate(ranked) if s is head)
        hi += 1
        tokens, n0 = len(head.token_ids), len(head.token_ids)
        while hi - lo < self.config.max_num_seqs:
            left = len(ranked[lo - 1].token_ids) if lo > 0 else None
            right = len(ranked[hi].token_ids) if hi < len(ranked) else None
            if right is not None and tokens + right <= self.token_budget and (
                    left is None or right - n0 < n0 - left):
                hi, tokens = hi + 1, tokens + right
            elif left is not None and tokens + left <= self.token_budget:
                lo, tokens = lo - 1, tokens + left
            else:
                break
        batch = ranked[lo:hi]
        chosen = {id(s) for s in batch}
        self.waiting.extendleft(reversed([s for s in window if id(s) not in chosen]))
        return batch

    def _take_window(self) -> list[EncoderSequence]:
        """The first SCHEDULE_WINDOW waiting sequences, off the queue."""
        return [self.waiting.popleft() for _ in range(min(SCHEDULE_WINDOW, len(self.waiting)))]

    def _run(self, batch: list[EncoderSequence]) -> list[EncoderRequest]:
        """One forward over the batch, sorted by length (engine.models.bert.AttentionPlan); the requests whose
        last input it ran."""
        batch.sort(key=lambda s: len(s.token_ids))
        lens = [len(s.token_ids) for s in batch]
        hidden = self._forward(batch, lens)
        starts = torch.tensor([0, *lens[:-1]], device=self.device).cumsum(0)
        results = self._results(batch, hidden, starts, torch.tensor(lens, device=self.device))
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += sum(lens)
        finished = []
        for seq, value in zip(batch, results, strict=True):
            req = seq.request
            req.results[seq.index] = value
            req.remaining -= 1
            if req.remaining == 0:
                req.finish_reason = "stop"
                req.metrics.first_token_time = req.metrics.finish_time = time.monotonic()
                self.requests.pop(req.request_id, None)
                finished.append(req)
        return finished

    def _forward(self, batch: list[EncoderSequence], lens: list[int]) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of the batch's sequences, back to back."""
        def flat(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

        ids = flat([t for s in batch for t in s.token_ids])
        types = flat([t for s in batch for t in s.token_type_ids])
        positions = flat([p for n in lens for p in range(n)])
        with torch.inference_mode():
            return self.model(ids, positions, types, AttentionPlan(lens, self.device))

    def _results(self, batch: list[EncoderSequence], hidden: torch.Tensor, starts: torch.Tensor,
                 lens: torch.Tensor) -> list[list[float]]:
        """Each sequence's embedding (pooled, truncated, normalized) or class probabilities, as floats."""
        out: list[list[float] | None] = [None] * len(batch)
        pooled: dict[str, torch.Tensor] = {}
        classify = [i for i, s in enumerate(batch) if s.request.params.task != "embed"]
        if classify:
            with torch.inference_mode():
                logits = self.model.classify(hidden.index_select(0, starts[classify]))
            for i, row in zip(classify, self._probs(logits).cpu().tolist(), strict=True):
                out[i] = row
        for i, seq in enumerate(batch):
            params = seq.request.params
            if params.task != "embed":
                continue
            mode = params.pooling or self.pooling.mode
            if mode not in pooled:
                pooled[mode] = self._project(pool(hidden, starts, lens, mode))
            vec = pooled[mode][i]
            if params.dimensions is not None:
                vec = vec[: params.dimensions]
            if params.normalize if params.normalize is not None else self.pooling.normalize:
                vec = torch.nn.functional.normalize(vec, dim=0)
            out[i] = vec.cpu().tolist()
        return out  # type: ignore[return-value]

    def _project(self, pooled: torch.Tensor) -> torch.Tensor:
        """The pooled vectors through the checkpoint's Dense modules, in order (float32)."""
        with torch.inference_mode():
            for dense in self.dense:
                pooled = dense(pooled)
        return pooled

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Class probabilities: sigmoid for a single label or a multi-label classifier, else softmax."""
        if logits.shape[-1] == 1 or self.model_config.problem_type == "multi_label_classification":
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)

    def _output(self, req: EncoderRequest) -> EmbeddingOutput | ClassificationOutput:
        self.requests.pop(req.request_id, None)
        if req.metrics.finish_time is None:
            req.metrics.finish_time = time.monotonic()
        self.counters["prompt_tokens"] += sum(len(s.token_ids) for s in req.sequences)
        kind = EmbeddingOutput if req.params.task == "embed" else ClassificationOutput
        ok = req.finish_reason == "stop"
        items = [kind(f"{req.request_id}#{s.index}", s.token_ids, req.results[s.index] if ok else None,
                      req.finish_reason, req.metrics) for s in req.sequences]
        if len(items) == 1:
            out, out.request_id = items[0], req.request_id
        else:
            head = items[0]
            first = head.embedding if isinstance(head, EmbeddingOutput) else head.probs
            out = kind(req.request_id, head.prompt_token_ids, first, req.finish_reason, req.metrics,
                       items=items)
        if isinstance(out, ClassificationOutput):
            out.labels, out.thresholds = self.labels, self.config.moderation_thresholds
        return out

    def stats(self) -> dict[str, Any]:
        """Queue sizes and token counters, under Engine's names (no KV cache: its numbers are zero)."""
        return {"kv_blocks_used": 0, "kv_blocks_total": 0, "kv_block_size": 0, "kv_utilization": 1.0,
                "prefix_cache_hit_rate": 0.0, "num_running": 0, "num_waiting": len(self.requests),
                "num_preemptions": 0, **self.counters}


def pool(hidden: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, mode: str) -> torch.Tensor:
    """float32 [sequences, hidden]: each sequence's first (cls) or last token, or its tokens' mean or max."""
    if mode == "cls":
        return hidden.index_select(0, starts).float()
    if mode == "last":
        return hidden.index_select(0, starts + lens - 1).float()
    if mode in ("mean", "max"):
        return torch.segment_reduce(hidden.float(), mode, lengths=lens, axis=0)
    raise PoolingError(f"pooling {mode!r} is not one of cls, last, mean, max")
