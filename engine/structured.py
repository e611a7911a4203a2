"""Structured outputs: JSON (any object or a schema), regex, a choice of strings or an EBNF grammar, enforced
by xgrammar. Grammars are compiled once per distinct constraint and cached for the engine's life (so across
requests, shards and jobs in a worker); each request has its own matcher, advanced by the tokens it emits.
A step's masks are one token bitmask for every row, applied to the logits in one op. The rows a step will
sample plainly are filled in one batched call on a grammar thread started before the model's forward
(`fill_ahead`): the matchers already hold every token emitted so far, xgrammar fills without the GIL and
torch's ops release it, so the fill runs while the forward does and the sampler only waits for it. The engine
turns this on for CUDA (the host is free while the device computes) and on CPU where torch leaves a core free;
where torch's threads take every core, a third thread only stalls the forward's parallel regions, and the mask
is filled after it. Speculative verify rows (which walk each matcher through its proposals and back) are
filled after the forward. JSON schemas are checked and their values bounded by engine.json_schema."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from sluice.engine.json_schema import GrammarError, JsonBounds, bound_grammar, check_schema
from sluice.engine.request import Request
from sluice.engine.sampling_params import StructuredOutputsParams


def _transformers_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer as the transformers class xgrammar reads a vocabulary from: the engine's own tokenizer (a
    native model's, without transformers) wraps the same `tokenizers` object, so it is wrapped here, on the
    first structured request only."""
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, PreTrainedTokenizerFast):
        return tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)


@dataclass(slots=True)
class _Ahead:
    """A batched fill started before the forward: for which requests (by identity, in order), rows, into
    where."""

    owners: list[int]
    rows: list[int]
    bitmask: torch.Tensor
    done: Future


def _live_rows(reqs: list[Request]) -> list[int]:
    """Rows of requests whose grammar still constrains the next token."""
    return [i for i, r in enumerate(reqs) if r.grammar is not None and not r.grammar.is_terminated()]


