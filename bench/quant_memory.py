"""Resident memory of quantized modes against bf16 on the ~125M Llama (bf16 embeddings), after the warm-up
step and after a 40-prompt batch, next to what the weights' bytes alone would give.

python bench/quant_memory.py [--modes bf16,int8,int4] [--requests 40] [--maps] [--bnb-base] [--no-record]

--maps also prints, per mode, the mappings whose resident bytes grew most from the imports to after the
warm-up (libraries' code, [heap], [anon]) in MiB. --bnb-base imports bitsandbytes before the base in every
mode (as this bench did before LLM.int8() ran without it: to compare with those runs).
"""

from __future__ import annotations

import json
import subprocess
import sys

from common import bench_model, record, table, workload

MODES = {"bf16": {}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
         "int8-weight-only": {"quantization": "int8_weight_only"}}
KV_GB = 0.5
BNB_MODES = ()
NOTES = """

Resident is what the engine adds to the process's VmRSS (weights, KV pages touched, scratch; the imports
before `LLM(...)` are subtracted), each mode in its own process, after `LLM(...)` and the worker's one-step
warm-up, then after a batch of prompts (32-512 tokens, 16-64 new tokens each, greedy); bitsandbytes is
imported before the base in the modes whose engine imports it on CPU (int4). `weights' share` is the mode's
weight bytes (parameters, buffers and quantization state) over bf16's. `KV pages` is what the KV pool's maps
hold resident after the batch (the pages its tokens touched, kept for the prefix cache: the same bytes in
every mode, a bf16 KV cache), `less KV pages` the rest. VmRSS rows count every resident page; RssAnon rows
only the process's private ones, without the pages of mapped files: the code of libtorch and the other
libraries that each mode's first calls touched, clean pages of the page cache shared with every process that
maps the same library. The target is resident within 5% of the weights' share."""


def rss_bytes(field: str = "VmRSS") -> int:
    """VmRSS of this process (or another /proc/self/status field in kB: RssAnon, its private memory)."""
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def resident() -> dict[str, int]:
    """VmRSS and RssAnon (private: without the pages of mapped files, the libraries' code among them)."""
    return {"rss": rss_bytes(), "anon": rss_bytes("RssAnon")}


def mappings() -> dict[str, float]:
    """Resident MiB of this process by mapping name (/proc/self/smaps: a file's path, [heap], [anon], ...)."""
    out: dict[str, float] = {}
    name = "[anon]"
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if "-" in parts[0] and not parts[0].endswith(":"):
            name = parts[5] if len(parts) >= 6 else "[anon]"
        elif parts[0] == "Rss:":
            out[name] = out.get(name, 0.0) + int(parts[1]) / 1024
    return out


def grown_mappings(before: dict[str, float], top: int = 6) -> dict[str, float]:
    """The `top` mappings that grew most since `before`, by their growth in MiB."""
    now = mappings()
    growth = {k.rsplit("/", 1)[-1]: v - before.get(k, 0.0) for k, v in now.items()}
    return dict(sorted(growth.items(), key=lambda kv: -kv[1])[:top])


def kv_bytes(llm) -> int:
    """Resident bytes of the KV pool's memory maps (the pages the batch's tokens touched)."""
    starts = {t.data_ptr() for c in llm.engine.runner.kv_caches
              for t in (getattr(c, "k", None), getattr(c, "v", None))
              if t is not None}
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = any(lo <= p < hi for p in starts)
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def measure(mode: str, requests: int, bnb_base: bool = False) -> dict:
    """One mode in this process: weight bytes, resident after load, after warm-up and after the batch."""
    if bnb_base or mode in BNB_MODES:  # before the base: a library's import is not the engine's
        import bitsandbytes  # noqa: F401
    from quantization import weight_bytes

    from sluice.engine import LLM, SamplingParams
    from sluice.worker.metrics import warm_up

    # the process before the engine: Python, torch, bnb
    path, base, maps = bench_model(), resident(), mappings()
    llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_memory_gb=KV_GB, **MODES[mode])
    grown = lambda: {k: v - base[k] for k, v in resident().items()}  # noqa: E731
    out = {"mode": mode, "weights": weight_bytes(llm.engine.model)[0], "load": grown()}
    warm_up(llm)
    arena = getattr(llm.engine.model, "weight_arena", None)
    if arena is not None:
        arena.settled.wait(60)  # the huge-page collapse the first step starts: measure its steady state
    out["ready"], out["maps"] = grown(), {k: round(v, 1) for k, v in grown_mappings(maps).items()}
    reqs = workload(requests, out_range=(16, 64))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
    llm.generate([p for p, _ in reqs], params, progress=False)
    out["batch"], out["kv"] = grown(), kv_bytes(llm)
    out["batch_no_kv"] = {k: v - out["kv"] for k, v in out["batch"].items()}
    return out


def report(results: list[dict]) -> str:
    """The table: resident and ratios against bf16, next to the weights' share."""
    base = next(r for r in results if r["mode"] == "bf16")
    rows = []
    for kind, label in (("rss", "VmRSS"), ("anon", "RssAnon")):
        for r in results:
            row = [r["mode"], label, f"{r['weights'] / 2**20:.0f}", f"{r['weights'] / base['weights']:.3f}x"]
            for when in ("load", "ready", "batch", "batch_no_kv"):
                row += [f"{r[when][kind] / 2**20:.0f}", f"{r[when][kind] / base[when][kind]:.3f}x"]
            rows.append(row + [f"{r['kv'] / 2**20:.0f}"])
    headers = ["mode", "resident", "weights MiB", "weights' share", "after load MiB", "vs bf16",
               "after warm-up MiB",
               "vs bf16", "after batch MiB", "vs bf16", "after batch less KV pages MiB", "vs bf16",
               "KV pages MiB"]
    return table(headers, rows) + NOTES


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), "--bnb-base" in sys.argv)))
        return
    modes = "bf16,int8,int4"
    requests = 40
    args = sys.argv[1:]
    if "--modes" in args:
        modes = args[args.index("--modes") + 1]
    if "--requests" in args:
        requests = int(args[args.index("--requests") + 1])
    results = []
    for mode in modes.split(","):
        cmd = [sys.executable, __file__, "--worker", mode, str(requests),
               *(["--bnb-base"] if "--bnb-base" in args else [])]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(results[-1] if "--maps" in args else {k: v for k, v in results[-1].items() if k != "maps"},
              flush=True)
    record(f"Quantized resident memory, 125M Llama, {requests}-prompt batch", report(results))


if __name__ == "__main__":
    main()
