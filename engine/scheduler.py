"""One rule: each step hands out a token budget so num_computed_tokens catches up with the target."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import EngineConfig
from sluice.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    """The requests of one step and how many new tokens each computes."""

    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Running requests first, then waiting ones; chunk what does not fit; preempt the newest."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, lora=None) -> None:
        self.config = config
        self.block_manager = block_manager
        # engine.lora.LoRAManager: a request joins only once its adapter is loaded and has a slot
        self.lora = lora
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's requests and token counts, allocating KV blocks for them."""
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_target_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            if not self._make_room(req, n, batch):
                continue
            self.block_manager.allocate(req, n)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _make_room(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        """Preempt the newest running requests until `req` fits; False if `req` itself went."""
        while not self.block_manager.can_allocate(self.block_manager.blocks_needed(req, n)):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        if not self.waiting:
            return
        held: list[Request] = []  # waiting on their adapter: they keep their place in line
        adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.lora_request is not None and not self.lora.can_run(req.lora_request, adapters):
                held.append(self.waiting.popleft())
                continue
            if not req.block_table and not req.want_prompt_logits:
                cached = self.block_manager.match_prefix(req)
                req.num_computed_tokens = cached
                req.num_cached_tokens = max(req.num_cached_tokens, cached)
            n = min(req.num_target_tokens - req.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(self.block_manager.blocks_needed(req, n)):
                # the prefix blocks it matched go back (they stay cached): held while it waits, they could be
                # the blocks the running requests need, and nothing would ever finish
                self.block_manager.free(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.block_manager.allocate(req, n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            if req.lora_request is not None:
                adapters.add(req.lora_request.lora_int_id)
        self.waiting.extendleft(reversed(held))

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        """Free the request's blocks and requeue it at the front to recompute later."""
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.preempted.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished and release its blocks."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
