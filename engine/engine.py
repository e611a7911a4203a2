"""The step loop: schedule, run the model once, process its outputs (sample / verify / pool), finish."""

from __future__ import annotations

import torch

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import EngineConfig
from sluice.engine.groups import Groups
from sluice.engine.housekeeping import MemoryHousekeeping
from sluice.engine.json_schema import JsonBounds
from sluice.engine.kv_cache import bytes_per_token, pool_blocks
from sluice.engine.logits_processors import LogitsProcessors
from sluice.engine.lora import LoRAError, LoRAManager, LoRARequest
from sluice.engine.lora.manager import salt
from sluice.engine.model_runner import ModelRunner
from sluice.engine.models.loader import load_model
from sluice.engine.output_processor import OutputProcessor
from sluice.engine.outputs import EmbeddingOutput, RequestOutput
from sluice.engine.pooling import PoolingParams
from sluice.engine.quantization import linear_hook
from sluice.engine.request import Request
from sluice.engine.request_intake import RequestIntake, RequestRejected
from sluice.engine.resolved import ResolvedConfig
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import ScheduledBatch, Scheduler
from sluice.engine.spec_decode import DraftProposer, NgramProposer, Proposer, load_draft
from sluice.engine.tokenizer import load_tokenizer
from sluice.engine.weight_reserve import WeightReservation
from sluice.kernels import options

__all__ = ["Engine", "RequestRejected"]


