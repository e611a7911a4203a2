"""Worker metrics (Prometheus) and health on `--metrics-port`: /metrics, /healthz, /readyz (model loaded and
warmed)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from sluice.contract.jobs import MODELS
from sluice.engine import PoolingParams, SamplingParams
from sluice.worker.shard_run import model_name

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from sluice.engine import LLM

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def process_start_time() -> float:
    """Unix time this process started: now less its age, the boot clock's reading less the start tick in /proc
    (clock ticks). Not /proc/stat's btime, which is whole seconds and drifts from the wall clock (it put
    starts early: docs/benchmarks.md, coldstart). The import time where /proc is missing."""
    try:
        ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, AttributeError):  # no /proc, or no CLOCK_BOOTTIME (not Linux)
        return _IMPORTED


_IMPORTED = time.time()


class Readiness:
    """A worker's readiness without `--metrics-port`: its time to ready (logged), nothing kept per step or
    shard (no one could read it; prometheus_client is not even imported)."""

    is_ready = False

    def instrument(self, llm: LLM) -> None:
        """Nothing to time without a metrics server."""

    def shard_finished(self, outcome: str) -> None:
        """Nothing to count without a metrics server."""

    def ready(self) -> float:
        """Mark the worker ready; returns the seconds since the process started."""
        self.is_ready = True
        return time.time() - process_start_time()


class WorkerMetrics(Readiness):
    """The worker's Prometheus series, in a registry of their own."""

    def __init__(self, model: str = "") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model": model}
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter("sluice_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("sluice_requests", "Finished requests by outcome.", ["outcome"], registry=r)
        self.shards = Counter("sluice_shards", "Shards finished by outcome.", ["outcome"], registry=r)
        self.step_seconds = Histogram(
            "sluice_step_seconds", "Engine step time.", buckets=STEP_BUCKETS, registry=r
        )
        self.kv_usage = Gauge("sluice_kv_cache_usage_ratio", "Fraction of KV blocks in use.", registry=r)
        self.running = Gauge("sluice_requests_running", "Requests running in the engine.", registry=r)
        self.waiting = Gauge("sluice_requests_waiting", "Requests waiting in the engine.", registry=r)
        self.time_to_ready = Gauge(
            "sluice_time_to_ready_seconds", "Process start to ready to claim.", registry=r
        )
        self.ready_flag = Gauge("sluice_worker_ready", "1 once the model is loaded and warmed.", registry=r)
        self.info = Gauge("sluice_worker_info", "The model this worker serves.", ["model"], registry=r)
        self.info.labels(**labels).set(1)
        self._seen = {"prompt_tokens": 0, "generated_tokens": 0}

    def instrument(self, llm: LLM) -> None:
        """Time every llm.step and count its finished requests and tokens (a step observer of the LLM's)."""

        def observe(outs: list, seconds: float) -> None:
            self.step_seconds.observe(seconds)
            for out in outs:
                self.requests.labels("error" if out.error else (out.finish_reason or "unknown")).inc()
            self.sample(llm)

        llm.add_step_observer(observe)
        self.sample(llm)

    def sample(self, llm: LLM) -> None:
        """Refresh the engine gauges and token counters from llm.stats()."""
        stats = llm.stats()
        self.kv_usage.set(stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"]))
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        for name, counter in (
            ("prompt_tokens", self.prompt_tokens),
            ("generated_tokens", self.generation_tokens),
        ):
            counter.inc(max(0, stats[name] - self._seen[name]))
            self._seen[name] = stats[name]

    def shard_finished(self, outcome: str) -> None:
        self.shards.labels(outcome).inc()

    def ready(self) -> float:
        """Mark the worker ready; returns (and records) the seconds since the process started."""
        seconds = super().ready()
        self.time_to_ready.set(seconds)
        self.ready_flag.set(1)
        return seconds


# WorkerMetrics under `sluice worker --metrics-port`; hook lines call it always
METRICS: Readiness = Readiness()


def shard_finished(outcome: str) -> None:
    """Count a finished shard ('completed' or 'failed')."""
    METRICS.shard_finished(outcome)


def warm_up(llm: LLM) -> int:
    """One request of one prompt token and one generated token: a step that runs the model end to end (every
    layer, the LM head, the sampler) and pays the kernels' lazy set-up before the first claim; returns the
    steps it took (1). A decode step too, or a longer prompt, would add a pass over the weights to every start
    and pay nothing the first request does not pay anyway (milliseconds: docs/benchmarks.md, coldstart)."""
    generate = llm.runner_type == "generate"  # an encoder warms up on one embedding
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True) if generate else PoolingParams()
    llm.add_request("warmup", [1], params)
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    return steps


def announce(connection: Any, model: str) -> None:
    """Tell `GET /v1/models` that a worker serves model."""
    connection.hset(MODELS, model, time.time())


def health_app(metrics: WorkerMetrics) -> Callable:
    """WSGI app: /metrics (Prometheus text), /healthz (alive), /readyz (200 once ready, else 503)."""
    from prometheus_client import make_wsgi_app

    prometheus = make_wsgi_app(metrics.registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _text(start_response, "200 OK", b"ok")
        if path == "/readyz":
            return _text(
                start_response,
                *(("200 OK", b"ready") if metrics.is_ready else ("503 Service Unavailable", b"loading")),
            )
        return prometheus(environ, start_response)

    return app


def _text(start_response: Callable, status: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


def serve_metrics(port: int, metrics: WorkerMetrics, host: str = "0.0.0.0") -> WSGIServer:
    """Serve health_app on port from a daemon thread (started before the model loads, so /healthz answers).
    The HTTP server's modules load here, only where a port is given: a worker without one never imports
    them."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    server = make_server(host, port, health_app(metrics), Server, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def start_metrics(port: int | None, model: str) -> Readiness:
    """The process's metrics, served on port when one is given (before loading, so liveness answers); without
    a port only its readiness (no Prometheus series: nothing could scrape them)."""
    global METRICS
    if not port:
        METRICS = Readiness()
        return METRICS
    metrics = WorkerMetrics(os.path.basename(os.path.normpath(model)))
    serve_metrics(port, metrics)
    METRICS = metrics
    return metrics


def become_ready(metrics: Readiness, llm: LLM, connection: Any, warm: bool = True) -> float:
    """Warm the engine up, instrument it, announce its model and mark the worker ready; returns time to
    ready."""
    if warm:
        warm_up(llm)
    metrics.instrument(llm)
    announce(connection, model_name(llm))
    seconds = metrics.ready()
    logging.getLogger("sluice.worker").info(
        "ready in %.2f s (process start to first claim possible)", seconds
    )
    return seconds
