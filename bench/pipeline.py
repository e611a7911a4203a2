"""The throughput workload through producer → Redis → one worker → storage vs LLM.generate, same run;
plus the producer's enqueue rate for a large file.

python bench/pipeline.py [--num-requests 128] [--enqueue-requests 100000] [--device auto] [--small]
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from common import base_parser, bench_model, record, table, timed, workload

from sluice.engine import LLM, SamplingParams
from sluice.producer import Client
from tests.checkpoints import make_checkpoint
from tests.services import free_port, start_worker, stop_worker, wait_for_port


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*cmd, "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    wait_for_port(port)
    return proc, f"redis://127.0.0.1:{port}/0"


def lines_for(reqs, prefix: str = "r") -> list[dict]:
    """OpenAI batch lines: token-id prompts, greedy, ignore_eos, per-request max_tokens."""
    return [
        {
            "custom_id": f"{prefix}{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": p, "max_tokens": m, "temperature": 0, "ignore_eos": True},
        }
        for i, (p, m) in enumerate(reqs)
    ]


def run_pipeline(model: Path, reqs, args, redis_url: str, out_dir: Path) -> tuple[int, float]:
    """Output tokens and seconds (best of the rounds) from submit to `completed` through one worker
    process."""
    log = out_dir.parent / "worker.log"
    threads = str(args.threads)
    worker = start_worker(
        model, redis_url, log, dtype=args.dtype, device=args.device, OMP_NUM_THREADS=threads
    )
    try:
        client = Client(redis_url)
        warm = client.submit_batch(lines_for(reqs[:2], "warm"), output=out_dir.as_uri())
        client.wait(warm.id, timeout=900, progress=False)
        return min(pipeline_round(client, reqs, out_dir) for _ in range(args.rounds))[::-1]
    finally:
        stop_worker(worker, timeout=60)


def pipeline_round(client: Client, reqs, out_dir: Path) -> tuple[float, int]:
    """Seconds from submit to `completed`, and output tokens, of one batch."""
    t = time.perf_counter()
    batch = client.submit_batch(lines_for(reqs), output=out_dir.as_uri())
    done = client.wait(batch.id, timeout=3600, progress=False, poll=0.02)
    dt = time.perf_counter() - t
    if done.request_counts.completed != len(reqs):
        first = next(client.results(batch.id, errors=True))
        raise RuntimeError(f"{done.request_counts}: {first.error}")
    return dt, sum(r.response.body["usage"]["completion_tokens"] for r in client.results(batch.id))


def run_engine(model: Path, reqs, args) -> tuple[int, float]:
    """Output tokens and seconds of LLM.generate on the same requests (best of the rounds)."""
    llm = LLM(str(model), dtype=args.dtype, device=args.device)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([p for p, _ in reqs[:2]], warm, progress=False)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
    best = None
    for _ in range(args.rounds):
        outs, dt = timed(lambda: llm.generate([p for p, _ in reqs], params, progress=False))
        best = dt if best is None else min(best, dt)
    llm = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return sum(len(o.token_ids) for o in outs), best


def enqueue_rate(n: int, redis_url: str, workdir: Path) -> tuple[float, int]:
    """Seconds to validate and enqueue an n-request JSONL file, and its size in bytes."""
    path = workdir / "big.jsonl"
    with path.open("w") as f:
        for i in range(n):
            body = {
                "prompt": f"request number {i}: summarise the weather",
                "max_tokens": 64,
                "temperature": 0,
            }
            f.write(
                json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": body})
                + "\n"
            )
    client = Client(redis_url)
    client.connection.flushall()
    t = time.perf_counter()
    batch = client.submit_batch(str(path), output=(workdir / "unused").as_uri())
    dt = time.perf_counter() - t
    assert batch.status.value == "in_progress" and batch.request_counts.total == n, batch.errors[:3]
    return dt, path.stat().st_size


def parse_args():
    """The benchmark's command line."""
    p = base_parser(__doc__)
    p.add_argument("--enqueue-requests", type=int, default=100_000)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=1, help="timed runs of each path; the best counts")
    p.add_argument("--small", action="store_true", help="tiny model and workload: a quick smoke run")
    return p.parse_args()


def model_and_workload(args, work: Path) -> tuple[Path, list, str]:
    """The checkpoint (tiny with --small, else the ~125M one), its requests and their description."""
    if args.small:
        model = make_checkpoint(work / "tiny", "llama")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        reqs = workload(args.num_requests, prompt_range=(8, 64), out_range=(4, 32), vocab=vocab)
        return model, reqs, "tiny random Llama (4 layers, hidden 64)"
    return (bench_model(), workload(args.num_requests),
            "random Llama ~125M, prompt U(32,512), max_tokens U(16,256)")


def main() -> None:
    """Time the pipeline end to end, the engine alone and the producer's enqueue rate; record the table."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-pipeline-"))
    model, reqs, what = model_and_workload(args, work)
    roots = os.environ.get("SLUICE_OUTPUT_ROOTS", "")  # the producer and worker allow output under `work` too
    os.environ["SLUICE_OUTPUT_ROOTS"] = f"{roots},{work.as_uri()}" if roots else work.as_uri()
    redis_proc, redis_url = start_redis(work)
    try:
        e2e_tokens, e2e_dt = run_pipeline(model, reqs, args, redis_url, work / "results")
        eng_tokens, eng_dt = run_engine(model, reqs, args)
        enq_dt, enq_bytes = enqueue_rate(args.enqueue_requests, redis_url, work)
    finally:
        redis_proc.terminate()
        redis_proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    e2e, eng = e2e_tokens / e2e_dt, eng_tokens / eng_dt
    rows = [
        ["LLM.generate (engine only)", len(reqs), eng_tokens, eng_dt, eng, 1.0],
        ["producer → Redis → 1 worker → file storage", len(reqs), e2e_tokens, e2e_dt, e2e, e2e / eng],
    ]
    body = table(["path", "requests", "output tokens", "seconds", "output tok/s", "× engine"], rows)
    body += (
        f"\n\nWorkload: {what}, {args.dtype} on {args.device}, {len(reqs)} requests, ignore_eos, greedy, "
        f"seed 0; best of {args.rounds} round(s) each. "
        "End to end is timed from submit_batch to the batch reading `completed` (validation, rq jobs, the "
        "worker's engine loop, shard write, finalize merge), with the worker's model already loaded and "
        f"warmed.\n\nProducer enqueue rate: {args.enqueue_requests} requests ({enq_bytes / 1e6:.1f} MB "
        f"JSONL) validated and enqueued in {enq_dt:.2f} s = {args.enqueue_requests / enq_dt:,.0f} requests/s "
        "(shards of 256)."
    )
    record("Pipeline", body)


if __name__ == "__main__":
    main()
