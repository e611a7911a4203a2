"""Our CPU kernels on one ISA tier against the torch op they replace, in one process, alternated.

SLUICE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/cpu_tiers.py
    [--rows 1,4,16,32] [--engine 1,8] [--gen 32] [--paths 4,8,16,32,64] [--quant 1,16,128,1024]

Times the bench model's 48 decoder linears (bf16 weights, out of cache as in a decode step) through our bf16
GEMV against F.linear (oneDNN), and the int8 weight-only GEMV at one row against torch's
`_weight_int8pack_mm`, each pair alternated `--rounds` times (best of each): ratios on a noisy shared host are
only meaningful within a run. The table names the tier the kernels were built for and torch's own CPU
capability. `--engine B,...` adds the engine's bf16 decode tok/s on the ~125M bench model (bench/llamacpp.py's
measure: B x 128 prompt tokens, `--gen` generated), our kernels against `SLUICE_CPU_KERNEL=0` (the torch
fallbacks), alternated each round. `--paths R,...` times only the bf16 paths (the GEMV's narrow and widened-x
tiles, `widened_linear`, the avx2 tier's GEMM) on the 48 linears and the LM head at each row count.
`--quant R,...` (with `--threads 1`: each path's CPU time, robust to a shared host's other load) instead
times a decoder layer's four linears per row count on the bf16, int8 and int4
weight-only tiers as they dispatch, and on each quantized path forced (the dynamic int8 product, the W4A8
product, int4 requantized to int8 per row, the dequantized weight widened to fp32), alternated, medians: what
the tiers' row thresholds (kernels/int8_weights.py, kernels/int4_weights.py) are read from.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F
from common import BenchParser, add_baseline

from sluice.kernels import cpu_isa, int4_weights, int8_weights, options
from sluice.kernels import linear as linear_kernels

LINEARS = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12  # qkv, o, gate_up, down of 12 layers


def _best(fn, rounds: int, clock=time.perf_counter) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def bf16_rows(rows: int, rounds: int) -> tuple[float, float]:
    """ms for the 48 linears at `rows` rows: F.linear, ours."""
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in LINEARS]
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in LINEARS}
    gemv = linear_kernels._gemv()
    theirs = lambda: [F.linear(xs[w.shape[1]], w) for w in weights]  # noqa: E731
    ours = lambda: [gemv.bf16_gemv(xs[w.shape[1]], w, None) for w in weights]  # noqa: E731
    times = {"torch": float("inf"), "ours": float("inf")}
    with torch.inference_mode():
        for _ in range(rounds):  # alternate: the host's load hits both alike
            times["torch"] = min(times["torch"], _best(theirs, 1))
            times["ours"] = min(times["ours"], _best(ours, 1))
    return times["torch"] * 1e3, times["ours"] * 1e3


def bf16_paths(rows: int, rounds: int) -> dict[str, float]:
    """ms for the 48 linears and the LM head at `rows` rows on each bf16 path: the GEMV's narrow tiles, its
    widened-x tiles (the avx2 tier's; the same as narrow on avx512_bf16), `widened_linear` (oneDNN fp32), and
    where the tier has them oneDNN's bf16 matmul (F.linear) and our product from packed panels."""
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in [*LINEARS, (32000, 768)]]
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in LINEARS}
    gemv = linear_kernels._gemv()

    def on_gemv(wide_from: int, gemm_from: int = 1 << 40):
        def run():
            gemv.set_wide_min_rows(wide_from)
            if gemv.GEMM_MAX_ROWS:
                gemv.set_gemm_min_rows(gemm_from)
            return [gemv.bf16_gemv(xs[w.shape[1]], w, None) for w in weights]
        return run

    paths = {"widened_linear": lambda: [linear_kernels.widened_linear(xs[w.shape[1]], w) for w in weights]}
    if rows <= 64:
        paths = {"GEMV narrow": on_gemv(1 << 40), "GEMV widened x": on_gemv(1), **paths}
    if gemv.GEMM_MAX_ROWS:  # the avx2 tier's GEMM takes any row count
        paths["AVX2 GEMM"] = on_gemv(1 << 40, 1)
    if linear_kernels.onednn_bf16():
        paths["F.linear (oneDNN bf16)"] = lambda: [F.linear(xs[w.shape[1]], w) for w in weights]
    if getattr(gemv, "PANELS", False):  # AVX512-BF16: the weights packed once, outside the timing
        panels = [(gemv.pack_panels(w), w.shape[0]) for w in weights]
        paths["panels"] = lambda: [gemv.panels_linear(xs[p.shape[1] * 2], p, n) for p, n in panels]
    times = dict.fromkeys(paths, float("inf"))
    with torch.inference_mode():
        for _ in range(rounds):
            for name, fn in paths.items():
                times[name] = min(times[name], _best(fn, 1))
    gemv.set_wide_min_rows(gemv.WIDE_MIN_ROWS)
    if gemv.GEMM_MAX_ROWS:
        gemv.set_gemm_min_rows(gemv.GEMM_MIN_ROWS)
    return {name: t * 1e3 for name, t in times.items()}


