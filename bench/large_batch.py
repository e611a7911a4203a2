"""One large batch through the whole stack, and a small one submitted behind it.

Starts its own redis-server, `sluice serve` and `--workers` worker processes on models/sluice-tiny; uploads a
JSONL of `--lines` requests of about `--line-bytes` each (a short prompt, `max_tokens` 1, padded with a body
`metadata` value: real bytes through validation, storage, shard reads and finalize, none of them tokenized)
through the Files and Batches API; once the large batch is running, submits a `--small`-line batch from
another project and times it. Samples Redis `used_memory` (INFO memory) against its idle value, reads the peak
RSS (VmHWM) of the server and the workers, runs finalize's merge once more in a fresh process for its own peak
RSS and time, and checks that every request is in output.jsonl exactly once. Writes one table to
docs/benchmarks.md, in place of its previous section.

    python bench/large_batch.py --lines 5000           # scaled
    python bench/large_batch.py                        # 50,000 lines, ~200 MB
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "sluice-tiny"
SLUICE = Path(sys.executable).parent / "sluice"
SECTION = "One large batch, and a small one behind it (bench/large_batch.py)"
MB = 1000 * 1000
NOTE = ("Targets: Redis at most 64 MB above idle, server and finalize at most 300 MB each, nothing lost, "
        "the small batch done within 2 minutes. The worker's RSS is its engine's (model, KV pool, C++ "
        "kernels); finalize also runs inline in it, and alone in a fresh process for its own row.")
MiB = 1024 * 1024

FINALIZE_AGAIN = """
import json, sys, time, redis
from sluice.contract.batch import BatchStore
from sluice.contract.storage import open_storage
from sluice.worker.finalize import write_outputs
connection = redis.Redis.from_url(sys.argv[1])
batch = BatchStore(connection).get(sys.argv[2])
start = time.monotonic()
_, _, merged = write_outputs(open_storage(batch.output_url), connection, batch)
seconds = time.monotonic() - start
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "hwm_kib": hwm, "completed": merged.completed}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib(pid: int) -> float:
    """VmHWM (peak resident set) of a live process, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def wait_until(check, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what} after {timeout} s")


def write_input(path: Path, lines: int, line_bytes: int, tag: str) -> int:
    """A JSONL of `lines` completions padded to about line_bytes each; returns its size."""
    with path.open("w") as f:
        for i in range(lines):
            body = {"prompt": f"the quick brown fox {i}", "max_tokens": 1, "temperature": 0}
            line = {"custom_id": f"{tag}{i}", "method": "POST", "url": "/v1/completions", "body": body}
            pad = line_bytes - len(json.dumps(line)) - len(', "metadata": {"pad": ""}') - 1
            body["metadata"] = {"pad": "x" * max(0, pad)}
            f.write(json.dumps(line) + "\n")
    return path.stat().st_size


class RedisMemory(threading.Thread):
    """Samples INFO memory's used_memory until stopped; keeps the peak."""

    def __init__(self, connection, every: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.connection, self.every, self.peak, self.stop = connection, every, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.connection.info("memory")["used_memory"])
            time.sleep(self.every)


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def submit(api, path: Path, tag: str) -> tuple[str, float]:
    """Upload path and create a batch from it; returns the batch id and the seconds both calls took."""
    began = time.monotonic()
    with path.open("rb") as f:
        uploaded = api.files.create(file=(path.name, f), purpose="batch")
    batch = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.status == "in_progress", f"{tag} batch {batch.status}: {batch.errors}"
    return batch.id, time.monotonic() - began