class StructuredOutputManager:
    """Compiled grammars (cached per constraint), matchers and the batch bitmask for one engine's
    vocabulary."""

    def __init__(self, tokenizer: Any, vocab: int, stop_token_ids: list[int],
                 fill_threads: int | str = "auto", json_bounds: JsonBounds | None = None) -> None:
        # the grammar engine's native library is loaded on the first structured request
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        self.json_bounds = json_bounds or JsonBounds()
        info = xgr.TokenizerInfo.from_huggingface(_transformers_tokenizer(tokenizer), vocab_size=vocab,
                                                  stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        self.batcher = xgr.BatchGrammarMatcher(max_threads=fill_threads)
        self.cache: dict[str, Any] = {}
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)
        self.ahead_bitmask = xgr.allocate_token_bitmask(1, vocab)
        self.overlap = True  # fill during the forward (off: after it, when the sampler needs the mask)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar")
        self._ahead: _Ahead | None = None
        self.rows_filled = {"ahead": 0, "after": 0}  # masks filled during the forward, and after it

    def matcher(self, so: StructuredOutputsParams) -> Any:
        """A fresh matcher for the constraint; GrammarError if it cannot be compiled."""
        key = json.dumps([so.kind, getattr(so, so.kind)], sort_keys=True)
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self.cache[key] = self._compile(so)
        return self.xgr.GrammarMatcher(compiled)

    def _compile(self, so: StructuredOutputsParams) -> Any:
        try:
            if so.json is True or (isinstance(so.json, dict) and not so.json):
                return self._compile_json({"type": "object"}, strict_mode=False)
            if so.json is not None:
                schema = json.loads(so.json) if isinstance(so.json, str) else so.json
                check_schema(schema)
                return self._compile_json(schema)
            if so.regex is not None:
                return self.compiler.compile_regex(so.regex)
            if so.choice is not None:
                return self.compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in so.choice))
            return self.compiler.compile_grammar(so.grammar)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the converter's reason
            reason = str(exc).splitlines()[-1].split(": ", 1)[-1] if str(exc) else type(exc).__name__
            raise GrammarError(f"cannot compile structured_outputs.{so.kind}: {reason}") from exc

    def _compile_json(self, schema: dict[str, Any], strict_mode: bool = True) -> Any:
        """A JSON schema's grammar with its numbers and free strings bounded
        (engine.json_schema.bound_grammar)."""
        grammar = self.xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                    strict_mode=strict_mode)
        return self.compiler.compile_grammar(bound_grammar(str(grammar), self.json_bounds))

    def fill_ahead(self, reqs: list[Request]) -> None:
        """Start filling, on the grammar thread, the masks of the rows `reqs` will sample next (call it before
        the forward; `apply` with the same requests in the same order then waits for it instead of
        filling)."""
        self._settle()
        rows = _live_rows(reqs) if self.overlap else []
        if not rows:
            return
        if self.ahead_bitmask.shape[0] < len(reqs):
            self.ahead_bitmask = self.xgr.allocate_token_bitmask(len(reqs), self.vocab)
        bitmask = self.ahead_bitmask[: len(reqs)]
        done = self._thread.submit(self.batcher.batch_fill_next_token_bitmask,
                                   [reqs[i].grammar for i in rows], bitmask, rows)
        self._ahead = _Ahead([id(r) for r in reqs], rows, bitmask, done)

    def _settle(self) -> _Ahead | None:
        """Wait for a fill started ahead (no matcher moves while one runs); it, now finished, or None."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.done.result()
        return ahead

    def apply(self, logits: torch.Tensor, reqs: list[Request], ahead: list[int] | None) -> None:
        """Mask (in place) every row of a constrained request to the tokens its grammar allows next;
        `ahead[i]`: speculative proposals before row i."""
        filled = self.fill(reqs, ahead)
        if filled is not None:
            self.apply_bitmask(logits, *filled)

    def apply_bitmask(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """Mask (in place) the listed rows of the logits by the same rows of a bitmask that `fill` made."""
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=self.vocab, indices=rows)

    def fill(self, reqs: list[Request], ahead: list[int] | None) -> tuple[list[int], torch.Tensor] | None:
        """The rows a grammar masks and the bitmask (row i for reqs[i], on the host) that `apply` applies: the
        fill started ahead where it was for these requests, else one made now; None when no row is masked."""
        filled = self._settle() if ahead is None else None
        if filled is not None and filled.owners == [id(r) for r in reqs]:
            self.rows_filled["ahead"] += len(filled.rows)
            return filled.rows, filled.bitmask
        if ahead is not None and self._ahead is not None:
            self._ahead.done.result()  # verify rows come first; the plain rows' fill stays for them
        rows = _live_rows(reqs)
        if not rows:
            return None
        bitmask = self._bitmask(len(reqs))
        if ahead is None or not any(ahead[i] for i in rows):
            self.batcher.batch_fill_next_token_bitmask([reqs[i].grammar for i in rows], bitmask, rows)
        else:
            rows = self._fill_verify_rows(reqs, ahead, rows, bitmask)
        self.rows_filled["after"] += len(rows)
        return (rows, bitmask) if rows else None

    def _bitmask(self, n: int) -> torch.Tensor:
        if self.bitmask.shape[0] < n:
            self.bitmask = self.xgr.allocate_token_bitmask(n, self.vocab)
        self.xgr.reset_token_bitmask(self.bitmask)
        return self.bitmask[:n]

    def _fill_verify_rows(self, reqs: list[Request], ahead: list[int], rows: list[int],
                          bitmask: torch.Tensor) -> list[int]:
        """Speculative rows: row j of a request is masked after its first j proposals, then they are rolled
        back; rows after a proposal the grammar refuses stay unmasked (verification rejects there anyway)."""
        advanced: dict[int, int] = {}
        filled = []
        for i in rows:
            req = reqs[i]
            m, j = req.grammar, ahead[i]
            if j > 0:
                if advanced.get(id(req), 0) != j - 1 or not m.accept_token(req.spec_token_ids[j - 1]):
                    continue
                advanced[id(req)] = j
            if not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, i)
                filled.append(i)
        for req in {id(reqs[i]): reqs[i] for i in rows}.values():
            if advanced.get(id(req)):
                req.grammar.rollback(advanced[id(req)])
        return filled