def int8_one_row(rounds: int) -> tuple[float, float]:
    """ms for the 48 int8 weight-only linears at one bf16 row: torch's int8pack GEMV, ours."""
    qs = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for n, k in LINEARS]
    scales = [torch.rand(n).to(torch.bfloat16) for n, _ in LINEARS]
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for _, k in LINEARS}
    gemv = int8_weights._gemv_kernel(scales[0])
    pairs = list(zip(qs, scales, strict=True))
    theirs = lambda: [torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]], q, s) for q, s in pairs]  # noqa: E731
    ours = lambda: [gemv.int8_gemv(xs[q.shape[1]], q, s) for q, s in pairs]  # noqa: E731
    times = {"torch": float("inf"), "ours": float("inf")}
    with torch.inference_mode():
        for _ in range(rounds):
            times["torch"] = min(times["torch"], _best(theirs, 1))
            times["ours"] = min(times["ours"], _best(ours, 1))
    return times["torch"] * 1e3, times["ours"] * 1e3


def quant_paths(rows: int, rounds: int) -> dict[str, float]:
    """Median ms per decoder layer (its four linears) at `rows` bf16 rows on each path: each tier as it
    dispatches (bf16, int8 and int4 weight-only) and each quantized path forced. Up to 12 layers a pass (their
    weights out of cache, as in a decode step), fewer as rows grow (a bounded pass)."""
    layers = max(1, min(12, 3072 // rows))
    shapes = LINEARS[: 4 * layers]
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in shapes]
    int8s = [(w.float().abs().amax(1).div(127), w.float()) for w in weights]
    int8s = [(w.div(s[:, None]).round().to(torch.int8), s.to(torch.bfloat16)) for s, w in int8s]
    int4s = [int4_weights.pack(w, torch.bfloat16) for w in weights]
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in shapes}
    kernel = int4_weights.vnni_kernel()
    paths = {
        "bf16": lambda: [linear_kernels.linear(xs[w.shape[1]], w) for w in weights],
        "int8": lambda: [int8_weights.int8_linear(xs[q.shape[1]], q, s) for q, s in int8s],
        "int8 dynamic": lambda: [int8_weights.dynamic_int8_mm(xs[q.shape[1]], q, s) for q, s in int8s],
        "int8 widened": lambda: [linear_kernels.widened_linear(xs[q.shape[1]], q, None, s) for q, s in int8s],
        "int4": lambda: [int4_weights.int4_linear(xs[w.in_features], w) for w in int4s],
    }
    if kernel is not None and int4s[0].layout == "vnni":
        paths["int4 W4A8"] = lambda: [kernel.int4_vnni_mm(xs[w.in_features], w.packed, w.scales_zeros)
                                      for w in int4s]
        paths["int4 widened"] = lambda: [int4_weights.widened_int4(xs[w.in_features], w, None, kernel)
                                         for w in int4s]
    if kernel is not None and kernel.VNNI and int4s[0].layout == "vnni":
        paths["int4 requantized int8"] = lambda: [
            kernel.int4_vnni_int8_mm(xs[w.in_features], w.packed, w.scales_zeros) for w in int4s]
    times: dict[str, list[float]] = {name: [] for name in paths}
    # one thread: its own CPU time, which other processes on a shared host do not inflate
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    with torch.inference_mode():
        for fn in paths.values():  # warm up (scratch, threads)
            fn()
        for _ in range(rounds):  # alternate: the host's load hits every path alike
            for name, fn in paths.items():
                times[name].append(_best(fn, 1, clock))
    return {name: statistics.median(t) * 1e3 / layers for name, t in times.items()}