class Stack:
    """redis-server, `sluice serve` and the workers, in a temp folder; an API client per project."""

    def __init__(self, args: argparse.Namespace) -> None:
        import redis

        self.tmp = Path(tempfile.mkdtemp(prefix="sluice-large-batch-"))
        self.processes: list[subprocess.Popen] = []
        redis_port, self.port = free_port(), free_port()
        redis_cmd = [shutil.which("redis-server"), "--port", str(redis_port), "--save", "",
                     "--appendonly", "no"]
        self.processes.append(start(redis_cmd, dict(os.environ), self.tmp / "redis.log"))
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self.connection = redis.Redis.from_url(self.redis_url)
        wait_until(lambda: _pings(self.connection), 30, "redis-server did not start")
        self.env = dict(os.environ, SLUICE_REDIS_URL=self.redis_url, PYTHONUNBUFFERED="1",
                        SLUICE_OUTPUT_URL=(self.tmp / "results").as_uri(),
                        SLUICE_SHARD_SIZE=str(args.shard_size), SLUICE_SHARD_WINDOW=str(args.window))
        serve = [str(SLUICE), "serve", "--port", str(self.port), "--max-file-mb", "200"]
        self.server = start(serve, self.env, self.tmp / "server.log")
        worker = [sys.executable, "-m", "sluice.worker", "--model", str(MODEL), "--device", "cpu",
                  "--max-num-seqs", str(args.max_num_seqs)]
        self.workers = [start(worker, self.env, self.tmp / f"worker{i}.log") for i in range(args.workers)]
        self.processes += [self.server, *self.workers]

    def api(self, project: str):
        """An OpenAI client with a fresh key of project."""
        import openai

        from sluice.producer.server.keys import KeyStore

        secret = KeyStore(self.connection).create(project)[1]
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=secret, max_retries=0,
                             timeout=3600)

    def stop(self, keep: bool) -> None:
        for p in reversed(self.processes):
            p.terminate()
        for p in self.processes:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if not keep:
            shutil.rmtree(self.tmp, ignore_errors=True)


def run(args: argparse.Namespace) -> dict:
    """The large batch and the small one through a fresh stack; what was measured."""
    stack = Stack(args)
    try:
        big_api, small_api = stack.api("big"), stack.api("small")
        wait_until(lambda: _answers(big_api), 120, "the server did not answer")
        big_size = write_input(stack.tmp / "big.jsonl", args.lines, args.line_bytes, "b")
        write_input(stack.tmp / "small.jsonl", args.small, 200, "s")
        wait_until(lambda: stack.connection.hlen("sluice:models") >= 1, 300, "no worker became ready")
        time.sleep(2)
        idle = stack.connection.info("memory")["used_memory"]
        sampler = RedisMemory(stack.connection)
        sampler.start()
        began = time.monotonic()
        big_id, big_submit = submit(big_api, stack.tmp / "big.jsonl", "large")
        wait_until(lambda: big_api.batches.retrieve(big_id).request_counts.completed > 0, 600,
                   "the large batch did not start")
        small = run_small(small_api, stack.tmp / "small.jsonl")
        small["big_done"] = sum(dict(big_api.batches.retrieve(big_id).request_counts).get(k, 0)
                                for k in ("completed", "failed"))
        big = wait_until(lambda: _done(big_api, big_id), 4 * 3600, "the large batch did not finish", poll=1)
        wall = time.monotonic() - began
        sampler.stop.set()
        sampler.join()
        return {
            "lines": args.lines, "input_mb": big_size / MB, "workers": args.workers,
            "shard_size": args.shard_size, "window": args.window,
            "redis_idle_mib": idle / MiB, "redis_peak_above_idle_mib": (sampler.peak - idle) / MiB,
            "server_rss_mib": peak_rss_mib(stack.server.pid),
            "worker_rss_mib": max(peak_rss_mib(w.pid) for w in stack.workers),
            "batch_finalize_s": big.completed_at - big.finalizing_at, "submit_s": big_submit, "wall_s": wall,
            "completed": big.request_counts.completed, "failed": big.request_counts.failed,
            **output_check(stack.tmp / "results" / big_id / "output.jsonl", args.lines),
            **merge_again(stack, big_id), **small,
        }
    finally:
        stack.stop(args.keep)


