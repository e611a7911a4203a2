"""Adapters for one engine: the known ones, an LRU of `max_cpu_loras` loaded in host memory (loaded on a
thread, off the step's path), `max_loras` slots in working memory, and each step's mapping of tokens to
slots."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from torch import nn

from sluice.engine.lora.adapter import LoRAAdapter, LoRAError, check_base, check_config, read_adapter
from sluice.engine.lora.lora_request import LoRARequest
from sluice.engine.lora.slots import LoRALinear, LoRASlots, projection_shapes

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class LoRAManager:
    """Loads adapters, keeps the LRU and the slots, and maps each step's requests onto slots."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        c = model.config
        if getattr(c, "path", "native") != "native" or c.moe_layers:
            raise ValueError("LoRA adapters are served on dense natively supported architectures "
                             f"(not {c.architecture})")
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.num_layers, self.shapes = c.num_layers, projection_shapes(c)
        weight = model.embed_tokens.weight
        self.slots = LoRASlots(max_loras, max_lora_rank, self.shapes, c.num_layers, weight.dtype,
                               weight.device)
        self.device = weight.device
        for i, layer in enumerate(model.layers):
            for proj in PROJECTIONS:
                parent, name = _parent(layer, proj)
                setattr(parent, name, LoRALinear(getattr(parent, name), self.slots, i, proj))
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # host LRU, by lora_int_id
        self.loading: dict[int, Future] = {}
        self.failed: dict[int, str] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.known: dict[int, LoRARequest] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-lora")

    def add(self, lora: LoRARequest) -> None:
        """Know an adapter and start loading it; LoRAError where it can never run (checked now: its
        config)."""
        known = self.known.get(lora.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
            raise LoRAError(f"adapter {lora.lora_name!r}: lora_int_id {lora.lora_int_id} already names "
                            f"adapter {known.lora_name!r} ({known.lora_path})")
        if lora.lora_int_id in self.failed:
            raise LoRAError(self.failed[lora.lora_int_id])
        if known is None:
            check_config(lora.lora_name, lora.lora_path, self.max_rank)
        self.known[lora.lora_int_id] = lora
        with self._lock:
            if lora.lora_int_id in self.loaded:
                self.loaded.move_to_end(lora.lora_int_id)
                return
            if lora.lora_int_id not in self.loading:
                self.loading[lora.lora_int_id] = self._pool.submit(self._load, lora)

    def _load(self, lora: LoRARequest) -> None:
        try:
            adapter = read_adapter(lora.lora_name, lora.lora_path, self.max_rank)
            check_base(adapter, self.num_layers, self.shapes)
        except LoRAError as exc:
            with self._lock:
                self.failed[lora.lora_int_id] = str(exc)
                self.loading.pop(lora.lora_int_id, None)
            return
        with self._lock:
            self.loaded[lora.lora_int_id] = adapter
            self.loading.pop(lora.lora_int_id, None)

    def wait(self, lora: LoRARequest) -> None:
        """Block until the adapter is loaded (LoRAError if it failed)."""
        future = self.loading.get(lora.lora_int_id)
        if future is not None:
            future.result()
        if lora.lora_int_id in self.failed:
            raise LoRAError(self.failed[lora.lora_int_id])

    def error(self, lora: LoRARequest) -> str | None:
        """Why the adapter cannot run, once its load failed."""
        return self.failed.get(lora.lora_int_id)

    def failed_requests(self, waiting) -> list:
        """The waiting requests whose adapter failed to load, each given that error."""
        failed = [r for r in waiting if r.lora_request is not None
                  and r.lora_request.lora_int_id in self.failed]
        for req in failed:
            req.error = self.failed[req.lora_request.lora_int_id]
        return failed

    def ready(self, lora: LoRARequest) -> bool:
        """Loaded in host memory (a slot is found at schedule time)."""
        return lora.lora_int_id in self.loaded

    def can_run(self, lora: LoRARequest, in_step: set[int]) -> bool:
        """Whether a request with this adapter may join a step whose adapters are `in_step`: loaded, and a
        slot is free or already holds it."""
        if not self.ready(lora):
            if lora.lora_int_id not in self.loading and lora.lora_int_id not in self.failed:
                self.add(lora)  # evicted from host memory while it waited: load it again
            return False
        return lora.lora_int_id in in_step or len(in_step) < self.max_loras

    def prepare_step(self, loras: list[LoRARequest | None], num_tokens: list[int]) -> None:
        """Give every adapter of the step a slot (evicting the least recently used others) and set the mapping
        of the coming forward: each request's tokens to its adapter's slot."""
        wanted = {lora.lora_int_id: lora for lora in loras if lora is not None}
        assert len(wanted) <= self.max_loras, "more adapters in one step than slots"
        for lid, lora in wanted.items():
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
                continue
            if lid not in self.loaded:  # a running request's adapter, dropped from host memory meanwhile
                self._load(lora)
            with self._lock:
                adapter = self.loaded[lid]
                self.loaded.move_to_end(lid)
            slot = self._free_slot(set(wanted))
            self.slots.load(slot, adapter)
            self.slot_of[lid] = slot
        if len(self.loaded) > self.max_cpu_loras:
            self._evict_host()
        token_slots: list[int] = []
        for lora, n in zip(loras, num_tokens, strict=True):
            token_slots += [-1 if lora is None else self.slot_of[lora.lora_int_id]] * n
        self.slots.set_step(token_slots if wanted else None, self.device)

    def _free_slot(self, keep: set[int]) -> int:
        used = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(lid for lid in self.slot_of if lid not in keep)
        return self.slot_of.pop(victim)

    def _evict_host(self) -> None:
        """Keep at most max_cpu_loras adapters in host memory, never one that holds a slot (on the step's
        thread, between steps)."""
        with self._lock:
            candidates = list(self.loaded)
        for lid in candidates:
            if len(self.loaded) <= self.max_cpu_loras:
                break
            if lid not in self.slot_of:
                with self._lock:
                    del self.loaded[lid]

    def stats(self) -> dict[str, int]:
        return {"lora_loaded": len(self.loaded), "lora_slots_used": len(self.slot_of),
                "lora_known": len(self.known)}


def _parent(layer: nn.Module, proj: str) -> tuple[nn.Module, str]:
    block, name = proj.split(".")
    return getattr(layer, block), name


def salt(lora: LoRARequest | None, other: int | None = None) -> int | None:
    """The prefix cache's chain seed for a request: blocks computed under one adapter never serve another
    (`other`: a seed the request has already, its images')."""
    if lora is None:
        return other
    return hash(("lora", lora.lora_int_id, lora.lora_path, other))


__all__ = ["LoRAManager", "LoRAError", "LoRARequest", "salt"]
