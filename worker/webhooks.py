"""Reliable webhook delivery: the loop that sends queued events (contract.events) with backoff and logs each
attempt."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import typer
from redis import Redis
from urllib3.connection import HTTPConnection, HTTPSConnection

from sluice.contract.events import DUE_KEY, as_text, delivery_key, delivery_log, record_attempt
from sluice.contract.redis_conn import connect
from sluice.contract.settings import default_redis_url, get_settings
from sluice.contract.signing import (
    Target,
    UnsafeWebhookURL,
    WebhookSettings,
    parse_schedule,
    redact_url,
    redact_urls,
    resolve_target,
    sign_headers,
)
from sluice.worker.outage import OUTAGE, REDIS_ERRORS

log = logging.getLogger(__name__)

JITTER = 0.2

_CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], ARGV[2], id) end
return ids
"""


def claim_due(connection: Redis, limit: int, lease_s: float) -> list[str]:
    """Take up to limit due deliveries, pushing each out by lease_s so a dead deliverer's come back."""
    now = time.time()
    return [as_text(i) for i in connection.eval(_CLAIM, 1, DUE_KEY, now, now + lease_s, limit)]


def _connection(target: Target, timeout: float) -> HTTPConnection:
    """A connection to the checked address, with the URL's host name for Host, SNI and certificate checks."""
    if target.scheme == "https":
        return HTTPSConnection(
            target.address,
            target.port,
            timeout=timeout,
            server_hostname=target.host,
            assert_hostname=target.host,
        )
    return HTTPConnection(target.address, target.port, timeout=timeout)


def _cut(conn: HTTPConnection, expired: threading.Event) -> None:
    expired.set()
    if conn.sock is not None:
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)


def _post(
    target: Target, body: bytes, headers: dict[str, str], timeout: float, max_bytes: int
) -> tuple[int | None, str | None]:
    """POST body to the target within timeout seconds in all, reading at most max_bytes of the response."""
    headers = {**headers, "host": target.host_header, "content-type": "application/json",
               "user-agent": "sluice-webhooks/0.1", "connection": "close"}  # fmt: skip
    conn, expired = _connection(target, timeout), threading.Event()
    timer = threading.Timer(timeout, _cut, args=(conn, expired))
    timer.daemon = True
    started = time.monotonic()
    try:
        conn.connect()
        timer.interval = max(0.0, timeout - (time.monotonic() - started))
        timer.start()
        conn.request("POST", target.request_uri, body=body, headers=headers, preload_content=False,
                     decode_content=False)  # fmt: skip
        response = conn.getresponse()
        read = 0
        for chunk in response.stream(16 * 1024):
            read += len(chunk)
            if read >= max_bytes:
                break
        return response.status, None
    except Exception as exc:
        if expired.is_set() or time.monotonic() - started >= timeout:
            return None, f"Timeout: no complete response within {timeout:g} s"
        return None, redact_urls(f"{type(exc).__name__}: {exc}")
    finally:
        timer.cancel()
        conn.close()


def _send(delivery: dict[str, str], settings: WebhookSettings) -> tuple[int | None, str | None]:
    if settings.webhook_secret is None:
        return None, "SLUICE_WEBHOOK_SECRET is not set; refusing to send unsigned"
    try:
        target = resolve_target(delivery["url"], settings.webhook_allow)
    except UnsafeWebhookURL as exc:
        return None, f"refused: {redact_urls(str(exc))}"
    body = delivery["body"].encode()
    headers = sign_headers(settings.webhook_secret.get_secret_value(), delivery["event_id"], body)
    return _post(target, body, headers, settings.webhook_timeout, settings.webhook_max_response_bytes)


def _outcome(status: int | None, error: str | None, attempt: int, schedule: list[float]) -> str:
    if status is not None and 200 <= status < 300:
        return "delivered"
    if status == 410 or (error or "").startswith("refused:"):
        return "gone"
    return "retry" if attempt <= len(schedule) else "exhausted"


