"""`make demo`: a local Redis, one worker on the bundled model, examples/prompts.jsonl (completions) and
examples/chats.jsonl through the pipeline.

Starts a `redis-server` on a free port unless one answers at SLUICE_REDIS_URL, submits the example batches
(one per file: a batch's lines all name one url) with output under ./results/, starts a burst worker, shows
progress, prints a few completions and a summary, and stops everything it started (on success, errors and
Ctrl-C alike).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sluice.contract.redis_conn import connect
from sluice.contract.schemas import Batch, BatchStatus, OutputRecord
from sluice.contract.settings import get_settings
from sluice.producer.client import Client

ROOT = Path(__file__).resolve().parent.parent
INPUTS = [ROOT / "examples" / "prompts.jsonl", ROOT / "examples" / "chats.jsonl"]
TIMEOUT_S = 1800
# the worker's line once its model is loaded, its C++ kernels built or loaded and one step warmed
# (worker.metrics)
READY = re.compile(r"ready in ([0-9.]+) s \(process start")
console = Console()


def reachable(url: str) -> bool:
    """True if a Redis server answers PING at url."""
    try:
        return bool(connect(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after grace seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def local_redis(url: str) -> Iterator[str]:
    """The URL of a Redis: url (SLUICE_REDIS_URL's) if it answers, else a fresh redis-server on a free
    port."""
    if reachable(url):
        console.print(f"[dim]using the Redis at {url}[/]")
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(f"no Redis at {url} and no redis-server to start (apt-get install redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sluice-demo-redis-") as workdir:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        proc = subprocess.Popen(
            [*args, "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + 10
            while not reachable(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"redis-server did not start on port {port}")
                time.sleep(0.05)
            console.print(f"[dim]started redis-server on port {port}[/]")
            yield url
        finally:
            stop(proc)


def ready_seconds(log: Path) -> float | None:
    """The worker's seconds from process start to ready (its "ready in" log line), None before it is ready."""
    found = READY.search(log.read_text(errors="replace")) if log.exists() else None
    return float(found.group(1)) if found else None


@contextlib.contextmanager
def worker_process(url: str, log: Path, output_roots: str, model: Path) -> Iterator[subprocess.Popen]:
    """One burst worker process on model allowed to write under output_roots, its output in log."""
    cmd = ["env", f"SLUICE_OUTPUT_ROOTS={output_roots}", sys.executable, "-m", "sluice.worker", "--redis-url",
           url]
    cmd += ["--queues", "high,default,low"]
    cmd += ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--burst"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        console.print(f"[dim]started worker (pid {proc.pid}), log in {log}[/]")
        try:
            yield proc
        finally:
            stop(proc)


def wait(client: Client, batch: Batch, proc: subprocess.Popen, log: Path) -> Batch:
    """Poll until the batch is done, with a progress bar; fail fast if the worker dies first."""
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    deadline = time.monotonic() + TIMEOUT_S
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(batch.id, total=batch.request_counts.total)
        while not batch.done:
            if proc.poll() is not None and not client.get(batch.id).done:
                tail = log.read_text()[-3000:]
                raise SystemExit(f"worker exited with {proc.returncode} before the batch finished:\n{tail}")
            if time.monotonic() > deadline:
                raise SystemExit(f"batch {batch.id} still {batch.status.value} after {TIMEOUT_S} s")
            time.sleep(0.25)
            batch = client.get(batch.id)
            counts = batch.request_counts
            progress.update(task, completed=counts.completed + counts.failed, description=batch.status.value)
    return batch


def text_of(record: OutputRecord) -> str:
    """The completion text or chat reply of one output record."""
    if record.response is None:
        return f"[error] {record.error.code if record.error else '?'}"
    choice = record.response.body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def show(records: list[OutputRecord], prompts: dict[str, str], count: int = 6) -> None:
    table = Table(title="A few completions", show_lines=True)
    table.add_column("custom_id", style="cyan", no_wrap=True)
    table.add_column("prompt", style="magenta")
    table.add_column("completion")
    picks = (
        records[: count - 2]
        + [r for r in records if r.custom_id in prompts and "User." in prompts[r.custom_id]][:2]
    )
    for record in picks:
        table.add_row(
            record.custom_id, prompts.get(record.custom_id, ""), text_of(record).strip().replace("\n", " / ")
        )
    console.print(table)


def generation_seconds(wall: float, worker_offset: float, ready: float | None) -> float:
    """The batch's seconds after the worker was ready: the wall time less the worker's start (its process
    start to its "ready in" line: model load, kernel build or load, warm-up) and whatever preceded its
    spawn."""
    return wall - worker_offset - (ready or 0.0)


def summary(batches: list[Batch], records: list[OutputRecord], wall: float, worker_offset: float,
            ready: float | None) -> None:
    """The table after the run: counts, tokens/s with and without the worker's start, wall time, output."""
    tokens = sum(r.response.body["usage"]["completion_tokens"] for r in records if r.response)
    serving = generation_seconds(wall, worker_offset, ready)
    counts = [b.request_counts for b in batches]
    table = Table(title="Summary", show_header=False)
    for key, value in [
        ("batches", ", ".join(b.id for b in batches)),
        ("status", ", ".join(b.status.value for b in batches)),
        (
            "requests",
            f"{sum(c.total for c in counts)} ({sum(c.completed for c in counts)} completed, "
            f"{sum(c.failed for c in counts)} failed)",
        ),
        ("completion tokens", str(tokens)),
        ("worker start (load, kernels, warm-up)", "-" if ready is None else f"{ready:.1f} s"),
        ("tokens/s (worker ready to batches done)", f"{tokens / serving:.1f}" if serving > 0 else "-"),
        ("tokens/s (end to end, start included)", f"{tokens / wall:.1f}"),
        ("wall time", f"{wall:.1f} s"),
        ("output", "\n".join(b.output_file or "-" for b in batches)),
    ]:
        table.add_row(key, value)
    console.print(table)


def prompt_texts() -> dict[str, str]:
    """custom_id -> the prompt as shown in the table (chat turns flattened)."""
    out = {}
    for line in [line for path in INPUTS for line in path.read_text().splitlines()]:
        req = json.loads(line)
        body = req["body"]
        prompt = body.get("prompt") or " ".join(
            f"{m['role'].capitalize()}. {m['content']}" for m in body["messages"]
        )
        out[req["custom_id"]] = prompt.replace("\n", " ")
    return out


def submit(client: Client, path: Path, results: Path) -> Batch:
    """One example file as a batch (its lines all name one url); exits if it fails validation."""
    batch = client.submit_batch(input=str(path), output=results.as_uri(), metadata={"source": "demo"})
    if batch.status == BatchStatus.failed:
        raise SystemExit(f"batch of {path.name} failed validation: {batch.errors}")
    total = batch.request_counts.total
    console.print(f"submitted {total} requests of {path.name} as batch [bold]{batch.id}[/]")
    return batch


def main() -> int:
    settings = get_settings()
    results = settings.demo_results.resolve()
    results.mkdir(parents=True, exist_ok=True)
    roots = ",".join([*settings.output_root_urls(), results.as_uri()])
    console.rule("[bold]Sluice demo")
    with local_redis(settings.redis_url) as url:
        client = Client(url, settings.model_copy(update={"output_roots": roots}))
        start = time.monotonic()
        batches = [submit(client, path, results) for path in INPUTS]
        log = results / "demo-worker.log"
        worker_offset = time.monotonic() - start
        with worker_process(url, log, roots, settings.demo_model) as proc:
            batches = [wait(client, batch, proc, log) for batch in batches]
        wall = time.monotonic() - start
        records = [r for batch in batches for r in client.results(batch.id)]
    show(records, prompt_texts())
    summary(batches, records, wall, worker_offset, ready_seconds(log))
    completed = all(b.status == BatchStatus.completed for b in batches)
    return 0 if completed and len(records) == sum(b.request_counts.total for b in batches) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        console.print("[red]interrupted; stopped what the demo started[/]")
        sys.exit(130)
