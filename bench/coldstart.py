"""Worker cold start: process start → ready to claim (model loaded and warmed), against the raw read time of
its weight files, page cache dropped before each; bf16 (default loading, and every tensor mapped), a
pre-quantized int8 checkpoint, and int8 and int4 (NF4) quantized while loading.

python bench/coldstart.py [--hidden 2048 --layers 12] [--rounds 2] [--variants bf16,bf16-mmap,...] [--no-record]
(--hidden 4096 --layers 32: a 7B-class checkpoint, 11.5 GB)
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import requests
import torch
from common import ROOT, table
from pipeline import start_redis

from tests.services import free_port, start_worker, stop_worker

CHUNK = 16 * 1024 * 1024
VARIANTS = ("bf16", "bf16-4k", "bf16-mmap", "bf16-copy", "int8-prequantized", "int8-while-loading", "int4-while-loading")
EXT = {
    "TORCH_EXTENSIONS_DIR": str(Path(tempfile.gettempdir()) / "sluice-coldstart-ext")
}  # built once, unshared
TINY = ROOT / "models" / "sluice-tiny"
SECTION = "Cold start (worker time to ready vs raw weight read)"  # + the checkpoint's shape
NOTES = """

Time to ready is the worker's own `sluice_time_to_ready_seconds` (process start → model loaded, warmed by
one request, ready to claim), best of the rounds; the raw read (best of every read of that checkpoint, one
before each of its workers) reads every weight file once after
`posix_fadvise(DONTNEED)` (the VM's host may still cache it, so this is a lower bound on a disk read). The
sluice-tiny row is the fixed cost every worker pays whatever its model (Python, torch and transformers
imports, tokenizer, KV allocation; bitsandbytes models add its import); CPU attention kernels are built once
beforehand, as a worker image should ship them. Workers run on their default settings (256 sequences, the model's full context:
the CPU KV pool's 4 GiB cap, mapped but not touched). `bf16` loads as a worker does by default
(`--weight-loading auto`: from 4 GiB of weights every tensor stored as used is the file's own page-cache pages;
below that every tensor is read into private memory, an arena that becomes huge pages after the warm-up);
`bf16, 4 KB pages` passes `--no-huge-pages`; `bf16, mapped` passes `--weight-loading mmap` (every tensor
mapped); `bf16, copied` passes `--weight-loading copy` (every tensor read: what `auto` does below 4 GiB, so
the two rows differ by the host's noise). The last column is the size-dependent part against the raw read."""


def weight_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def evict(files: list[Path]) -> None:
    """Drop the files from the page cache, so that the next read comes from disk."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(files: list[Path]) -> float:
    """Seconds to read every byte of files once, cold."""
    evict(files)
    buffer = bytearray(CHUNK)
    start = time.perf_counter()
    for path in files:
        with path.open("rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


def checkpoint(hidden: int, layers: int) -> Path:
    """A random bf16 Llama of the given width and depth, in 2 GB shards like real checkpoints (cached)."""
    from tests.checkpoints import make_checkpoint

    path = Path(tempfile.gettempdir()) / f"sluice-coldstart-{hidden}x{layers}"
    if not (path / "config.json").is_file():
        make_checkpoint(
            path,
            "llama",
            dtype=torch.bfloat16,
            hidden_size=hidden,
            num_hidden_layers=layers,
            intermediate_size=hidden * 11 // 4,
            num_attention_heads=hidden // 128,
            num_key_value_heads=max(1, hidden // 512),
            max_shard_size="2GB",
        )
    return path


def prequantized(src: Path) -> Path:
    """`sluice quantize SRC DST --quantization int8` (cached)."""
    dst = src.with_name(src.name + "-int8")
    if not (dst / "config.json").is_file():
        sluice = Path(sys.executable).parent / "sluice"
        subprocess.run([str(sluice), "quantize", str(src), str(dst), "--quantization", "int8"], check=True)
    return dst


def time_to_ready(model: Path, redis_url: str, log: Path, *args: str) -> float:
    """Start a worker with a cold page cache; its own process-start → ready gauge once /readyz answers."""
    evict(weight_files(model))
    port = free_port()
    worker = start_worker(
        model,
        redis_url,
        log,
        "--metrics-port",
        str(port),
        *args,
        dtype="bfloat16",
        device="cpu",
        **EXT,
    )
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited with {worker.returncode}; see {log}")
            try:
                if requests.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        return float(re.search(r"^sluice_time_to_ready_seconds (\S+)$", text, re.M).group(1))
    finally:
        stop_worker(worker)


def write_section(title: str, body: str) -> None:
    """Replace this benchmark's section `title` of docs/benchmarks.md (or add it)."""
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = f"## {title}\n\n`{cmd}` ({stamp})\n\n{body}\n"
    print(section)
    if "--no-record" in sys.argv:
        return
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text()
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    doc.write_text(
        pattern.sub(section + "\n", text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"Some of {', '.join(VARIANTS)}.")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    bf16 = checkpoint(args.hidden, args.layers)
    wanted = args.variants.split(",")
    int8 = prequantized(bf16) if "int8-prequantized" in wanted else None
    every = {
        "bf16": ("bf16", bf16, ()),
        "bf16-4k": ("bf16, 4 KB pages", bf16, ("--no-huge-pages",)),
        "bf16-mmap": ("bf16, mapped", bf16, ("--weight-loading", "mmap")),
        "bf16-copy": ("bf16, copied", bf16, ("--weight-loading", "copy")),
        "int8-prequantized": ("int8, pre-quantized", int8, ()),
        "int8-while-loading": ("int8, quantized while loading", bf16, ("--quantization", "int8")),
        "int4-while-loading": ("int4 (NF4), quantized while loading", bf16, ("--quantization", "int4")),
    }
    variants = [("sluice-tiny (fixed overhead)", TINY, ())] + [every[v] for v in wanted]
    ready_s = {name: float("inf") for name, _, _ in variants}
    read_s = {model: float("inf") for _, model, _ in variants}  # per checkpoint: variants of one share its reads
    with tempfile.TemporaryDirectory() as tmp:
        redis_proc, redis_url = start_redis(Path(tmp))
        try:
            time_to_ready(
                TINY, redis_url, Path(tmp) / "worker.log"
            )  # builds the CPU kernels once, unmeasured
            for _ in range(args.rounds):  # interleaved rounds, best of each
                for name, model, extra in variants:
                    read = raw_read(weight_files(model))
                    ready = time_to_ready(model, redis_url, Path(tmp) / "worker.log", *extra)
                    read_s[model], ready_s[name] = min(read_s[model], read), min(ready_s[name], ready)
                    print(f"{name}: raw read {read:.2f} s, time to ready {ready:.2f} s", flush=True)
        finally:
            redis_proc.terminate()
    rows, fixed = [], ready_s[variants[0][0]]
    for name, model, _ in variants:
        size = sum(f.stat().st_size for f in weight_files(model)) / 1e9
        read, ready = read_s[model], ready_s[name]
        marginal = f"{(ready - fixed) / read:.2f}x" if model != TINY else "-"
        rows.append([name, f"{size:.2f}", f"{read:.2f}", f"{ready:.2f}", f"{ready / read:.2f}x", marginal])
    headers = [
        "checkpoint",
        "weights GB",
        "raw cold read s",
        "time to ready s",
        "ready / read",
        "(ready - tiny) / read",
    ]
    body = table(headers, rows) + NOTES
    write_section(f"{SECTION}, hidden {args.hidden} x {args.layers} layers", body)


if __name__ == "__main__":
    main()
