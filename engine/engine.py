"""The step loop: schedule, run the model once, sample, finish what is done."""

from __future__ import annotations

import os
import time

import torch

from sluice.engine import heap
from sluice.engine.block_manager import BlockManager
from sluice.engine.config import EngineConfig
from sluice.engine.groups import SequenceGroup
from sluice.engine.kv_cache import bytes_per_token, pool_blocks
from sluice.engine.logits_processors import LogitsProcessors
from sluice.engine.model_runner import ModelRunner, StepLogits
from sluice.engine.models.loader import load_model
from sluice.engine.multimodal.inputs import MultiModalInputs, with_images
from sluice.engine.multimodal.processor import MultiModalError, MultiModalProcessor, split_prompt
from sluice.engine.outputs import EmbeddingOutput, RequestOutput
from sluice.engine.pooling import (
    EmbeddingGroup,
    PoolingError,
    PoolingParams,
    PoolingRequest,
    can_pool,
    check_input,
    embedding_output,
    pooler_for,
    segment_sums,
    split_inputs,
)
from sluice.engine.quantization import linear_hook, pack_4bit_for_cpu
from sluice.engine.request import Request
from sluice.engine.resolved import ResolvedConfig
from sluice.engine.sampler import device_tensor, processed_logits, top_logprobs
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import ScheduledBatch, Scheduler
from sluice.engine.spec_decode import DraftProposer, NgramProposer, Proposer, load_draft
from sluice.engine.structured import GrammarError, StructuredOutputs
from sluice.engine.token_bytes import TokenBytes
from sluice.engine.tokenizer import load_tokenizer
from sluice.engine.verification import SpecStats, verify
from sluice.kernels import options


class RequestRejected(ValueError):
    """A request that can never run (too long, empty, duplicate id); the engine serves the rest."""


