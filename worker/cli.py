"""The worker's command line, `python -m sluice.worker ...` and `sluice worker ...`: one engine fed from the
queues.

The engine flags (--dtype, --max-num-seqs, --speculative, ...) are generated from `EngineConfig`'s fields.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import redis
import typer

from sluice.contract.jobs import QUEUES
from sluice.contract.logs import configure as configure_logging
from sluice.contract.redis_conn import connect
from sluice.contract.settings import Settings, adapter_cache, get_settings, stay_off_the_hub
from sluice.engine import LLM, weight_reserve
from sluice.worker import collector, engine_flags
from sluice.worker.adapters import Adapters, AdapterSpecError
from sluice.worker.background import supervised
from sluice.worker.metrics import announce, become_ready, start_metrics
from sluice.worker.prefetch import process_reservation
from sluice.worker.worker import EngineWorker

MODEL_HELP = f"{engine_flags.field_help('model')} Default: $SLUICE_MODEL."
TTL_HELP = ("Seconds before a silent worker's shards count as abandoned (default: $SLUICE_HEARTBEAT_TTL "
            "or 30).")
GRACE_HELP = "Seconds to finish in-flight shards after SIGTERM before handing back."
METRICS_HELP = "Serve Prometheus /metrics, /healthz and /readyz (ready once loaded and warmed) here."
REDIS_HELP = "Redis URL (default: $SLUICE_REDIS_URL or redis://127.0.0.1:6379/0)"
LORA_HELP = ("A LoRA adapter lines may name as their model: NAME=PATH (a PEFT folder, local or s3://); "
             "repeatable.")
LORA_DIR_HELP = ("A folder of PEFT adapter folders (local or s3://), each served under its folder's name, "
                 "found when a line first names it; repeatable.")


def start(
    engine_args: dict[str, Any],
    model: str | None = typer.Option(None, "--model", help=MODEL_HELP, show_default=False),
    queues: str = typer.Option(",".join(QUEUES), help="Queues in priority order."),
    burst: bool = typer.Option(False, "--burst", help="Exit once the queues are empty."),
    heartbeat_ttl: int | None = typer.Option(None, help=TTL_HELP),
    grace: float = typer.Option(60.0, help=GRACE_HELP),
    name: str | None = typer.Option(None, help="Worker name (default: rq's)."),
    webhooks: bool = typer.Option(
        True, "--webhooks/--no-webhooks", help="Also deliver webhook events from a background thread."
    ),
    metrics_port: int | None = typer.Option(None, help=METRICS_HELP),
    log_format: str = typer.Option("text", help="text or json (one object per line, with batch/job ids)."),
    redis_url: str | None = typer.Option(None, "--redis-url", help=REDIS_HELP),
    lora: list[str] | None = typer.Option(None, "--lora", help=LORA_HELP),
    lora_dir: list[str] | None = typer.Option(None, "--lora-dir", help=LORA_DIR_HELP),
) -> None:
    """Run a GPU worker: one engine kept full with shards from the queues."""
    collector.resume()  # imported: the collector runs again, over what is made from here on
    stay_off_the_hub()
    settings = get_settings()
    model = model or settings.model
    if not model:
        raise typer.BadParameter("give --model or set SLUICE_MODEL", param_hint="--model")
    configure_logging(log_format)
    adapters = _adapters(lora or [], lora_dir or [], settings, engine_args)
    metrics = start_metrics(metrics_port, model)
    llm = load(model, {**settings.json_bounds(), **engine_args})
    connection = connect(redis_url or settings.redis_url)
    become_ready(metrics, llm, connection)
    for adapter in adapters.names():
        announce(connection, adapter)
    ttl = heartbeat_ttl or settings.heartbeat_ttl
    w = EngineWorker(
        queues.split(","), llm, connection, heartbeat_ttl=ttl, grace=grace, name=name, settings=settings,
        adapters=adapters,
    )
    _work(w, connection, settings, webhooks, burst)


def _adapters(lora: list[str], lora_dir: list[str], settings: Settings,
              engine_args: dict[str, Any]) -> Adapters:
    """The --lora / --lora-dir adapters (LoRA switched on in engine_args where there are any)."""
    try:
        adapters = Adapters.from_flags(lora, lora_dir, cache=adapter_cache(settings.xdg_cache_home),
                                       s3_style=settings.s3_addressing_style)
    except AdapterSpecError as exc:
        raise typer.BadParameter(str(exc), param_hint="--lora") from None
    if adapters:
        engine_args.setdefault("enable_lora", True)
    return adapters


def _work(w: EngineWorker, connection: redis.Redis, settings: Settings, webhooks: bool, burst: bool) -> None:
    """Run the worker, with webhook delivery in a supervised background thread while it runs."""
    stop = threading.Event()
    if webhooks:
        supervised("webhooks", lambda stop: deliver_webhooks(connection, settings, stop), stop)
    try:
        w.work(burst=burst)
    finally:
        stop.set()


def load(model: str, engine_args: dict[str, Any]) -> LLM:
    """The engine on `model`, handed the weight arena reserved at the process's start
    (worker.prefetch.reserve_for), which is unmapped afterwards if the load did not take it."""
    reservation = process_reservation()
    try:
        return LLM(model, weight_reservation=reservation, **engine_args)
    finally:
        weight_reserve.discard(reservation)


def deliver_webhooks(connection: redis.Redis, settings: Settings, stop: threading.Event) -> None:
    """The webhook delivery loop; its modules (urllib3, signing) load here, in its own thread, off the
    start-up."""
    from sluice.contract.signing import WebhookSettings
    from sluice.worker import webhooks as delivery

    delivery.run(connection, settings=WebhookSettings.of(settings), stop=stop)


def worker(**options: Any) -> None:
    """Run a GPU worker: one engine kept full with shards from the queues."""
    start(engine_flags.engine_kwargs(options), **options)


_own = list(inspect.signature(start, eval_str=True).parameters.values())[1:]
worker.__signature__ = inspect.Signature(_own + engine_flags.parameters())  # type: ignore[attr-defined]