def run_small(api, path: Path) -> dict:
    """Submit the small batch and wait for it; its seconds from submit to done and its status."""
    began = time.monotonic()
    small_id, _ = submit(api, path, "small")
    small = wait_until(lambda: _done(api, small_id), 3600, "the small batch did not finish")
    return {"small_s": time.monotonic() - began, "small_status": small.status}


def merge_again(stack: Stack, batch_id: str) -> dict:
    """Finalize's merge of the batch run again in a fresh process: its peak RSS and seconds."""
    again = subprocess.run([sys.executable, "-c", FINALIZE_AGAIN, stack.redis_url, batch_id], env=stack.env,
                           capture_output=True, text=True, check=True)
    merge = json.loads(again.stdout.strip().splitlines()[-1])
    return {"finalize_rss_mib": merge["hwm_kib"] / 1024, "finalize_s": merge["seconds"]}


def output_check(path: Path, lines: int) -> dict:
    """Requests missing from an output file, and lines beyond one per custom_id (read a line at a time)."""
    ids, count = set(), 0
    with path.open("rb") as f:
        for line in f:
            ids.add(json.loads(line)["custom_id"])
            count += 1
    return {"lost": lines - len(ids), "duplicates": count - len(ids)}


def _pings(connection) -> bool:
    try:
        return connection.ping()
    except Exception:
        return False


def _answers(api) -> bool:
    try:
        api.batches.list(limit=1)
        return True
    except Exception:
        return False


def _done(api, batch_id: str):
    batch = api.batches.retrieve(batch_id)
    return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None


def table(r: dict, command: str) -> str:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")]
    model = names[0] if names else "?"
    rows = [
        ("input", f"{r['lines']:,} lines, {r['input_mb']:.1f} MB (sluice-tiny, max_tokens 1)"),
        ("workers / shard size / window", f"{r['workers']} / {r['shard_size']} / {r['window']}"),
        ("Redis used_memory, peak above idle", f"{r['redis_peak_above_idle_mib']:.1f} MiB "
                                              f"(idle {r['redis_idle_mib']:.1f} MiB)"),
        ("server peak RSS (upload, validation)", f"{r['server_rss_mib']:.0f} MiB"),
        ("worker peak RSS (shards, finalize inline)", f"{r['worker_rss_mib']:.0f} MiB"),
        ("finalize merge alone: peak RSS, time", f"{r['finalize_rss_mib']:.0f} MiB, {r['finalize_s']:.1f} s"),
        ("batch finalizing -> completed", f"{r['batch_finalize_s']:.1f} s"),
        ("upload + create (validation, enqueue)", f"{r['submit_s']:.1f} s"),
        ("wall time, upload to completed", f"{r['wall_s']:.0f} s"),
        ("completed / failed / lost / duplicated",
         f"{r['completed']:,} / {r['failed']} / {r['lost']} / {r['duplicates']}"),
        ("10-line batch behind it: submit to done",
         f"{r['small_s']:.1f} s ({r['small_status']}; the large one had {r['big_done']:,} requests done)"),
    ]
    lines = [f"## {SECTION}", "",
             f"`{command}` ({datetime.now(UTC):%Y-%m-%d %H:%M UTC}, CPU: {model}, {os.cpu_count()} CPUs, "
             "shared host)", "", "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", *textwrap.wrap(NOTE, 110)]
    return "\n" + "\n".join(lines) + "\n"


def write_table(text: str, path: Path) -> None:
    """The section in place of the benchmark's previous one (bench/common.replace_section)."""
    from common import replace_section

    path.write_text(replace_section(path.read_text() if path.exists() else "", SECTION, text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--line-bytes", type=int, default=3990, help="bytes per line, newline included")
    parser.add_argument("--small", type=int, default=10, help="lines of the batch submitted behind it")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--window", type=int, default=8, help="SLUICE_SHARD_WINDOW")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (logs, files)")
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result, indent=1))
    text = table(result, "python " + shlex.join(["bench/large_batch.py", *sys.argv[1:]]))
    print(text)
    if not args.no_write:
        write_table(text, args.out)


if __name__ == "__main__":
    main()
