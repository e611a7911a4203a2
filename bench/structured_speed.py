"""Decode throughput with structured outputs vs the same prompts unconstrained, both in one run.

python bench/structured_speed.py [--batch 32] [--max-tokens 64] [--rounds 2]
    [--model models/sluice-tiny|bench] [--samplers cpp,torch]
Each request is constrained to a JSON schema whose one string property is free text, so constrained requests
decode about as long as unconstrained ones; rounds alternate unconstrained, constrained with the mask filled
after the forward, and constrained with it filled on the grammar thread while the forward runs, each with the
C++ sampler (kernels/masked_sample.py: mask, temperature, noise and argmax in one pass on the model's logits;
the engine's default on CPU) and with the torch sampler (a float32 copy masked by xgrammar, then
sampler.sample). `--model bench` is common.bench_model's random ~125M Llama (vocabulary 32000)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from common import ROOT, base_parser, bench_model, record, table

from sluice.engine import LLM, SamplingParams
from sluice.engine.sampling_params import StructuredOutputsParams
from sluice.kernels import masked_sample

SCHEMA = {"type": "object", "properties": {"speech": {"type": "string"}}, "required": ["speech"],
          "additionalProperties": False}
PROMPTS = ["KING HENRY:\n", "HAMLET:\nTo be, or not", "JULIET:\nO Romeo,", "MACBETH:\nTomorrow, and"]


class Timed:
    """Wall time spent from the step's logits to its tokens (grammar mask fill and apply, sampling)."""

    def __init__(self, llm: LLM) -> None:
        self.inner, self.seconds = llm.engine.processors.sample, 0.0
        llm.engine.processors.sample = self

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
SERVES = masked_sample.serves


def use_sampler(name: str) -> None:
    """The C++ sampler ("cpp") where it serves, or the torch path everywhere ("torch")."""
    masked_sample.serves = SERVES if name == "cpp" else (lambda logits: False)


def measure(llm: LLM, args) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per sampler and mode: totals [tokens, wall s, CPU s, s from logits to tokens] and each round's wall
    rate."""
    timer = Timed(llm)
    structured = llm.engine.processors.structured
    names = [(sampler, name) for sampler in args.samplers.split(",") for name in MODES]
    totals = {key: [0.0, 0.0, 0.0, 0.0] for key in names}
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in names}
    for _ in range(args.rounds):
        for sampler, name in names:
            use_sampler(sampler)
            structured.overlap = MODES[name][1]
            before = timer.seconds
            tokens, wall, cpu = run(llm, args.batch, args.max_tokens, MODES[name][0])
            for i, v in enumerate((tokens, wall, cpu, timer.seconds - before)):
                totals[sampler, name][i] += v
            rates[sampler, name].append(tokens / wall)
    use_sampler("cpp")
    return totals, rates


def rows_of(totals, rates) -> list[list]:
    """Table rows: each mode against the unconstrained run of the same sampler."""
    rows = []
    for (sampler, name), t in totals.items():
        base, base_rates = totals[sampler, "unconstrained"], rates[sampler, "unconstrained"]
        per_round = statistics.median(r / b for r, b in zip(rates[sampler, name], base_rates, strict=True))
        rows.append([f"{name} ({sampler} sampler)", int(t[0]), t[0] / t[1],
                     (t[0] / t[1]) / (base[0] / base[1]),
                     per_round, (base[2] / base[0]) / (t[2] / t[0]), t[3] / t[1]])
    return rows


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=str(ROOT / "models" / "sluice-tiny"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--samplers", default="cpp,torch", help="cpp, torch or both (alternated)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = str(bench_model()) if args.model == "bench" else args.model
    llm = LLM(model, dtype="bfloat16" if args.device == "cpu" else "auto", device=args.device,
              max_num_seqs=args.batch)
    run(llm, 2, 4, True)  # warm-up: compiles the grammar, builds kernels
    totals, rates = measure(llm, args)
    body = table(["requests", "tokens", "tokens/s", "vs unconstrained (total wall)",
                  "median per-round wall ratio",
                  "vs unconstrained (CPU s per token)", "share of time from logits to tokens"],
                 rows_of(totals, rates))
    title = f"Structured outputs: decode throughput at batch {args.batch} ({Path(model).name}, {args.device})"
    record(title, body)


if __name__ == "__main__":
    main()
