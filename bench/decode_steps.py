"""Decode-step time of our quantized modes against bf16, interleaved finely enough for a noisy shared host.

python bench/decode_steps.py [--batches 1,4,8,32,64] [--modes bf16,int8,int4] [--blocks 12] [--steps 8]
    [--pages]

Whole-run ratios (bench/llamacpp.py's best-of-rounds) swing by +-20% here when the host's load changes between
runs. This one keeps every mode's engine loaded with the same B decoding sequences and alternates modes every
`--steps` decode steps, `--blocks` times, so each mode sees the same host; it reports the median step. A
second table times the int8 x int8 matmul of the dynamic int8 path, ours (AVX512-VNNI) against torch._int_mm,
over the bench model's 48 decoder linears (weights out of cache, as in a decode step); a third the int4
linears, ours (int8 x int4 by VNNI on our layout) against torch's int4pack path. `--pages` instead times each
mode's step with its weights in huge pages (the default) against the same engine on 4 KB pages
(huge_pages=False), alternating.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from common import base_parser, bench_model, record, table
from llamacpp import GEN, MODES, PROMPT, load

from sluice.engine import SamplingParams
from sluice.kernels import int4_weights, int8_weights

LINEARS = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12  # qkv, o, gate_up, down of 12 layers


def step_times(model, engines: dict[str, tuple[str, bool]], batch: int, blocks: int,
               steps: int) -> dict[str, float]:
    """Median decode-step seconds per engine (name: mode, huge pages), each decoding the same `batch` random
    prompts."""
    llms = {name: load(model, m, [batch], huge_pages=huge) for name, (m, huge) in engines.items()}
    params = SamplingParams(max_tokens=blocks * steps + 2, temperature=0, ignore_eos=True)
    for llm in llms.values():
        rng = random.Random(0)
        for i in range(batch):
            llm.engine.add_request(f"d{i}", [rng.randrange(4, 32000) for _ in range(PROMPT)], params)
        while any(not r.output_token_ids for r in llm.engine.requests.values()):
            llm.engine.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(blocks):
        for m, llm in llms.items():
            for _ in range(steps):
                t = time.perf_counter()
                llm.engine.step()
                times[m].append(time.perf_counter() - t)
    return {m: statistics.median(v) for m, v in times.items()}


def int8_matmuls(rows: list[int]) -> list[list]:
    """ms for the 48 int8 matmuls at each row count: torch._int_mm, ours, ratio (None without VNNI)."""
    fused = int8_weights._fused()
    if fused is None or not fused.VNNI:
        return []
    torch.manual_seed(0)
    weights = [torch.randint(-127, 128, s, dtype=torch.int8) for s in LINEARS]

    table_rows = []
    for m in rows:
        xs = {k: torch.randint(-127, 128, (m, k), dtype=torch.int8) for k in (768, 2048)}
        theirs = _best(lambda xs=xs: [torch._int_mm(xs[w.shape[1]], w.t()) for w in weights])
        ours = _best(lambda xs=xs: [fused.int8_mm_vnni(xs[w.shape[1]], w) for w in weights])
        table_rows.append([m, theirs, ours, theirs / ours])
    return table_rows


def int4_matmuls(rows: list[int]) -> list[list]:
    """ms for the model's 49 int4 linears (LM head included) at each row count: torch's int4pack path (its
    GEMV to MAX_INT4PACK_ROWS rows, our tiles on its layout above), ours on our VNNI layout (the int8 x int4
    product to MAX_VNNI_ROWS rows, bf16 tiles above), ratio; [] without VNNI."""
    if int4_weights.vnni_kernel() is None:
        return []
    torch.manual_seed(0)
    shapes = [(n, k) for n, k in LINEARS] + [(32000, 768)]
    dense = [torch.randn(s) * 0.02 for s in shapes]
    layouts = {lay: [int4_weights.pack(w, torch.bfloat16, lay) for w in dense]
               for lay in ("int4pack", "vnni")}
    del dense
    table_rows = []
    for m in rows:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (768, 2048)}
        ms = {lay: _best(lambda ws=ws, xs=xs: [int4_weights.int4_linear(xs[w.in_features], w) for w in ws])
              for lay, ws in layouts.items()}
        table_rows.append([m, ms["int4pack"], ms["vnni"], ms["int4pack"] / ms["vnni"]])
    return table_rows


def pages(model, modes: list[str], batches: list[int], blocks: int, steps: int) -> None:
    """Each mode's median step with its weights in huge pages against 4 KB pages, alternating in one
    process."""
    rows = []
    for b in batches:
        for m in modes:
            med = step_times(model, {"4k": (m, False), "huge": (m, True)}, b, blocks, steps)
            rows.append([b, m, med["4k"] * 1e3, med["huge"] * 1e3, med["4k"] / med["huge"]])
            print(rows[-1], flush=True)
    body = table(["B", "mode", "4 KB pages step ms", "huge pages step ms", "huge ×"], rows) + (
        f"\n\nMedian decode step (ms) of B sequences past a {PROMPT}-token random prompt: per mode, the "
        "engine with its weights in one arena of transparent huge pages (engine.weight_memory, the default) "
        f"and the same engine with huge_pages=False loaded side by side, alternating every {steps} steps, "
        f"{blocks} times; bench/llamacpp.py's model. Modes: "
        + ", ".join(f"{m} = quantization={MODES[m][0]!r}" for m in modes) + ".")
    record("Decode step, weights in huge pages vs 4 KB pages", body)


def _best(fn) -> float:
    """Best ms of 5 x 10 calls."""
    fn()
    out = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            fn()
        out = min(out, (time.perf_counter() - t) / 10)
    return out * 1e3


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--batches", default="1,4,8,32,64")
    p.add_argument("--modes", default="bf16,int8,int4")
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--pages", action="store_true", help="huge pages against 4 KB pages, per mode")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    assert modes[0] == "bf16" and set(modes) <= set(MODES), f"modes: bf16 first, then of {sorted(MODES)}"
    batches = [int(b) for b in args.batches.split(",")]
    if args.pages:
        return pages(bench_model(), modes, batches, args.blocks, args.steps)
    model, rows = bench_model(), []
    for b in batches:
        med = step_times(model, {m: (m, True) for m in modes}, b, args.blocks, args.steps)
        rows.append([b, *(med[m] * 1e3 for m in modes), *(med["bf16"] / med[m] for m in modes[1:])])
        print(rows[-1], flush=True)
    headers = ["B", *(f"{m} step ms" for m in modes), *(f"{m} / bf16 speed" for m in modes[1:])]
    body = table(headers, rows) + (
        f"\n\nMedian decode step (ms) of B sequences past a {PROMPT}-token random prompt, the modes' engines "
        f"loaded side by side and alternating every {args.steps} steps, {args.blocks} times; "
        f"bench/llamacpp.py's model ({GEN}-token runs there). Modes: "
        + ", ".join(f"{m} = quantization={MODES[m][0]!r}" for m in modes) + ".")
    matmuls = int8_matmuls([1, 2, 4, 8, 16, 32, 64])
    if matmuls:
        body += "\n\n" + table(["rows", "torch._int_mm ms", "ours (VNNI) ms", "ours ×"], matmuls) + (
            "\n\nThe int8 x int8 -> int32 matmuls of the dynamic int8 path over the model's 48 decoder "
            "linears (int8 weights, 75 MB, read from memory each pass), best of 5 x 10 passes; both give the "
            "same exact sums.")
    matmuls = int4_matmuls([1, 2, 4, 8, 16, 32, 64])
    if matmuls:
        body += "\n\n" + table(["rows", "torch int4pack ms", "ours (VNNI layout) ms", "ours ×"], matmuls) + (
            "\n\nThe int4 weight-only linears of the model, LM head included (49, 62 MB with scales and "
            "zeros), best of 5 x 10 passes: torch's `_weight_int4pack_mm_for_cpu` to 16 rows and our tiles "
            "on its layout above, against ours: activations quantized to int8 per group of 32 and multiplied "
            "by `vpdpbusd` to 16 rows, above it weight blocks requantized to int8 per row times x quantized "
            "per row (VNNI).")
    record("Decode step by quantization mode (fine interleave)", body)


if __name__ == "__main__":
    main()