class Engine:
    """add_request / step / abort / has_unfinished over one model and one KV pool."""

    def __init__(self, config: EngineConfig, weight_reservation: WeightReservation | None = None) -> None:
        self.config = config
        self.kernel_options = options.defaults().merged(cpu_kernel=config.cpu_kernel, cpu_isa=config.cpu_isa,
                                                        device_path=config.device_path,
                                                        packed_weights=config.packed_weights)
        with options.active(self.kernel_options):
            self._load(config, weight_reservation)
            self._assemble(config)

    def _load(self, config: EngineConfig, weight_reservation: WeightReservation | None) -> None:
        """The tokenizer, the model (into the reserved arena where it fits), the KV pool and its runner."""
        r = ResolvedConfig.resolve(config)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model,
                                        None if config.tokenizer else r.hf_config)
        r = self.resolved = r.with_eos(self.tokenizer.eos_token_id)
        self.model_config, self.device, self.dtype, self.kv_dtype = r.model, r.device, r.dtype, r.kv_dtype
        self.max_model_len, self.eos_token_ids = r.max_model_len, r.eos_token_ids
        hook = linear_hook(config, self.device, self.dtype, r.hf_config)
        self.model = load_model(config.model, self.dtype, self.device, self.max_model_len, hook, r.model,
                                config.weight_loading, config.huge_pages, weight_reservation,
                                r.hf_config)
        num_blocks = pool_blocks(config, r.model, r.kv_dtype, r.device, r.max_model_len)
        self.kv_block_bytes = bytes_per_token(r.model, self.kv_dtype) * config.block_size
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank,
                                config.max_cpu_loras or config.max_loras) if config.enable_lora else None
        self.scheduler = Scheduler(config, self.block_manager, self.lora)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.kv_dtype, self.device,
                                  self.lora)
        if not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)

    def _assemble(self, config: EngineConfig) -> None:
        """What a step needs around the model: intake, output processing, speculation, housekeeping."""
        self.generator = torch.Generator().manual_seed(config.seed)
        self.processors = LogitsProcessors(self.model_config.vocab_size, self.device, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.groups = Groups()
        self._aborted: list[Request] = []
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "computed_tokens": 0}
        r = self.resolved
        bounds = JsonBounds(config.json_max_number_digits, config.json_max_string_chars)
        self.intake = RequestIntake(self.tokenizer, self.model, r.model, config.model, r.hf_config,
                                    self.max_model_len, self.num_blocks * config.block_size, self.processors,
                                    self.device, bounds)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                       config.logprobs_mode, self.scheduler, self.block_manager,
                                       self.processors, self.generator, self.groups, self.counters)
        self.proposer = self._make_proposer()
        draft = getattr(getattr(self.proposer, "runner", None), "model", None)
        self.memory = MemoryHousekeeping([m for m in (self.model, draft) if m is not None], self.device)

    def _make_proposer(self) -> Proposer | None:
        """The proposer the speculative config names, given only what it needs (never the engine)."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec, self.max_model_len)
        draft = load_draft(spec, self.config, self.model_config, self.tokenizer.get_vocab(), self.dtype,
                           self.device, self.max_model_len)
        blocks = BlockManager(self.num_blocks, self.config.block_size, enable_prefix_caching=False)
        runner = ModelRunner(draft, self.num_blocks, self.config.block_size, self.dtype, self.device)
        return DraftProposer(spec, self.max_model_len, runner, blocks, self.generator)

    @property
    def num_blocks(self) -> int:
        """KV blocks in the pool."""
        return self.block_manager.num_blocks

    @property
    def spec_stats(self):
        """Proposed and accepted speculative tokens so far (engine.verification.SpecStats)."""
        return self.outputs.verifier.stats

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (strings through the tokenizer)."""
        return self.intake.encode(prompt)

    def add_request(self, request_id: str, prompt: str | list[int] | list[str] | list[list[int]] | dict,
                    params: SamplingParams | PoolingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request (PoolingParams: an embedding of each input; a dict: a prompt with multi_modal_data;
        lora_request: the adapter it runs with); raise RequestRejected if it can never run."""
        if request_id in self.requests or request_id in self.groups:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        self._admit_adapter(lora_request, params)
        seqs, group = self.intake.requests(request_id, prompt, params or SamplingParams())
        if group is not None:
            self.groups.add(group)
        for seq in seqs:
            seq.lora_request, seq.cache_salt = lora_request, salt(lora_request, seq.cache_salt)
            self.requests[seq.request_id] = seq
            if group is None or seq not in group.followers:  # followers start once the prompt is computed
                self.scheduler.add(seq)

    def _admit_adapter(self, lora: LoRARequest | None, params: object) -> None:
        """Know the request's adapter and start loading it; RequestRejected where it can never run."""
        if lora is None:
            return
        if self.lora is None:
            raise RequestRejected(
                f"adapter {lora.lora_name!r}: this engine serves no LoRA adapters (enable_lora)")
        if isinstance(params, PoolingParams):
            raise RequestRejected("embedding requests run on the base model: LoRA adapters serve generation")
        try:
            self.lora.add(lora)
        except LoRAError as exc:
            raise RequestRejected(str(exc)) from exc

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
        """Whether any request is waiting, running or has an abort to report."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def step(self) -> list[RequestOutput | EmbeddingOutput]:
        """Run one iteration; return outputs of the requests that finished in it."""
        if self.lora is not None and self.lora.failed:  # adapters that failed to load: their requests end
            for req in self.lora.failed_requests(self.scheduler.waiting):
                self.scheduler.finish(req, "error")
                self._aborted.append(req)
        done, self._aborted = self._aborted, []
        with options.active(self.kernel_options):
            batch = self._schedule()
            with self.memory.step(bool(batch.requests), drained=lambda: not self.has_unfinished()):
                if batch.requests:
                    done += self._run(batch)
            return self._finish(done)

    def _schedule(self) -> ScheduledBatch:
        """This step's batch, with speculative tokens proposed for it (those it has no room for dropped)."""
        if self.proposer is None:
            return self.scheduler.schedule()
        self.proposer.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        self.proposer.fit(batch, self.scheduler.running)
        return batch

    def _run(self, batch: ScheduledBatch) -> list[Request]:
        """Run the model over a scheduled batch and process its outputs; the requests it finished."""
        structured = self.processors.structured
        # next tokens' grammar masks fill while the forward runs
        if structured is not None and structured.overlap:
            structured.fill_ahead(self.outputs.sampled_plainly(batch.requests, batch.num_new_tokens))
        step_logits = self.runner.run(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            req.num_computed_tokens += n
            self.counters["computed_tokens"] += n
        done = self.outputs.process(batch.requests, step_logits)
        self.groups.start_followers(self.scheduler.waiting)
        self.counters["steps"] += 1
        return done

    def _finish(self, done: list[Request]) -> list[RequestOutput | EmbeddingOutput]:
        """Forget the finished requests; their outputs (a group's merged once all its sequences are done)."""
        for req in done:
            self.requests.pop(req.request_id, None)
            self.processors.release(req)
            if self.proposer is not None:
                self.proposer.release(req)
        return self.groups.merge([self.outputs.output(r) for r in done])

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
        if hasattr(self.model, "encoder_cache"):  # a vision-language model's images encoded and reused
            out.update(self.model.encoder_cache.stats())
        return out
