"""Worker cold start, in one run: bare `import torch`, a raw read of each checkpoint's weight files, a real
worker's process start → ready, and an offline start's ready → first token, for the bundled model, a ~1 GB
bf16 checkpoint and its int8 and int4 pre-quantized versions, every start in the same page-cache state as the
read it is set against.

python bench/coldstart.py [--hidden 2048 --layers 12] [--rounds 3] [--cold] [--threads N]
    [--variants tiny,...] [--baseline REF] [--no-record]

--baseline REF (a git revision) adds, after each variant, the same start with the code of REF (common.py's
`baseline_tree`, put first on the children's PYTHONPATH), alternated with this checkout's in every round: an
A/B of old and new code in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, add_baseline, baseline_env, baseline_tree, record, table

CHUNK = 16 * 1024 * 1024
TINY = ROOT / "models" / "sluice-tiny"
SECTION = "Cold start (process start → ready → first token, against import torch and the raw read)"
# The process's start: the kernel's record of it, as the worker's own time-to-ready gauge reads it.
START = """
import os, resource, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
def started():
    ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
"""
TORCH = START + "import json, torch\nprint(json.dumps({'ready': time.time() - started(), 'cpu': cpu()}))\n"
# The first token, offline: the worker's imports (its entry point's collector pause included), its engine on
# its defaults and its warm-up, then one one-token request timed from there (not through the queue).
FIRST = START + """import json, sys
from sluice.worker import collector
collector.pause()
import sluice.worker.cli
from sluice.engine import LLM, SamplingParams
from sluice.worker.metrics import warm_up
collector.resume()
llm = LLM(sys.argv[1], dtype="bfloat16", device="cpu")
warm_up(llm)
ready, ready_cpu = time.time(), cpu()
out = llm.generate(["O Romeo, Romeo"], SamplingParams(max_tokens=1, temperature=0), progress=False)
first = time.time()
assert len(out[0].token_ids) == 1
print(json.dumps({"ready": ready - started(), "cpu": ready_cpu, "first": first - ready,
                  "transformers": "transformers" in sys.modules}))
"""
# The same offline start without the worker's collector pause: what its imports cost before (for comparison).
UNPAUSED = FIRST.replace("collector.pause()\n", "").replace("collector.resume()\n", "")
# The 1 GB load alone, process start → weights loaded, the arena's ways compared: `copy` (a fresh arena: the
# reader threads fault its pages in), `reserved` (engine.weight_reserve before `import torch`: the weights
# read into it meanwhile, as the worker does), `reserved-after` (the same made after the import: the reads not
# overlapped), `mmap` (the file's pages mapped where the stored bytes serve; the fused projections copied).
LOAD = START + """import json, sys
mode = sys.argv[2]
reservation = None
if mode == "reserved":
    from sluice.engine import weight_reserve
    reservation = weight_reserve.reserve(sys.argv[1], "BF16", 1 << 40)
import torch
imported = time.time()
if mode == "reserved-after":
    from sluice.engine import weight_reserve
    reservation = weight_reserve.reserve(sys.argv[1], "BF16", 1 << 40)
    reservation._thread.join()
from sluice.engine.models.loader import load_model
begun = time.time()
loading = "mmap" if mode == "mmap" else "copy"
model = load_model(sys.argv[1], torch.bfloat16, torch.device("cpu"), 64, weight_loading=loading,
                   reservation=reservation)
done = time.time()
print(json.dumps({"imported": imported - started(), "load": done - begun, "loaded": done - started(),
                  "cpu": cpu()}))
"""
LOADS = ("copy", "reserved", "reserved-after", "mmap")
READY = re.compile(r"ready in ([0-9.]+) s")
NOTES = """

Each column is the best of the rounds, rounds interleaved. `import torch` is a bare `python -c "import torch"`
(process start → imported); raw read reads every weight file once (16 MB reads); worker start → ready is a
real `python -m sluice.worker --model M --dtype bfloat16 --device cpu --burst --no-webhooks` against a local
redis-server, its logged time to ready (process start → imported, `LLM(...)`, its one-step warm-up, its model
announced: where it starts claiming); `ready / target` sets it against `import torch` for the bundled model
and against `import torch` + raw read for the others (target: 1.25x). The offline columns are a second process
doing the worker's start (its imports, collector pause included, `LLM(...)`, the warm-up) in-process, then one
one-token request: first token is from that ready to the token, offline (not through a queue). CPU s is the
process's own user + system CPU time up to ready (for `import torch`: up to imported), which other
processes' load on the host moves far less than the wall clock. The page cache is warm (each file read once
before) unless `--cold`, which drops each file before the raw read and each start.
Kernels are built beforehand (one unmeasured start). A shared 2-core VM: compare ratios within one run."""


UNPAUSED_ROW = ", collector not paused (offline only)"


def weight_files(model: Path) -> list[Path]:
    """The checkpoint's safetensors files."""
    return sorted(model.glob("*.safetensors"))


