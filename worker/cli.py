"""The worker's command line, `python -m worker ...` and `sluice worker ...`: one engine fed from the queues."""

from __future__ import annotations

import json
import threading

import redis
import typer

from contract.logs import configure as configure_logging
from contract.settings import get_settings
from worker import webhooks as delivery
from worker.metrics import become_ready, start_metrics
from worker.worker import EngineWorker

RedisUrl = typer.Option(
    None, "--redis-url", help="Redis URL (default: $SLUICE_REDIS_URL or redis://127.0.0.1:6379/0)"
)


def worker(
    model: str = typer.Option(..., "--model", envvar="SLUICE_MODEL", help="Hugging Face checkpoint folder."),
    queues: str = typer.Option("high,default,low", help="Queues in priority order."),
    burst: bool = typer.Option(False, "--burst", help="Exit once the queues are empty."),
    dtype: str = typer.Option("auto"),
    device: str = typer.Option("auto"),
    quantization: str = typer.Option(None),
    kv_cache_dtype: str = typer.Option("auto"),
    max_num_seqs: int = typer.Option(256),
    max_num_batched_tokens: int = typer.Option(4096),
    max_model_len: int = typer.Option(None),
    block_size: int = typer.Option(16),
    kv_cache_memory_gb: float = typer.Option(None),
    gpu_memory_utilization: float = typer.Option(0.9),
    speculative: str = typer.Option(
        None, help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'.'
    ),
    enable_prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching"),
    seed: int = typer.Option(0),
    heartbeat_ttl: int = typer.Option(
        None, help="Seconds before a silent worker's shards count as abandoned."
    ),
    grace: float = typer.Option(
        60.0, help="Seconds to finish in-flight shards after SIGTERM before handing back."
    ),
    name: str = typer.Option(None, help="Worker name (default: rq's)."),
    webhooks: bool = typer.Option(
        True, "--webhooks/--no-webhooks", help="Also deliver webhook events from a background thread."
    ),
    metrics_port: int = typer.Option(
        None, help="Serve Prometheus /metrics, /healthz and /readyz (ready once loaded and warmed) here."
    ),
    log_format: str = typer.Option("text", help="text or json (one object per line, with batch/job ids)."),
    redis_url: str = RedisUrl,
) -> None:
    """Run a GPU worker: one engine kept full with shards from the queues."""
    from engine import LLM  # imports torch: only once a worker really starts, so `sluice --help` stays fast

    configure_logging(log_format)
    metrics = start_metrics(metrics_port, model)
    settings = get_settings()
    engine_args = dict(
        dtype=dtype,
        device=device,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_cache_memory_gb=kv_cache_memory_gb,
        gpu_memory_utilization=gpu_memory_utilization,
        speculative=json.loads(speculative) if speculative else None,
        enable_prefix_caching=enable_prefix_caching,
        seed=seed,
    )
    llm = LLM(model, **engine_args)
    connection = redis.Redis.from_url(redis_url or settings.redis_url)
    become_ready(metrics, llm, connection)
    ttl = heartbeat_ttl or settings.heartbeat_ttl
    w = EngineWorker(queues.split(","), llm, connection, heartbeat_ttl=ttl, grace=grace, name=name)
    stop = threading.Event()
    if webhooks:
        threading.Thread(target=delivery.run, args=(connection,), kwargs={"stop": stop}, daemon=True).start()
    try:
        w.work(burst=burst)
    finally:
        stop.set()