class Engine:
    """add_request / step / abort / has_unfinished over one model and one KV pool."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        options.configure(cpu_kernel=config.cpu_kernel, cpu_isa=config.cpu_isa, device_path=config.device_path)
        r = ResolvedConfig.resolve(config)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, None if config.tokenizer else r.hf_config)
        r = self.resolved = r.with_eos(self.tokenizer.eos_token_id)
        self.token_bytes = TokenBytes(self.tokenizer)
        self.model_config, self.device, self.dtype, self.kv_dtype = r.model, r.device, r.dtype, r.kv_dtype
        self.max_model_len, self.eos_token_ids = r.max_model_len, r.eos_token_ids
        hook = linear_hook(config, self.device, self.dtype, r.hf_config)
        self.model = load_model(config.model, self.dtype, self.device, self.max_model_len, hook, r.model,
                                config.weight_loading, config.huge_pages)
        num_blocks = pool_blocks(config, r.model, r.kv_dtype, r.device, r.max_model_len)
        self.kv_block_bytes = bytes_per_token(r.model, self.kv_dtype) * config.block_size
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.kv_dtype, self.device)
        if not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.processors = LogitsProcessors(self.model_config.vocab_size, self.device, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, SequenceGroup] = {}
        self._group_of: dict[str, SequenceGroup] = {}
        self._aborted: list[Request] = []
        self._pooling: str | None = None
        self.mm_processor: MultiModalProcessor | None = None
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "computed_tokens": 0}
        self.spec_stats = SpecStats()
        self.proposer = self._make_proposer()
        draft = getattr(getattr(self.proposer, "runner", None), "model", None)
        models = [m for m in (self.model, draft) if m is not None]
        if self.device.type == "cpu":
            for m in models:
                pack_4bit_for_cpu(m)  # at load: the 4-bit linears' bf16 absmax, bitsandbytes' state freed
            heap.trim()  # the load's freed originals (full-precision weights, 4-bit states) go back now
        # Huge pages for the weights (engine.weight_memory) once the first step has run: loading, the KV pool and
        # the first step's lazy set-up (a worker's warm-up, before it is ready) never share the cores with them.
        self._arenas = [m.weight_arena for m in models if hasattr(m, "weight_arena")]
        self._unsettled = list(self._arenas)

    def _make_proposer(self) -> Proposer | None:
        """The proposer the speculative config names, given only what it needs (never the engine)."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec, self.max_model_len)
        draft = load_draft(spec, self.config, self.model_config, self.tokenizer.get_vocab(), self.dtype, self.device,
                           self.max_model_len)
        blocks = BlockManager(self.num_blocks, self.config.block_size, enable_prefix_caching=False)
        runner = ModelRunner(draft, self.num_blocks, self.config.block_size, self.dtype, self.device)
        return DraftProposer(spec, self.max_model_len, runner, blocks, self.generator)

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (strings through the tokenizer)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def add_request(self, request_id: str, prompt: str | list[int] | list[str] | list[list[int]] | dict,
                    params: SamplingParams | PoolingParams | None = None) -> None:
        """Queue a request (PoolingParams: an embedding of each input; a dict: a prompt with
        multi_modal_data); raise RequestRejected if it can never run."""
        params = params or SamplingParams()
        if request_id in self.requests or request_id in self.groups:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        if isinstance(params, PoolingParams):
            self._add_embedding(request_id, prompt, params)
            return
        ids, mm = self._multimodal(prompt) if isinstance(prompt, dict) else (self.encode(prompt), None)
        self._validate(ids, params)
        if params.n == 1 and (params.best_of or 1) == 1:
            self._add(with_images(Request(request_id, ids, params), mm))
            return
        group = SequenceGroup.fan_out(request_id, ids, params)
        for seq in group.sequences:
            with_images(seq, mm)
            self._add(seq, schedule=seq is group.sequences[0])
            self._group_of[seq.request_id] = group
        self.groups[request_id] = group

    def _multimodal(self, prompt: dict) -> tuple[list[int], MultiModalInputs | None]:
        """Token ids (image placeholders expanded) and images of a prompt dict (engine.multimodal)."""
        try:
            text, images = split_prompt(prompt)
            if not images:
                return self.encode(text), None
            if not hasattr(self.model, "prepare_step"):
                raise MultiModalError(f"{self.model_config.architecture} takes no images (a text-only model)")
            if self.mm_processor is None:
                self.mm_processor = MultiModalProcessor(self.config.model, self.resolved.hf_config,
                                                        self.tokenizer)
            return self.mm_processor.process(text, images)
        except MultiModalError as exc:
            raise RequestRejected(str(exc)) from exc

    def _add_embedding(self, request_id: str, inputs: object, params: PoolingParams) -> None:
        """One PoolingRequest per input (several inputs come back merged into one EmbeddingOutput)."""
        if not can_pool(self.model):
            name = type(self.model).__name__
            raise RequestRejected(f"embeddings need the model's final hidden states, which {name} does not give")
        try:
            prompts = split_inputs(inputs)
            self._pooling = self._pooling or pooler_for(self.config.model, self.resolved.hf_config)
        except PoolingError as exc:
            raise RequestRejected(str(exc)) from exc
        seqs: list[Request] = []
        capacity = self.num_blocks * self.config.block_size
        for k, prompt in enumerate(prompts):
            ids = self.encode(prompt)
            problem = check_input(ids, self.model_config.vocab_size, self.max_model_len, capacity,
                                  self.model_config.hidden_size, params)
            if problem:
                raise RequestRejected(problem if len(prompts) == 1 else f"input {k}: {problem}")
            rid = request_id if len(prompts) == 1 else f"{request_id}#{k}"
            seqs.append(PoolingRequest(rid, ids, params, self._pooling))
        if len(seqs) > 1:
            self.groups[request_id] = group = EmbeddingGroup(request_id, seqs)
            self._group_of.update((seq.request_id, group) for seq in seqs)
        for seq in seqs:
            self._add(seq)

    def _add(self, req: Request, schedule: bool = True) -> None:
        if req.params.structured_outputs is not None:
            try:
                req.grammar = self._structured().matcher(req.params.structured_outputs)
            except GrammarError as exc:
                raise RequestRejected(str(exc)) from exc
        self.requests[req.request_id] = req
        if schedule:
            self.scheduler.add(req)

    def _structured(self) -> StructuredOutputs:
        """The grammar engine, started on the first structured request."""
        if self.processors.structured is None:
            # On CPU the forward owns the cores: xgrammar's fill threads would compete with it; one suffices, and
            # it fills during the forward only where a core is left over (else the forward's threads wait on it).
            cpu = self.device.type == "cpu"
            so = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids),
                                   1 if cpu else "auto")
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            so.overlap = not cpu or torch.get_num_threads() < cores
            self.processors.structured = so
        return self.processors.structured

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        n, limit = len(ids), self.max_model_len
        if n == 0:
            raise RequestRejected("empty prompt")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        if params.top_k > vocab:
            raise RequestRejected(f"top_k ({params.top_k}) must be <= the vocabulary size ({vocab}); 0 disables it")
        named = [*(params.logit_bias or {}), *params.stop_token_ids]
        if named and max(named) >= vocab:
            raise RequestRejected(f"token id {max(named)} in logit_bias/stop_token_ids is outside the vocabulary "
                                  f"[0, {vocab})")
        if params.seed is not None and not -(2**63) <= params.seed < 2**64:
            raise RequestRejected(f"seed ({params.seed}) must fit in 64 bits")
        need = n + (params.max_tokens or 1)
        if need > limit:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds max_model_len ({limit})"
            )
        capacity = self.num_blocks * self.config.block_size
        if need > capacity:
            raise RequestRejected(f"request needs {need} tokens of KV cache but the whole cache holds {capacity}")

    def abort(self, request_id: str) -> None:
        """Stop a request; its partial output comes back from the next step()."""
        group = self.groups.get(request_id)
        if group is not None:
            group.followers = []
            for seq in group.sequences:
                self.abort(seq.request_id)
            return
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        self.scheduler.finish(req, "abort")
        self._aborted.append(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs of the requests that finished in it."""
        done, self._aborted = self._aborted, []
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.proposer is not None:
            self._drop_unscheduled_speculation(batch)
        if batch.requests:
            for arena in self._arenas:
                arena.busy()  # its huge-page collapse paces itself while there is work (engine.weight_memory)
            done += self._run(batch)
        if not self.has_unfinished():  # drained
            if batch.requests and self.device.type == "cpu":
                heap.trim()  # the step's temporaries are gone, their pages go back to the OS
            for arena in self._arenas:
                arena.idle()
        return self._merge([self._output(r) for r in done])

    def _run(self, batch: ScheduledBatch) -> list[Request]:
        """Run the model over a scheduled batch; the requests it finished."""
        structured = self.processors.structured
        if structured is not None and structured.overlap:  # next tokens' grammar masks fill while the forward runs
            structured.fill_ahead(self._sampled_plainly(batch))
        step_logits = self.runner.run(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            req.num_computed_tokens += n
            self.counters["computed_tokens"] += n
        done = self._process(batch.requests, step_logits)
        self._start_followers()
        self.counters["steps"] += 1
        for arena in self._unsettled:
            arena.settle()
        self._unsettled = []
        return done

    @staticmethod
    def _sampled_plainly(batch: ScheduledBatch) -> list[Request]:
        """The requests this step will sample without speculation, in the order `_process` samples them."""
        return [r for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)
                if not isinstance(r, PoolingRequest) and not r.spec_token_ids
                and r.num_computed_tokens + n >= r.num_tokens]

    def _start_followers(self) -> None:
        """Queue (first in line) the other sequences of groups whose leader has computed the prompt."""
        for group in self.groups.values():
            if group.followers and group.leader_ready():
                for seq in reversed(group.followers):
                    self.scheduler.waiting.appendleft(seq)
                group.followers = []

    def _merge(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs of single requests as they are; a group's sequences as one output once all are done."""
        merged = []
        for out in outs:
            group = self._group_of.pop(out.request_id, None)
            if group is None:
                merged.append(out)
            elif (whole := group.finish(out)) is not None:
                self.groups.pop(group.request_id, None)
                merged.append(whole)
        return merged

    def _drop_unscheduled_speculation(self, batch) -> None:
        """Speculative tokens that did not fit this step's budget are dropped, not chunked."""
        scheduled = set(map(id, batch.requests))
        for req in self.scheduler.running:
            if req.spec_token_ids and id(req) not in scheduled:
                req.spec_token_ids, req.draft_state = [], None
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if req.spec_token_ids:
                keep = req.num_computed_tokens + n - req.num_tokens
                req.spec_token_ids = req.spec_token_ids[: max(0, keep)]
                if req.draft_state is not None:
                    req.draft_state = req.draft_state[: max(0, keep)] if keep > 0 else None

    def _process(self, reqs: list[Request], rows: StepLogits) -> list[Request]:
        """Sample for requests whose last known token was computed; finish those that are done."""
        pooled = [i for i, r in enumerate(reqs) if isinstance(r, PoolingRequest)]
        for req, start, count in zip(reqs, rows.row_start, rows.num_rows, strict=True):
            if req.want_prompt_logits and count and not isinstance(req, PoolingRequest):
                req.prompt_logits.append(rows.logits[start:start + count].float().cpu())
        ready = [i for i, r in enumerate(reqs) if r.num_computed_tokens >= r.num_tokens and i not in pooled]
        plain = [i for i in ready if not reqs[i].spec_token_ids]
        speculated = [i for i in ready if reqs[i].spec_token_ids]
        finished = self._pool(reqs, rows, pooled) if pooled else []
        if speculated:
            finished += self._verify(reqs, rows, speculated)
        if plain:
            finished += self._sample_plain(reqs, rows, plain)
        for req in reqs:
            if not req.is_finished:
                self.block_manager.cache_full_blocks(req)
        return finished

    def _pool(self, reqs: list[Request], rows: StepLogits, index: list[int]) -> list[Request]:
        """Pool embedding requests' hidden rows; finish those whose prompt is computed (no decode, KV freed now)."""
        finished = []
        counted = [i for i in index if rows.num_rows[i]]
        if counted:  # every request's rows summed in one op
            assert rows.hidden is not None
            sums = segment_sums(rows.hidden, [rows.row_start[i] for i in counted], [rows.num_rows[i] for i in counted])
            for total, i in zip(sums, counted, strict=True):
                reqs[i].accumulate(total, rows.first_pos[i])  # type: ignore[attr-defined]
        for i in index:
            req = reqs[i]
            assert isinstance(req, PoolingRequest)
            if req.num_computed_tokens >= req.num_tokens:
                self.block_manager.cache_full_blocks(req)  # its full blocks stay in the prefix cache once freed
                self.scheduler.finish(req, "stop")
                req.metrics.first_token_time = req.metrics.finish_time = time.monotonic()
                finished.append(req)
        return finished

    def _verify(self, reqs: list[Request], rows: StepLogits, index: list[int]) -> list[Request]:
        """Verify each listed request's proposals, append what is emitted, roll back the rejected slots."""
        finished: list[Request] = []
        step_logits = [rows.logits[rows.row_start[i]: rows.row_start[i] + rows.num_rows[i]] for i in index]
        processed_all = self._processed_verify_rows(reqs, index, step_logits)
        emitted_all = verify([reqs[i] for i in index], processed_all, self.generator)
        for i, logits, processed, emitted in zip(index, step_logits, processed_all, emitted_all, strict=True):
            req = reqs[i]
            accepted = len(emitted) - 1
            self.spec_stats.record(req, len(req.spec_token_ids), accepted)
            base = req.num_tokens
            req.spec_token_ids, req.draft_state = [], None
            lps = self.logprobs_for(logits[: len(emitted)], processed[: len(emitted)], emitted, req)
            if self.append_tokens(req, emitted, lps):
                finished.append(req)
            else:
                req.num_computed_tokens = base + accepted
                self.block_manager.trim(req, req.num_tokens)
        return finished

    def _processed_verify_rows(self, reqs: list[Request], index: list[int],
                               step_logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """The verify rows with logits processing applied, each row seeing the proposals before it."""
        if not any(reqs[i].params.processed for i in index):
            return step_logits
        row_reqs = [reqs[i] for i, lg in zip(index, step_logits, strict=True) for _ in range(lg.shape[0])]
        ahead = [j for lg in step_logits for j in range(lg.shape[0])]
        processed = self.processors.apply(torch.cat(step_logits), row_reqs, ahead)
        return list(processed.split([lg.shape[0] for lg in step_logits]))

    def _sample_plain(self, reqs: list[Request], rows: StepLogits, ready: list[int]) -> list[Request]:
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
                     req: Request) -> list | None:
        """Logprobs of emitted tokens from the rows that produced them (raw and processed), if the request asked."""
        if req.params.logprobs is None:
            return None
        return self._logprobs(logits, processed, torch.tensor(tokens, device=logits.device), [req] * len(tokens))

    def _logprobs(self, logits, processed, tokens, reqs) -> list[dict[int, float]] | None:
        """Per row, the sampled token's and the top-n values that `logprobs_mode` names (raw: the model's logits)."""
        wanted = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
        if not wanted:
            return None
        mode = self.config.logprobs_mode
        source = processed_logits(processed, reqs) if mode.startswith("processed") else logits
        return top_logprobs(source, tokens, max(wanted), normalize=mode.endswith("logprobs"))

    def append_tokens(self, req: Request, tokens: list[int], logprobs: list | None) -> bool:
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
            reason = self._stop_reason(req, tok)
            if reason:
                self.scheduler.finish(req, reason)
                req.metrics.finish_time = now
                return True
        return False

    def _stop_reason(self, req: Request, tok: int) -> str | None:
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
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        longest = max(len(s) for s in req.params.stop)
        lo = max(0, req.stop_text_len - longest + 1)
        hits = [i for i in (text.find(s, lo) for s in req.params.stop) if i >= 0]
        req.stop_text_len = len(text)
        if hits:
            req.text = text[: min(hits)]
        return bool(hits)

    def _output(self, req: Request) -> RequestOutput | EmbeddingOutput:
        self.requests.pop(req.request_id, None)
        self.processors.release(req)
        if self.proposer is not None:
            self.proposer.release(req)
        if req.metrics.finish_time is None:
            req.metrics.finish_time = time.monotonic()
        req.metrics.num_cached_tokens = req.num_cached_tokens
        if isinstance(req, PoolingRequest):
            self.counters["prompt_tokens"] += len(req.prompt_token_ids)
            return embedding_output(req)
        text = req.text
        if text is None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True).rstrip("\ufffd")
        prompt_logits = torch.cat(req.prompt_logits) if req.prompt_logits else None
        group = self._group_of.get(req.request_id)
        if group is None or req is group.sequences[0]:
            self.counters["prompt_tokens"] += len(req.prompt_token_ids)
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
            prompt_logits=prompt_logits,
        )

    def _token_bytes(self, req: Request) -> dict[int, bytes] | None:
        """Bytes of the output tokens and of every token named in their logprobs, when logprobs were asked."""
        if req.logprobs is None:
            return None
        return self.token_bytes.many([*req.output_token_ids, *(t for step in req.logprobs for t in step)])

    def stats(self) -> dict:
        """KV blocks used/total, prefix-cache hit rate, queue sizes, token counters."""
        bm, running = self.block_manager, self.scheduler.running
        allocated = sum(len(r.block_table) for r in running) * self.config.block_size
        held = sum(min(r.num_computed_tokens, r.num_tokens) for r in running)
        out = {
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_block_size": self.config.block_size,
            "kv_utilization": held / allocated if allocated else 1.0,
            "prefix_cache_hit_rate": bm.hit_rate,
            "num_running": len(running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            **self.counters,
        }
        if self.proposer is not None:
            out.update(self.spec_stats.as_dict())
        if hasattr(self.model, "encoder_cache"):
            out.update(self.model.encoder_cache.stats())
        return out
