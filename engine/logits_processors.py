"""Logits processing before sampling: min_tokens, logit_bias, presence/frequency/repetition penalties, then
the grammar mask of structured outputs.

Each is one batched tensor op over the rows that need it. Per-request output-token counts live on the device
and are brought up to date, once per step, by one scatter of the tokens each request emitted since its last
one: they derive from the request's output tokens, so preemption (which keeps them) and speculative
rollback (which never appends rejected tokens) leave them right. A speculative verify row also counts the
proposals before it (`ahead`)."""

from __future__ import annotations

import torch

from sluice.engine.request import Request
from sluice.engine.sampler import device_tensor, fused_sample, sample
from sluice.engine.structured import StructuredOutputManager


class TokenCounts:
    """Output-token counts [slots, vocab] and prompt presence of the requests that use penalties."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.slots: dict[str, int] = {}
        self.counted: dict[str, int] = {}
        self.free: list[int] = []

    def _grow(self) -> None:
        cap = self.counts.shape[0]
        new = max(8, 2 * cap)
        counts = torch.zeros(new, self.vocab, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(new, self.vocab, dtype=torch.bool, device=self.device)
        counts[:cap], prompt[:cap] = self.counts, self.prompt
        self.counts, self.prompt = counts, prompt
        self.free.extend(range(new - 1, cap - 1, -1))

    def _slot(self, req: Request) -> int:
        slot = self.slots.get(req.request_id)
        if slot is not None:
            return slot
        if not self.free:
            self._grow()
        slot = self.slots[req.request_id] = self.free.pop()
        self.counts[slot].zero_()
        self.prompt[slot].zero_()
        self.counted[req.request_id] = 0
        if req.params.repetition_penalty != 1:
            self.prompt[slot].index_fill_(0, device_tensor(req.prompt_token_ids, torch.int64, self.device),
                                          True)
        return slot

    def sync(self, reqs: list[Request]) -> dict[str, int]:
        """Add each request's tokens emitted since its last sync (one scatter); its slot by request id."""
        rows: list[int] = []
        toks: list[int] = []
        for req in {r.request_id: r for r in reqs}.values():
            slot, done = self._slot(req), self.counted[req.request_id]
            new = req.output_token_ids[done:]
            rows += [slot] * len(new)
            toks += new
            self.counted[req.request_id] = len(req.output_token_ids)
        if toks:
            index = (device_tensor(rows, torch.int64, self.device),
                     device_tensor(toks, torch.int64, self.device))
            self.counts.index_put_(index, torch.ones(len(toks), dtype=torch.int32, device=self.device),
                                   accumulate=True)
        return {r.request_id: self.slots[r.request_id] for r in reqs}

    def release(self, req: Request) -> None:
        """Give the request's slot back."""
        slot = self.slots.pop(req.request_id, None)
        if slot is not None:
            self.free.append(slot)
            self.counted.pop(req.request_id, None)


