"""Worker cold start, in one run: bare `import torch`, a raw read of each checkpoint's weight files, and a worker's
process start → ready → first token for the bundled model, a ~1 GB bf16 checkpoint and its int8 and int4
pre-quantized versions, every start in the same page-cache state as the read it is set against.

python bench/coldstart.py [--hidden 2048 --layers 12] [--rounds 3] [--cold] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, record, table

CHUNK = 16 * 1024 * 1024
TINY = ROOT / "models" / "sluice-tiny"
SECTION = "Cold start (process start → ready → first token, against import torch and the raw read)"
# The worker's own start: its imports (sluice.worker.cli), its engine on its defaults, its one-step warm-up;
# ready is where it would start claiming. Start is the kernel's record of the process start.
START = """
import os, time
def started():
    ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
"""
TORCH = START + "import torch\nprint(time.time() - started())\n"
WORKER = START + """import json, sys
import sluice.worker.cli
from sluice.engine import LLM, SamplingParams
from sluice.worker.metrics import warm_up
llm = LLM(sys.argv[1], dtype="bfloat16", device="cpu")
warm_up(llm)
ready = time.time()
out = llm.generate(["O Romeo, Romeo"], SamplingParams(max_tokens=1, temperature=0), progress=False)
first = time.time()
assert len(out[0].token_ids) == 1
print(json.dumps({"ready": ready - started(), "first": first - ready, "transformers": "transformers" in sys.modules}))
"""
NOTES = """

Each column is the best of the rounds, rounds interleaved. `import torch` is a bare `python -c "import torch"`
(process start → imported); raw read reads every weight file once (16 MB reads); ready is a worker's start
(its imports, `LLM(...)` on the worker's defaults, its one-step warm-up: where it starts claiming) measured from
the process start; first token is one more one-token request after ready. `ready / target` sets ready against
`import torch` for the bundled model and against `import torch` + raw read for the others (target: 1.25x).
The page cache is warm (each file read once before) unless `--cold`, which drops each file before both the
raw read and the start. Kernels are built beforehand (one unmeasured start). A shared 2-core VM: compare
ratios within one run."""


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


def child(code: str, *args: str) -> str:
    """Run code in a fresh interpreter outside the checkout; its last line of output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=tempfile.gettempdir(), env=env,
                         capture_output=True, text=True, timeout=2400)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return out.stdout.strip().splitlines()[-1]


def measure(variants: list[tuple[str, Path]], rounds: int, cold: bool) -> dict[str, dict[str, float]]:
    """Best of the rounds of import torch (key 'torch') and, per variant, raw read, ready and first token."""
    best: dict[str, dict[str, float]] = {"torch": {"ready": float("inf")}}
    for name, _ in variants:
        best[name] = {"read": float("inf"), "ready": float("inf"), "first": float("inf")}
    child(WORKER, str(TINY))  # builds the CPU kernels, unmeasured
    for _ in range(rounds):
        best["torch"]["ready"] = min(best["torch"]["ready"], float(child(TORCH)))
        for name, model in variants:
            files = weight_files(model)
            set_cache(files, cold)
            read = raw_read(files)
            set_cache(files, cold)
            got = json.loads(child(WORKER, str(model)))
            row = best[name]
            row["read"], row["ready"], row["first"] = min(row["read"], read), min(row["ready"], got["ready"]), \
                min(row["first"], got["first"])
            row["transformers"] = got["transformers"]
            print(f"{name}: read {read:.2f} s, ready {got['ready']:.2f} s, first token +{got['first']:.3f} s",
                  flush=True)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="Drop the page cache before each read and start.")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--variants", default="tiny,bf16,int8,int4", help="Which starts to measure (comma-separated).")
    args = p.parse_args()
    bf16 = checkpoint(args.hidden, args.layers)
    every = {"tiny": ("sluice-tiny (bundled)", lambda: TINY), "bf16": ("bf16", lambda: bf16),
             "int8": ("int8, pre-quantized", lambda: prequantized(bf16, "int8")),
             "int4": ("int4 (NF4), pre-quantized", lambda: prequantized(bf16, "int4"))}
    variants = [(every[k][0], every[k][1]()) for k in args.variants.split(",")]
    best = measure(variants, args.rounds, args.cold)
    torch_s = best["torch"]["ready"]
    rows = [["import torch", "-", "-", f"{torch_s:.2f}", "-", "-", "-"]]
    for name, model in variants:
        b = best[name]
        size = sum(f.stat().st_size for f in weight_files(model)) / 1e9
        target = torch_s + (0.0 if model == TINY else b["read"])
        rows.append([name, f"{size:.2f}", f"{b['read']:.2f}", f"{b['ready']:.2f}", f"{b['ready'] / target:.2f}x",
                     f"{b['first']:.3f}", "yes" if b["transformers"] else "no"])
    headers = ["checkpoint", "weights GB", "raw read s", "start → ready s", "ready / target",
               "ready → first token s", "transformers imported"]
    cache = "cold" if args.cold else "warm"
    record(f"{SECTION}, page cache {cache}, hidden {args.hidden} x {args.layers} layers",
                  table(headers, rows) + NOTES)


if __name__ == "__main__":
    main()
