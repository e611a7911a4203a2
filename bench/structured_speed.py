"""Decode throughput with structured outputs vs the same prompts unconstrained, both in one run.

python bench/structured_speed.py [--batch 32] [--max-tokens 64] [--rounds 2] [--model models/sluice-tiny]
Each request is constrained to a JSON schema whose one string property is free text, so constrained requests
decode about as long as unconstrained ones; rounds alternate unconstrained, constrained with the mask filled
after the forward, and constrained with it filled on the grammar thread while the forward runs (the engine's
default)."""

from __future__ import annotations

import time
from pathlib import Path

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


def run(llm: LLM, batch: int, max_tokens: int, constrained: bool) -> tuple[int, float]:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=not constrained,
                             structured_outputs=so) for i in range(batch)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, progress=False)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=str(ROOT / "models" / "sluice-tiny"))
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    llm = LLM(args.model, dtype="bfloat16" if args.device == "cpu" else "auto", device=args.device,
              max_num_seqs=args.batch)
    run(llm, 2, 4, True)  # warm-up: compiles the grammar, builds kernels
    timer = Timed(llm)
    modes = {"unconstrained": (False, True), "json_schema, mask filled after the forward": (True, False),
             "json_schema, mask filled during the forward": (True, True)}
    totals = {name: [0, 0.0, 0.0] for name in modes}
    structured = llm.engine.processors.structured
    for _ in range(args.rounds):
        for name, (constrained, overlap) in modes.items():
            structured.overlap = overlap
            before = timer.seconds
            tokens, dt = run(llm, args.batch, args.max_tokens, constrained)
            totals[name][0] += tokens
            totals[name][1] += dt
            totals[name][2] += timer.seconds - before
    base = totals["unconstrained"][0] / totals["unconstrained"][1]
    rows = [[name, t[0], t[0] / t[1], t[0] / t[1] / base, t[2] / t[1]] for name, t in totals.items()]
    body = table(["requests", "tokens", "tokens/s", "vs unconstrained", "share of time in logits processing"],
                 rows)
    record(f"Structured outputs: decode throughput at batch {args.batch} ({Path(args.model).name}, {args.device})",
           body)


if __name__ == "__main__":
    main()