class LogitsProcessors:
    """min_tokens, logit_bias and penalties for a batch of rows, each as one op over the rows that use it."""

    def __init__(self, vocab: int, device: torch.device, eos_token_ids: set[int] | list[int]) -> None:
        self.vocab, self.device = vocab, device
        self.eos_token_ids = sorted(eos_token_ids)
        self.counts = TokenCounts(vocab, device)
        self.structured: StructuredOutputManager | None = None

    def apply(self, logits: torch.Tensor, reqs: list[Request], ahead: list[int] | None = None,
              grammar: bool = True) -> torch.Tensor:
        """Processed float32 logits (a copy) for rows of `reqs`; `ahead[i]`: proposals before row i; `grammar`
        False leaves the grammar's mask out. The logits themselves where nothing applies."""
        rows = [i for i, r in enumerate(reqs) if r.params.adjusted]
        masked = grammar and self._constrained(reqs)
        if not rows and not masked:
            return logits
        out = logits.to(torch.float32, copy=True)
        self._min_tokens(out, reqs, ahead or [0] * len(reqs), rows)
        self._logit_bias(out, reqs, rows)
        self._penalties(out, reqs, ahead or [0] * len(reqs), [i for i in rows if reqs[i].params.penalized])
        if masked:
            self.structured.apply(out, reqs, ahead)
        return out

    def sample(self, logits: torch.Tensor, reqs: list[Request],
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A token per row of `reqs` (each samples its next token) and the processed logits it was drawn from:
        by the C++ sampler, which takes the grammar's bitmask as it is (then None: no row may ask for
        logprobs), or by `apply` and the torch sampler."""
        if any(r.params.logprobs is not None for r in reqs):
            processed = self.apply(logits, reqs)
            return sample(processed, reqs, generator), processed
        out = self.apply(logits, reqs, grammar=False)
        mask = None
        if self._constrained(reqs):
            mask = self.structured.fill(reqs, None)
        tokens = fused_sample(out, reqs, generator, mask, self.vocab)
        if tokens is not None:
            return tokens, None
        if mask is not None:
            out = logits.to(torch.float32, copy=True) if out is logits else out
            self.structured.apply_bitmask(out, *mask)
        return sample(out, reqs, generator), out

    def _constrained(self, reqs: list[Request]) -> bool:
        """Whether any row of `reqs` samples under a grammar."""
        return self.structured is not None and any(r.grammar is not None for r in reqs)

    def release(self, req: Request) -> None:
        """Forget a finished request."""
        self.counts.release(req)

    def _index(self, values: list[int]) -> torch.Tensor:
        return device_tensor(values, torch.int64, self.device)

    def _min_tokens(self, out: torch.Tensor, reqs: list[Request], ahead: list[int], rows: list[int]) -> None:
        pairs = [(i, t) for i in rows if len(reqs[i].output_token_ids) + ahead[i] < reqs[i].params.min_tokens
                 # a grammar decides its own end
                 and reqs[i].grammar is None for t in self._stop_ids(reqs[i])]
        if pairs:
            r, t = zip(*pairs, strict=True)
            out.index_put_((self._index(list(r)), self._index(list(t))),
                           torch.tensor(float("-inf"), device=out.device))

    def _stop_ids(self, req: Request) -> list[int]:
        p = req.params
        return [t for t in {*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)}
                if t < self.vocab]

    def _logit_bias(self, out: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
        triples = [(i, t, v) for i in rows for t, v in (reqs[i].params.logit_bias or {}).items()]
        if triples:
            r, t, v = zip(*triples, strict=True)
            values = device_tensor(list(v), torch.float32, self.device)
            out.index_put_((self._index(list(r)), self._index(list(t))), values, accumulate=True)

    def _penalties(self, out: torch.Tensor, reqs: list[Request], ahead: list[int], rows: list[int]) -> None:
        """vLLM's repetition penalty (prompt and output tokens), then OpenAI's
        logit -= count * frequency + (count > 0) * presence."""
        if not rows:
            return
        slots = self.counts.sync([reqs[i] for i in rows])
        slot_index = self._index([slots[reqs[i].request_id] for i in rows])
        counts = self.counts.counts.index_select(0, slot_index)
        extra = [(j, t) for j, i in enumerate(rows) for t in reqs[i].spec_token_ids[: ahead[i]]]
        if extra:
            r, t = zip(*extra, strict=True)
            counts.index_put_((self._index(list(r)), self._index(list(t))),
                              torch.ones(len(extra), dtype=torch.int32, device=out.device), accumulate=True)
        params = [reqs[i].params for i in rows]
        freq = device_tensor([p.frequency_penalty for p in params], torch.float32, self.device)[:, None]
        pres = device_tensor([p.presence_penalty for p in params], torch.float32, self.device)[:, None]
        index = self._index(rows)
        sub = out.index_select(0, index)
        if any(p.repetition_penalty != 1 for p in params):
            rep = device_tensor([p.repetition_penalty for p in params], torch.float32, self.device)[:, None]
            seen = (counts > 0) | self.counts.prompt.index_select(0, slot_index)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - counts.float() * freq - (counts > 0).float() * pres
        out.index_copy_(0, index, sub)
