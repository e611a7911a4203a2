"""A step's logits turned into tokens and outputs: sampling, speculative verification and pooling, then stop
checks, logprobs, detokenizing and the finished requests' outputs."""

from __future__ import annotations

import time
from typing import Any

import torch

from sluice.engine.block_manager import BlockManager
from sluice.engine.groups import Groups
from sluice.engine.logits_processors import LogitsProcessors
from sluice.engine.model_runner import StepLogits
from sluice.engine.outputs import EmbeddingOutput, RequestOutput
from sluice.engine.pooling import PoolingRequest, embedding_output, segment_sums
from sluice.engine.request import Request
from sluice.engine.sampler import device_tensor, processed_logits, top_logprobs
from sluice.engine.scheduler import Scheduler
from sluice.engine.token_bytes import TokenBytes
from sluice.engine.verification import SpecVerifier

Logprobs = list[dict[int, float]]


class OutputProcessor:
    """Samples, verifies or pools the requests a step computed, appends what they emit, finishes those a stop
    condition ends, and builds their outputs."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int, logprobs_mode: str,
                 scheduler: Scheduler, blocks: BlockManager, processors: LogitsProcessors,
                 generator: torch.Generator, groups: Groups, counters: dict[str, int]) -> None:
        self.tokenizer, self.token_bytes = tokenizer, TokenBytes(tokenizer)
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.logprobs_mode, self.scheduler, self.blocks = logprobs_mode, scheduler, blocks
        self.processors, self.generator = processors, generator
        self.groups, self.counters = groups, counters
        self.verifier = SpecVerifier(processors, generator, blocks)

    def process(self, reqs: list[Request], rows: StepLogits) -> list[Request]:
        """Sample for requests whose last known token was computed; finish those that are done."""
        pooled = [i for i, r in enumerate(reqs) if isinstance(r, PoolingRequest)]
        for req, start, count in zip(reqs, rows.row_start, rows.num_rows, strict=True):
            if req.want_prompt_logits and count and not isinstance(req, PoolingRequest):
                req.prompt_logits.append(rows.logits[start:start + count].float().cpu())
        for req in reqs:  # before any finishes and frees its blocks: a finished prompt's blocks stay cached
            self.blocks.cache_full_blocks(req)
        ready = [i for i, r in enumerate(reqs) if r.num_computed_tokens >= r.num_tokens and i not in pooled]
        plain = [i for i in ready if not reqs[i].spec_token_ids]
        speculated = [i for i in ready if reqs[i].spec_token_ids]
        finished = self._pool(reqs, rows, pooled) if pooled else []
        if speculated:
            finished += self._verify(reqs, rows, speculated)
        if plain:
            finished += self._sample(reqs, rows, plain)
        return finished

    @staticmethod
    def sampled_plainly(reqs: list[Request], num_new_tokens: list[int]) -> list[Request]:
        """The requests a step of these samples without speculation, in the order `process` samples them."""
        return [r for r, n in zip(reqs, num_new_tokens, strict=True)
                if not isinstance(r, PoolingRequest) and not r.spec_token_ids
                and r.num_computed_tokens + n >= r.num_tokens]

    def _pool(self, reqs: list[Request], rows: StepLogits, index: list[int]) -> list[Request]:
        """Pool embedding requests' hidden rows; finish those whose prompt is computed (no decode)."""
        finished = []
        counted = [i for i in index if rows.num_rows[i]]
        if counted:  # every request's rows summed in one op
            assert rows.hidden is not None
            starts, counts = [rows.row_start[i] for i in counted], [rows.num_rows[i] for i in counted]
            sums = segment_sums(rows.hidden, starts, counts)
            for total, i in zip(sums, counted, strict=True):
                reqs[i].accumulate(total, rows.first_pos[i])  # type: ignore[attr-defined]
        for i in index:
            req = reqs[i]
            assert isinstance(req, PoolingRequest)
            if req.num_computed_tokens >= req.num_tokens:
                self.blocks.cache_full_blocks(req)  # its full blocks stay in the prefix cache once freed
                self.scheduler.finish(req, "stop")
                req.metrics.first_token_time = req.metrics.finish_time = time.monotonic()
                finished.append(req)
        return finished

    def _verify(self, reqs: list[Request], rows: StepLogits, index: list[int]) -> list[Request]:
        """Append what the listed requests' verified proposals emit; roll back the rest's rejected slots."""
        finished: list[Request] = []
        for v in self.verifier.verify(reqs, rows, index):
            lps = self.logprobs_for(v.logits, v.processed, v.emitted, v.req)
            if self.append_tokens(v.req, v.emitted, lps):
                finished.append(v.req)
            else:
                self.verifier.roll_back(v)
        return finished

    def _sample(self, reqs: list[Request], rows: StepLogits, ready: list[int]) -> list[Request]:
        """Sample one token for each listed request from its last row; the requests that finished."""
        idx = [rows.row_start[i] + rows.num_rows[i] - 1 for i in ready]
        if idx == list(range(idx[0], idx[0] + len(idx))):  # every row samples (decode): a view, no index copy
            logits = rows.logits[idx[0]: idx[0] + len(idx)]
        else:
            logits = rows.logits[device_tensor(idx, torch.long, rows.logits.device)]
        sreqs = [reqs[i] for i in ready]
        tokens, processed = self.processors.sample(logits, sreqs, self.generator)
        lps = self._logprobs(logits, processed, tokens, sreqs)
        finished = []
        for j, (req, tok) in enumerate(zip(sreqs, tokens.tolist(), strict=True)):
            if self.append_tokens(req, [tok], None if lps is None else [lps[j]]):
                finished.append(req)
        return finished

    def logprobs_for(self, logits: torch.Tensor, processed: torch.Tensor, tokens: list[int],
                     req: Request) -> Logprobs | None:
        """Logprobs of emitted tokens from the rows that produced them (raw and processed), if asked for."""
        if req.params.logprobs is None:
            return None
        emitted = torch.tensor(tokens, device=logits.device)
        return self._logprobs(logits, processed, emitted, [req] * len(tokens))

    def _logprobs(self, logits: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor,
                  reqs: list[Request]) -> Logprobs | None:
        """Per row, the sampled token's and the top-n values that `logprobs_mode` names (raw: the logits)."""
        wanted = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
        if not wanted:
            return None
        mode = self.logprobs_mode
        source = processed_logits(processed, reqs) if mode.startswith("processed") else logits
        return top_logprobs(source, tokens, max(wanted), normalize=mode.endswith("logprobs"))

    def append_tokens(self, req: Request, tokens: list[int], logprobs: Logprobs | None) -> bool:
        """Append accepted tokens one by one, stopping at the first stop condition; True if finished."""
        now = time.monotonic()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        for i, tok in enumerate(tokens):
            req.output_token_ids.append(tok)
            if req.grammar is not None and not req.grammar.is_terminated():
                req.grammar.accept_token(tok)
            self.counters["generated_tokens"] += 1
            if req.logprobs is not None and logprobs is not None:
                n = req.params.logprobs
                top = sorted(logprobs[i].items(), key=lambda kv: -kv[1])[:n]
                req.logprobs.append(dict(top) | {tok: logprobs[i][tok]})
            reason = self.stop_reason(req, tok)
            if reason:
                self.scheduler.finish(req, reason)
                req.metrics.finish_time = now
                return True
        return False

    def stop_reason(self, req: Request, tok: int) -> str | None:
        """Why the request stops after emitting `tok` ('stop' or 'length'), None if it goes on."""
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if p.stop and self._hit_stop_string(req):
            return "stop"
        if req.grammar is not None and req.grammar.is_terminated():
            return "stop"
        if p.max_tokens is not None and len(req.output_token_ids) >= p.max_tokens:
            return "length"
        if req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _hit_stop_string(self, req: Request) -> bool:
        """Whether the text so far holds a stop string (searched only where new text could complete one); the
        text is cut before the first."""
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        longest = max(len(s) for s in req.params.stop)
        lo = max(0, req.stop_text_len - longest + 1)
        hits = [i for i in (text.find(s, lo) for s in req.params.stop) if i >= 0]
        req.stop_text_len = len(text)
        if hits:
            req.text = text[: min(hits)]
        return bool(hits)

    def output(self, req: Request) -> RequestOutput | EmbeddingOutput:
        """The finished (or aborted) request's output: detokenized text, logprobs and their bytes, metrics."""
        if req.metrics.finish_time is None:
            req.metrics.finish_time = time.monotonic()
        req.metrics.num_cached_tokens = req.num_cached_tokens
        if isinstance(req, PoolingRequest) or self.groups.counts_prompt(req):
            self.counters["prompt_tokens"] += len(req.prompt_token_ids)
        if isinstance(req, PoolingRequest):
            return embedding_output(req)
        text = req.text
        if text is None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True).rstrip("\ufffd")
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=text,
            finish_reason=req.finish_reason,
            metrics=req.metrics,
            error=req.error,
            logprobs=req.logprobs,
            token_bytes=self._token_bytes(req),
            prompt_logits=torch.cat(req.prompt_logits) if req.prompt_logits else None,
        )

    def _token_bytes(self, req: Request) -> dict[int, bytes] | None:
        """Bytes of the output tokens and of every token named in their logprobs, when logprobs were asked."""
        if req.logprobs is None:
            return None
        return self.token_bytes.many([*req.output_token_ids, *(t for step in req.logprobs for t in step)])
