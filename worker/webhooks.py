"""Reliable webhook delivery: the loop that sends queued events (contract.events) with backoff and logs each attempt."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import typer
from redis import Redis

from contract.events import DUE_KEY, as_text, delivery_key, delivery_log, record_attempt
from contract.settings import default_redis_url
from contract.signing import UnsafeWebhookURL, WebhookSettings, check_url, parse_schedule, sign_headers

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


def _post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int | None, str | None]:
    headers = {**headers, "content-type": "application/json", "user-agent": "sluice-webhooks/0.1"}
    try:
        response = requests.post(url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
    except requests.RequestException as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return response.status_code, None


def _send(delivery: dict[str, str], settings: WebhookSettings) -> tuple[int | None, str | None]:
    if settings.webhook_secret is None:
        return None, "SLUICE_WEBHOOK_SECRET is not set; refusing to send unsigned"
    try:
        check_url(delivery["url"], settings.webhook_allow)
    except UnsafeWebhookURL as exc:
        return None, f"refused: {exc}"
    body = delivery["body"].encode()
    headers = sign_headers(settings.webhook_secret.get_secret_value(), delivery["event_id"], body)
    return _post(delivery["url"], body, headers, settings.webhook_timeout)


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
    status, error = _send(delivery, settings)
    schedule = parse_schedule(settings.webhook_retry_schedule)
    outcome = _outcome(status, error, number, schedule)
    entry = {
        "attempt": number,
        "event_id": event_id,
        "type": delivery["type"],
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
    settings: WebhookSettings | None = None,
    concurrency: int = 8,
    poll_s: float = 0.5,
    burst: bool = False,
    stop: threading.Event | None = None,
) -> None:
    """Deliver due events until stopped (or, with burst, until none is pending)."""
    settings = settings or WebhookSettings()
    stop = stop or threading.Event()
    lease_s = 3 * settings.webhook_timeout + 30
    with ThreadPoolExecutor(concurrency, thread_name_prefix="webhook") as pool:
        while not stop.is_set():
            due = claim_due(connection, concurrency, lease_s)
            list(pool.map(lambda event_id: attempt(connection, event_id, settings), due))
            if burst and not connection.zcard(DUE_KEY):
                return
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
    """Run the delivery process (any number of them may share one Redis)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run(Redis.from_url(redis_url), concurrency=concurrency, poll_s=poll, burst=burst)


@webhooks_app.command("log")
def log_command(
    batch_id: str,
    redis_url: str = RedisURL,
) -> None:
    """Print a batch's webhook delivery log."""
    for entry in delivery_log(Redis.from_url(redis_url), batch_id):
        typer.echo(json.dumps(entry))


if __name__ == "__main__":
    webhooks_app()
