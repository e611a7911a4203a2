"""xgrammar vs llguidance on our batch shapes: schema compile time and per-step batch mask time.

Usage: python bench/grammar_engines.py [--model models/sluice-tiny] [--batch 32] [--steps 48]
Each of `batch` matchers walks its schema by taking a random allowed token each step; both engines walk the
same way (seeded). Prints a table and appends it to docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from common import ROOT, record
from grammar_schemas import SCHEMAS


def allowed(mask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = ((mask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def run_xgrammar(tokenizer, vocab: int, batch: int, steps: int) -> tuple[float, float, int]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False) for s in SCHEMAS]
    compile_s = (time.perf_counter() - t0) / len(SCHEMAS)
    matchers = [xgr.GrammarMatcher(compiled[i % len(SCHEMAS)]) for i in range(batch)]
    batcher, mask = xgr.BatchGrammarMatcher(), xgr.allocate_token_bitmask(batch, vocab)
    rng, fill, rows = random.Random(0), 0.0, 0
    for _ in range(steps):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        t0 = time.perf_counter()
        batcher.batch_fill_next_token_bitmask([matchers[i] for i in live], mask, live)
        fill, rows = fill + time.perf_counter() - t0, rows + len(live)
        for i, m in enumerate(matchers):
            if not m.is_terminated():
                m.accept_token(rng.choice(allowed(mask[i], vocab)))
    return compile_s, fill / rows, rows


def run_llguidance(tokenizer, vocab: int, batch: int, steps: int) -> tuple[float, float, int]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = llguidance.hf.from_tokenizer(tokenizer, vocab)
    t0 = time.perf_counter()
    grammars = [llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s), {"whitespace_flexible": False})
                for s in SCHEMAS]
    matchers = [llguidance.LLMatcher(tok, grammars[i % len(SCHEMAS)]) for i in range(len(SCHEMAS))]
    compile_s = (time.perf_counter() - t0) / len(SCHEMAS)
    matchers = [llguidance.LLMatcher(tok, grammars[i % len(SCHEMAS)]) for i in range(batch)]
    executor, mask = llguidance.LLExecutor(), llguidance.torch.allocate_token_bitmask(batch, vocab)
    rng, fill, rows = random.Random(0), 0.0, 0
    for _ in range(steps):
        live = [(m, i) for i, m in enumerate(matchers) if not m.is_stopped()]
        if not live:
            break
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(executor, live, mask)
        fill, rows = fill + time.perf_counter() - t0, rows + len(live)
        for i, m in enumerate(matchers):
            if not m.is_stopped():
                m.consume_token(rng.choice(allowed(mask[i], vocab)))
    return compile_s, fill / rows, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-record", action="store_true", help="do not write docs/benchmarks.md")
    ap.add_argument("--model", default=str(ROOT / "models" / "sluice-tiny"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = len(tokenizer)
    rows = []
    for name, fn in [("xgrammar", run_xgrammar), ("llguidance", run_llguidance)]:
        compile_s, row_s, filled = fn(tokenizer, vocab, args.batch, args.steps)
        rows.append(f"| {name} | {compile_s * 1e3:.1f} | {row_s * 1e6:.0f} | {filled} |")
    table = "\n".join(["| engine | compile ms / schema | mask µs / row (batched fill) | rows filled |",
                       "|---|---|---|---|", *rows])
    record(f"Grammar engines: xgrammar vs llguidance ({Path(args.model).name}, vocab {vocab}, batch "
           f"{args.batch}, {len(SCHEMAS)} schemas)", table)


if __name__ == "__main__":
    main()
