"""Decode throughput with structured outputs vs the same prompts unconstrained, both in one run.

python bench/structured_speed.py [--batch 32] [--max-tokens 64] [--rounds 2] [--model models/sluice-tiny]
Each request is constrained to a JSON schema whose one string property is free text, so constrained requests
decode about as long as unconstrained ones; rounds alternate unconstrained, constrained with the mask filled
after the forward, and constrained with it filled on the grammar thread while the forward runs (the engine's
default)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from common import ROOT, base_parser, record, table

from sluice.engine import LLM, SamplingParams
from sluice.engine.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"speech": {"type": "string"}}, "required": ["speech"],
          "additionalProperties": False}
PROMPTS = ["KING HENRY:\n", "HAMLET:\nTo be, or not", "JULIET:\nO Romeo,", "MACBETH:\nTomorrow, and"]


class Timed:
    """Wall time spent inside the engine's logits processing (penalties, bias, grammar mask fill and apply)."""

    def __init__(self, llm: LLM) -> None:
        self.inner, self.seconds = llm.engine.processors.apply, 0.0
        llm.engine.processors.apply = self

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


def run(llm: LLM, batch: int, max_tokens: int, constrained: bool) -> tuple[int, float, float]:
    """Tokens generated, wall seconds and process CPU seconds of one batch."""
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=not constrained,
                             structured_outputs=so) for i in range(batch)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    t, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, progress=False)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t, time.process_time() - cpu


MODES = {"unconstrained": (False, True), "json_schema, mask filled after the forward": (True, False),
         "json_schema, mask filled during the forward": (True, True)}


def measure(llm: LLM, args) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per mode: totals [tokens, wall s, CPU s, s in logits processing] and each round's wall rate."""
    timer = Timed(llm)
    structured = llm.engine.processors.structured
    totals = {name: [0.0, 0.0, 0.0, 0.0] for name in MODES}
    rates: dict[str, list[float]] = {name: [] for name in MODES}
    for _ in range(args.rounds):
        for name, (constrained, overlap) in MODES.items():
            structured.overlap = overlap
            before = timer.seconds
            tokens, wall, cpu = run(llm, args.batch, args.max_tokens, constrained)
            for i, v in enumerate((tokens, wall, cpu, timer.seconds - before)):
                totals[name][i] += v
            rates[name].append(tokens / wall)
    return totals, rates


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=str(ROOT / "models" / "sluice-tiny"))
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="bfloat16" if args.device == "cpu" else "auto", device=args.device,
              max_num_seqs=args.batch)
    run(llm, 2, 4, True)  # warm-up: compiles the grammar, builds kernels
    totals, rates = measure(llm, args)
    base = totals["unconstrained"]
    rows = []
    for name, t in totals.items():
        per_round = statistics.median(r / b for r, b in zip(rates[name], rates["unconstrained"], strict=True))
        rows.append([name, int(t[0]), t[0] / t[1], (t[0] / t[1]) / (base[0] / base[1]), per_round,
                     (base[2] / base[0]) / (t[2] / t[0]), t[3] / t[1]])
    body = table(["requests", "tokens", "tokens/s", "vs unconstrained (total wall)", "median per-round wall ratio",
                  "vs unconstrained (CPU s per token)", "share of time in logits processing"], rows)
    record(f"Structured outputs: decode throughput at batch {args.batch} ({Path(args.model).name}, {args.device})",
           body)


if __name__ == "__main__":
    main()