def attempt(connection: Redis, event_id: str, settings: WebhookSettings) -> str:
    """Make one delivery attempt, record it, and schedule the next one or finish; return the outcome."""
    raw = connection.hgetall(delivery_key(event_id))
    if not raw:
        connection.zrem(DUE_KEY, event_id)
        return "missing"
    delivery = {as_text(k): as_text(v) for k, v in raw.items()}
    number = connection.hincrby(delivery_key(event_id), "attempts", 1)
    started = time.time()
    try:
        status, error = _send(delivery, settings)
    except Exception as exc:
        status, error = None, redact_urls(f"{type(exc).__name__}: {exc}")
    schedule = parse_schedule(settings.webhook_retry_schedule)
    outcome = _outcome(status, error, number, schedule)
    entry = {
        "attempt": number,
        "event_id": event_id,
        "type": delivery["type"],
        "url": redact_url(delivery["url"]),
        "at": round(started, 3),
        "status_code": status,
        "error": error,
        "duration_ms": round((time.time() - started) * 1000),
        "outcome": outcome,
    }
    if outcome == "retry":
        entry["next_attempt_at"] = round(
            time.time() + schedule[number - 1] * random.uniform(1 - JITTER, 1 + JITTER), 3
        )
        connection.zadd(DUE_KEY, {event_id: entry["next_attempt_at"]})
    else:
        connection.zrem(DUE_KEY, event_id)
        connection.hset(delivery_key(event_id), "state", outcome)
    record_attempt(connection, delivery["batch_id"], entry)
    log.info(
        "webhook %s for batch %s attempt %d: %s", event_id, delivery["batch_id"], number, status or error
    )
    return outcome


def run(
    connection: Redis,
    settings: WebhookSettings,
    concurrency: int = 8,
    poll_s: float = 0.5,
    burst: bool = False,
    stop: threading.Event | None = None,
) -> None:
    """Deliver due events until stopped (or, with burst, until none is pending)."""
    stop = stop or threading.Event()
    lease_s = 3 * settings.webhook_timeout + 30
    with ThreadPoolExecutor(concurrency, thread_name_prefix="webhook") as pool:
        while not stop.is_set():
            try:
                due = claim_due(connection, concurrency, lease_s)
                OUTAGE.recovered()
                list(pool.map(lambda event_id: attempt(connection, event_id, settings), due))
                if burst and not connection.zcard(DUE_KEY):
                    return
            except REDIS_ERRORS as exc:  # one line per outage (worker/outage.py), not one per poll
                OUTAGE.failed("webhook delivery", exc)
                due = []
            except Exception as exc:
                log.error("webhook delivery: %s; carrying on", redact_urls(f"{type(exc).__name__}: {exc}"))
                due = []
            if not due:
                stop.wait(poll_s)


RedisURL = typer.Option(
    default_factory=default_redis_url, show_default=False, help="Redis URL (default: $SLUICE_REDIS_URL)"
)
webhooks_app = typer.Typer(help="Webhook delivery: the delivery process and per-batch delivery logs.")


@webhooks_app.command("run")
def run_command(
    redis_url: str = RedisURL,
    concurrency: int = typer.Option(8, min=1),
    poll: float = typer.Option(0.5, help="seconds between polls when nothing is due"),
    burst: bool = typer.Option(False, help="exit once nothing is pending"),
) -> None:
    """Run the delivery process (any number of them may share one Redis; webhook fields from Settings)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    hooks = WebhookSettings.of(get_settings())
    run(connect(redis_url), hooks, concurrency=concurrency, poll_s=poll, burst=burst)


@webhooks_app.command("log")
def log_command(
    batch_id: str,
    redis_url: str = RedisURL,
) -> None:
    """Print a batch's webhook delivery log."""
    for entry in delivery_log(connect(redis_url), batch_id):
        typer.echo(json.dumps(entry))


if __name__ == "__main__":
    webhooks_app()