def _kernels(on: bool) -> None:
    os.environ["SLUICE_CPU_KERNEL"] = "1" if on else "0"
    options.reset()


def engine_decode(batches: list[int], rounds: int, gen: int) -> list[tuple[int, float, float]]:
    """(B, torch-fallback tok/s, ours tok/s) per batch size: best of `rounds`, the two engines alternated."""
    import llamacpp
    from common import bench_model

    llamacpp._set_shape(128, gen)
    engines = {}
    for on in (False, True):
        _kernels(on)
        engines[on] = llamacpp.load(bench_model(), "bf16", batches)
    rows = []
    for b in batches:
        best = {False: 0.0, True: 0.0}
        for r in range(rounds):
            for on in (False, True):
                _kernels(on)
                best[on] = max(best[on], llamacpp.sluice(engines[on], b, seed=r))
        rows.append((b, best[False], best[True]))
    _kernels(True)
    return rows


def _quant_table(rows: list[int], rounds: int) -> None:
    clock = "thread CPU" if torch.get_num_threads() == 1 else "wall"
    print(f"{clock} ms per decoder layer (4 linears), medians of {rounds} alternated rounds\n")
    for i, r in enumerate(rows):
        t = quant_paths(r, rounds)
        if i == 0:
            head = " | ".join(t)
            print(f"| rows | {head} | int8 × bf16 | int4 × bf16 |\n" + "|---" * (len(t) + 3) + "|")
        print(f"| {r} | " + " | ".join(f"{v:.2f}" for v in t.values())
              + f" | {t['bf16'] / t['int8']:.2f} | {t['bf16'] / t['int4']:.2f} |")


def main() -> None:
    """Print the markdown table."""
    parser = add_baseline(BenchParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--rows", default="1,4,16,32")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--engine", default="", help="batch sizes for the engine's decode tok/s, e.g. 1,8")
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--paths", default="",
                        help="row counts for the bf16 paths alone (ms per path), e.g. 8,64")
    parser.add_argument("--quant", default="",
                        help="row counts for the bf16 / int8 / int4 tiers' paths alone, e.g. 1,16,128,1024")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if linear_kernels._gemv() is None:
        raise SystemExit(f"no bf16 GEMV on tier {cpu_isa.tier()}")
    print(f"tier {cpu_isa.tier()} (GEMV built for {linear_kernels._gemv().TIER}), torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads\n")
    if args.paths:
        for rows in (int(r) for r in args.paths.split(",")):
            print(f"| {rows} rows | " + " | ".join(f"{k} {v:.1f} ms"
                                                   for k, v in bf16_paths(rows, args.rounds).items()))
        return
    if args.quant:
        _quant_table([int(r) for r in args.quant.split(",")], args.rounds)
        return
    print("| op | rows | torch ms | ours ms | ours × |\n|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        theirs, ours = bf16_rows(rows, args.rounds)
        print(f"| bf16 linear (F.linear) | {rows} | {theirs:.2f} | {ours:.2f} | {theirs / ours:.2f} |")
    theirs, ours = int8_one_row(args.rounds)
    print(f"| int8 weight-only (_weight_int8pack_mm) | 1 | {theirs:.2f} | {ours:.2f} | {theirs / ours:.2f} |")
    if args.engine:
        print("\n| B | bf16 decode tok/s, SLUICE_CPU_KERNEL=0 | ours | ours × |\n|---|---|---|---|")
        for b, off, on in engine_decode([int(b) for b in args.engine.split(",")], max(2, args.rounds // 5),
                                        args.gen):
            print(f"| {b} | {off:.1f} | {on:.1f} | {on / off:.2f} |")


if __name__ == "__main__":
    main()
