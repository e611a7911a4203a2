"""Build the flat batch of one step (ids, positions, slots, block tables) and run the model once."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from sluice import kernels
from sluice.engine import kv_cache
from sluice.engine.models.llama import LlamaModel
from sluice.engine.pooling import PoolingRequest, logits_and_hidden
from sluice.engine.request import Request
from sluice.engine.scheduler import ScheduledBatch
from sluice.kernels import dispatch
from sluice.kernels.flat_metadata import StepBuffers


@dataclass(slots=True)
class StepLogits:
    """Logits of one step and, per scheduled request, its rows and the position of its first row."""

    logits: torch.Tensor
    row_start: list[int]
    num_rows: list[int]
    first_pos: list[int]
    # final hidden states of pooling requests' rows (their row_start's rows)
    hidden: torch.Tensor | None = None


class ModelRunner:
    """Runs the model over the KV pool (engine.kv_cache's layer caches); turns a ScheduledBatch into
    logits."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, lora=None) -> None:
        c = model.config
        self.model, self.block_size, self.device = model, block_size, device
        dtype = model.embed_tokens.weight.dtype
        # the flat layout on every device where the model asks for it (the generic path's windowed layers)
        self.plan = dispatch.plan(device, dtype, kv_dtype, getattr(model, "needs_flat_metadata", False))
        self.kv_caches = kv_cache.layer_caches(c, num_blocks, block_size, kv_dtype, dtype, device,
                                               self.plan.flat)
        self.graphs = None
        self.buffers: StepBuffers | None = None
        self.lora = lora  # engine.lora.LoRAManager: maps each step's tokens to their adapters' slots

    def _step_buffers(self, tokens: int, seqs: int, width: int) -> StepBuffers:
        """The device path's persistent step inputs, regrown (doubling) only when a step outgrows them."""
        b = self.buffers
        if b is None or tokens > b.host["input_ids"].shape[0] or seqs > b.max_seqs \
                or width > b.host["block_tables"].shape[1]:
            grow = (lambda need, have: max(need, 2 * have)) if b is not None else (lambda need, have: need)
            old = (0, 0, 0) if b is None else (b.host["input_ids"].shape[0], b.max_seqs,
                                               b.host["block_tables"].shape[1])
            self.buffers = StepBuffers(grow(max(tokens, 256), old[0]), grow(max(seqs, 8), old[1]),
                                       grow(max(width, 16), old[2]), self.device)
        return self.buffers

    @torch.inference_mode()
    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Replay pure-decode steps from CUDA graphs (CUDA device path only; CPU never captures)."""
        if self.device.type == "cuda" and self.plan.flat and getattr(self.model, "cuda_graphs", True):
            from sluice.engine.cuda_graphs import DecodeGraphs

            try:
                self.graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs,
                                           -(-max_model_len // self.block_size) + 1, self.device)
            except RuntimeError as e:  # a layer that cannot be captured (e.g. some bitsandbytes kernels)
                warnings.warn(f"decode steps run eagerly: CUDA graph capture failed ({e})", stacklevel=2)

    def _rows(self, req: Request, start: int, n: int) -> tuple[int, int]:
        """First position and count of the positions whose logits (pooling: hidden states) this step must
        return."""
        if isinstance(req, PoolingRequest):
            return req.pool_rows(start, n)
        if req.want_prompt_logits:
            return start, n
        first = max(start, req.num_tokens - 1)
        return first, max(0, start + n - first)

    def _layout(self, batch: ScheduledBatch, rows: StepLogits) -> tuple[list[int], ...]:
        """The flat step: (ids, positions, slots, context lens, logits index, pooled-hidden index); rows
        filled in."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        logit_idx: list[int] = []
        hidden_idx: list[int] = []
        bs = self.block_size
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            offset = len(ids)
            ids += req.tokens_slice(start, start + n)
            pos = range(start, start + n)
            positions += pos
            slots += kv_cache.slots(req.block_table, pos, bs)
            context_lens.append(start + n)
            first, count = self._rows(req, start, n)
            wanted = hidden_idx if isinstance(req, PoolingRequest) else logit_idx
            rows.row_start.append(len(wanted))
            rows.num_rows.append(count)
            rows.first_pos.append(first)
            wanted += range(offset + first - start, offset + first - start + count)
        return ids, positions, slots, context_lens, logit_idx, hidden_idx

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepLogits:
        """One forward pass over every scheduled request's new tokens."""
        rows = StepLogits(None, [], [], [])  # type: ignore[arg-type]
        if hasattr(self.model, "prepare_step"):  # vision-language models: image embeddings, M-RoPE positions
            self.model.prepare_step(batch)
        ids, positions, slots, context_lens, logit_idx, hidden_idx = self._layout(batch, rows)
        tables = [r.block_table for r in batch.requests]
        adapters = self._map_adapters(batch)
        if hidden_idx:
            return self._run_pooled(rows, (ids, positions, slots, context_lens, tables), logit_idx,
                                    hidden_idx, batch.num_new_tokens, adapters)
        if self.graphs is not None and not adapters and self.graphs.fits(batch.num_new_tokens):
            rows.logits = self.graphs.run(ids, positions, slots, context_lens, tables)
            return rows
        if self.plan.flat:
            buffers = self._step_buffers(len(ids), len(tables), max(len(t) for t in tables))
            inputs = buffers.load(ids, positions, slots, logit_idx, batch.num_new_tokens, context_lens,
                                  tables, self.model.config.num_kv_heads)
            rows.logits = self.model(*inputs[:2], self.kv_caches, *inputs[2:], plan=self.plan)
            return rows
        rows.logits = self._run_paged(ids, positions, slots, logit_idx, batch.num_new_tokens, context_lens,
                                      tables)
        return rows

    def _map_adapters(self, batch: ScheduledBatch) -> bool:
        """Set the coming forward's token-to-adapter mapping; whether any adapter runs in it (CUDA graphs run
        the base model only; the decode stack's LoRA linears read the mapping)."""
        if self.lora is None:
            return False
        self.lora.prepare_step([r.lora_request for r in batch.requests], batch.num_new_tokens)
        return self.lora.slots.active

    def _run_paged(self, ids, positions, slots, logit_idx, query_lens, context_lens, tables) -> torch.Tensor:
        """Logits of a step over AttentionMetadata, built as the step plan asks (the fused kernel's
        arguments)."""
        dev = self.device
        # ids, positions and slots in one host-to-tensor copy; no logits index where every row is wanted
        # (decode)
        flat = torch.tensor([ids, positions, slots], dtype=torch.long, device=dev)
        meta = kernels.build_metadata(query_lens, context_lens, tables, flat[2], self.block_size, dev,
                                      fused=self.plan.fused_attention, fused_prefill=self.plan.fused_prefill)
        every_row = len(logit_idx) == len(ids) and logit_idx == list(range(len(ids)))
        return self.model(flat[0], flat[1], self.kv_caches, meta,
                          None if every_row else torch.tensor(logit_idx, dtype=torch.long, device=dev),
                          plan=self.plan.for_step(flat[0], meta))

    def _run_pooled(self, rows: StepLogits, step: tuple, logit_idx: list[int], hidden_idx: list[int],
                    query_lens: list[int], adapters: bool = False) -> StepLogits:
        """A step with pooling requests: final hidden states of both row sets, the LM head only over the
        sampled ones (never a CUDA graph: those replay pure decode)."""
        ids, positions, slots, context_lens, tables = step
        wanted = logit_idx + hidden_idx
        if self.plan.flat:
            buffers = self._step_buffers(len(ids), len(tables), max(len(t) for t in tables))
            inputs = buffers.load(ids, positions, slots, wanted, query_lens, context_lens, tables,
                                  self.model.config.num_kv_heads)
            args, plan = (*inputs[:2], self.kv_caches, *inputs[2:]), self.plan
        else:
            flat = torch.tensor([ids, positions, slots], dtype=torch.long, device=self.device)
            meta = kernels.build_metadata(query_lens, context_lens, tables, flat[2], self.block_size,
                                          self.device, fused=self.plan.fused_attention,
                                          fused_prefill=self.plan.fused_prefill)
            index = torch.tensor(wanted, dtype=torch.long, device=self.device)
            args = (flat[0], flat[1], self.kv_caches, meta, index)
            plan = self.plan if adapters else self.plan.for_step(flat[0], meta)
        rows.logits, rows.hidden = logits_and_hidden(self.model, args, len(logit_idx), plan)
        return rows