def set_cache(files: list[Path], cold: bool) -> None:
    """Drop the files from the page cache (cold), or read them once so that they are in it (warm)."""
    for path in files:
        if cold:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        else:
            raw_read([path])


def raw_read(files: list[Path]) -> float:
    """Seconds to read every byte of files once."""
    buffer = bytearray(CHUNK)
    start = time.perf_counter()
    for path in files:
        with path.open("rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


def checkpoint(hidden: int, layers: int) -> Path:
    """A random bf16 Llama of the given width and depth (cached in tmp)."""
    from tests.checkpoints import make_checkpoint

    path = Path(tempfile.gettempdir()) / f"sluice-coldstart-{hidden}x{layers}"
    if not (path / "config.json").is_file():
        make_checkpoint(path, "llama", dtype=torch.bfloat16, hidden_size=hidden, num_hidden_layers=layers,
                        intermediate_size=hidden * 11 // 4, num_attention_heads=hidden // 128,
                        num_key_value_heads=max(1, hidden // 512), max_shard_size="2GB")
    return path


def prequantized(src: Path, mode: str) -> Path:
    """`sluice quantize SRC DST --quantization MODE` (cached)."""
    dst = src.with_name(f"{src.name}-{mode}")
    if not (dst / "config.json").is_file():
        sluice = Path(sys.executable).parent / "sluice"
        subprocess.run([str(sluice), "quantize", str(src), str(dst), "--quantization", mode], check=True)
    return dst


def child(code: str, *args: str, path: str = "") -> str:
    """Run code in a fresh interpreter outside the checkout (`path`: first on its PYTHONPATH); its last line
    of output."""
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=tempfile.gettempdir(),
                         env=baseline_env(path), capture_output=True, text=True, timeout=2400)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return out.stdout.strip().splitlines()[-1]


def redis_server() -> tuple[subprocess.Popen, str]:
    """A redis-server on a free port (no persistence) and its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
           "--save", "", "--appendonly", "no", "--dir", tempfile.gettempdir()]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(300):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return process, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start")


def worker_ready(model: Path, redis_url: str, path: str = "") -> float:
    """A real `python -m sluice.worker --burst` on model (bf16, CPU, empty queues): the seconds from its
    process start to ready that it logs (its time-to-ready gauge: imported, loaded, warmed up, announced)."""
    cmd = [sys.executable, "-m", "sluice.worker", "--model", str(model), "--dtype", "bfloat16", "--device",
           "cpu", "--burst", "--no-webhooks", "--redis-url", redis_url]
    out = subprocess.run(cmd, cwd=tempfile.gettempdir(), env=baseline_env(path), capture_output=True,
                         text=True,
                         timeout=2400)
    found = READY.search(out.stdout + out.stderr)
    if out.returncode or found is None:
        raise RuntimeError((out.stdout + out.stderr)[-3000:])
    return float(found.group(1))


def measure(variants: list[tuple[str, Path, str]], rounds: int, cold: bool) -> dict[str, dict[str, float]]:
    """Best of the rounds of import torch (key 'torch') and, per variant (name, checkpoint, PYTHONPATH of its
    code), raw read, the worker's ready, and the offline start's ready and first token."""
    best: dict[str, dict[str, float]] = {"torch": {"ready": float("inf"), "cpu": float("inf")}}
    for name, _, _ in variants:
        best[name] = {k: float("inf") for k in ("read", "ready", "offline", "cpu", "first")}
    server, url = redis_server()
    try:
        child(FIRST, str(TINY))  # builds the CPU kernels, unmeasured
        for _ in range(rounds):
            got = json.loads(child(TORCH))
            best["torch"] = {k: min(v, got[k]) for k, v in best["torch"].items()}
            for name, model, path in variants:
                _round(best[name], model, cold, url, paused=not name.endswith(UNPAUSED_ROW), path=path)
    finally:
        server.terminate()
        server.wait(10)
    return best


def _round(row: dict, model: Path, cold: bool, url: str, paused: bool = True, path: str = "") -> None:
    """One round of one checkpoint: raw read, the worker's start, the offline start; each after set_cache
    (`paused` False: the offline start alone, without the collector pause; no worker start)."""
    files = weight_files(model)
    set_cache(files, cold)
    read = raw_read(files)
    set_cache(files, cold)
    ready = worker_ready(model, url, path) if paused else float("nan")
    set_cache(files, cold)
    got = json.loads(child(FIRST if paused else UNPAUSED, str(model), path=path))
    for key, value in (("read", read), ("ready", ready), ("offline", got["ready"]), ("cpu", got["cpu"]),
                       ("first", got["first"])):
        row[key] = min(row[key], value)
    row["transformers"] = got["transformers"]
    print(f"{model.name}{' (baseline)' if path else ''}: read {read:.2f} s, worker ready {ready:.2f} s, "
          f"offline ready {got['ready']:.2f} s, first token +{got['first']:.3f} s", flush=True)


def with_baseline(variants: list[tuple[str, Path, str]], ref: str) -> list[tuple[str, Path, str]]:
    """Each variant followed by the same on the code of git commit `ref` (none without one)."""
    if not ref:
        return variants
    base = baseline_tree(ref)
    return [v for name, model, _ in variants for v in ((name, model, ""), (f"{name} [{ref}]", model, base))]


def measure_loads(model: Path, rounds: int) -> str:
    """LOAD's ways, alternated in each round (page cache warm): a table of the best of the rounds."""
    best = {mode: dict.fromkeys(("imported", "load", "loaded", "cpu"), float("inf")) for mode in LOADS}
    for _ in range(rounds):
        for mode in LOADS:
            set_cache(weight_files(model), cold=False)
            got = json.loads(child(LOAD, str(model), mode))
            best[mode] = {k: min(v, got[k]) for k, v in best[mode].items()}
            print(mode, got, flush=True)
    rows = [[mode, *(f"{b[k]:.2f}" for k in ("imported", "load", "loaded", "cpu"))]
            for mode, b in best.items()]
    return table(["arena", "start → torch imported s", "load_model s", "start → loaded s", "CPU s to loaded"],
                 rows)


def result_rows(best: dict[str, dict[str, float]], variants: list[tuple[str, Path, str]]) -> list[list[str]]:
    """The table's rows: import torch, then each variant's best against its target."""
    torch_s, torch_cpu = best["torch"]["ready"], best["torch"]["cpu"]
    rows = [["import torch", "-", "-", f"{torch_s:.2f}", "-", "-", f"{torch_cpu:.2f}", "-", "-", "-"]]
    for name, model, _ in variants:
        b = best[name]
        size = sum(f.stat().st_size for f in weight_files(model)) / 1e9
        target = torch_s + (0.0 if model == TINY else b["read"])
        worker = [f"{b['ready']:.2f}",
                  f"{b['ready'] / target:.2f}x"] if b["ready"] < float("inf") else ["-", "-"]
        rows.append([name, f"{size:.2f}", f"{b['read']:.2f}", *worker,
                     f"{b['offline']:.2f}", f"{b['cpu']:.2f}", f"{b['cpu'] / torch_cpu:.2f}x",
                     f"{b['first']:.3f}", "yes" if b["transformers"] else "no"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="Drop the page cache before each read and start.")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--variants", default="tiny,bf16,int8,int4",
                   help="Which starts to measure (comma-separated; tiny-unpaused: the "
                   "offline start of the bundled model without the collector pause).")
    p.add_argument("--threads", type=int, default=0,
                   help="OMP_NUM_THREADS of the measured processes (0: unset).")
    p.add_argument("--loads", action="store_true",
                   help="Only the bf16 load's ways (LOADS), best of the rounds.")
    args = add_baseline(p).parse_args()  # a plain parser: the baseline's starts alternate with this code's
    bf16 = checkpoint(args.hidden, args.layers)
    if args.loads:
        print(measure_loads(bf16, args.rounds))
        return
    every = {"tiny": ("sluice-tiny (bundled)", lambda: TINY), "bf16": ("bf16", lambda: bf16),
             "int8": ("int8, pre-quantized", lambda: prequantized(bf16, "int8")),
             "int4": ("int4 (NF4), pre-quantized", lambda: prequantized(bf16, "int4"))}
    every["tiny-unpaused"] = ("sluice-tiny" + UNPAUSED_ROW, lambda: TINY)
    variants = with_baseline([(every[k][0], every[k][1](), "") for k in args.variants.split(",")],
                             args.baseline)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the children's (this process has imported torch)
    rows = result_rows(measure(variants, args.rounds, args.cold), variants)
    headers = ["checkpoint", "weights GB", "raw read s", "worker start → ready s", "ready / target",
               "offline start → ready s", "CPU s to ready", "CPU vs import torch",
               "ready → first token s (offline)", "transformers imported"]
    cache = "cold" if args.cold else "warm"
    threads = f", OMP_NUM_THREADS={args.threads}" if args.threads else ""
    record(f"{SECTION}, page cache {cache}, hidden {args.hidden} x {args.layers} layers{threads}",
           table(headers, rows) + NOTES)


if __name__ == "__main__":
    main()
