"""Reliable webhook delivery: events queued in Redis, a delivery loop with backoff, a log per batch."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests
import typer
from redis import Redis

from producer.webhooks import UnsafeWebhookURL, WebhookSettings, check_url, parse_schedule, sign_headers

log = logging.getLogger(__name__)

DUE_KEY = "sluice:webhooks:due"
EVENT_TYPES = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "cancelled": "batch.cancelled",
    "expired": "batch.expired",
}
KEEP_S = 30 * 86400
JITTER = 0.2

_ENQUEUE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  redis.call('HSET', KEYS[2], unpack(ARGV, 4))
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
  return ARGV[1]
end
return redis.call('GET', KEYS[1])
"""

_CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], ARGV[2], id) end
return ids
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def delivery_key(event_id: str) -> str:
    return f"sluice:webhooks:delivery:{event_id}"


def log_key(batch_id: str) -> str:
    return f"sluice:batch:{batch_id}:webhook_log"


def _field(batch: Any, name: str) -> Any:
    return batch.get(name) if isinstance(batch, dict) else getattr(batch, name, None)


def batch_data(batch: Any) -> dict[str, Any]:
    """The batch object as sent in an event's data, without the webhook target."""
    data = batch.model_dump(mode="json") if hasattr(batch, "model_dump") else dict(batch)
    data.pop("webhook", None)
    return data


def event_payload(event_id: str, event_type: str, batch: Any, result: dict | None = None) -> bytes:
    """The exact JSON bytes of one event, sent unchanged on every attempt."""
    data = batch_data(batch)
    if result is not None:
        data["result"] = result
    payload = {"id": event_id, "type": event_type, "created_at": int(time.time()), "data": data}
    return json.dumps(payload, separators=(",", ":")).encode()


def record_attempt(connection: Redis, batch_id: str, entry: dict[str, Any]) -> None:
    """Append one delivery attempt (or refusal) to the batch's delivery log."""
    with connection.pipeline() as pipe:
        pipe.rpush(log_key(batch_id), json.dumps(entry))
        pipe.expire(log_key(batch_id), KEEP_S)
        pipe.execute()


def delivery_log(connection: Redis, batch_id: str) -> list[dict]:
    """Every delivery attempt recorded for a batch, oldest first."""
    return [json.loads(_text(raw)) for raw in connection.lrange(log_key(batch_id), 0, -1)]


def notify(
    connection: Redis,
    batch: Any,
    result: dict | None = None,
    settings: WebhookSettings | None = None,
) -> str | None:
    """Queue the event for a batch's final status; return its event id (None if nothing to send)."""
    settings = settings or WebhookSettings()
    status = _text(getattr(_field(batch, "status"), "value", _field(batch, "status")))
    url = _field(batch, "webhook") or settings.webhook_url
    batch_id = _text(_field(batch, "id"))
    if status not in EVENT_TYPES or not url:
        return None
    event_type = EVENT_TYPES[status]
    try:
        check_url(url, settings.webhook_allow)
    except UnsafeWebhookURL as exc:
        record_attempt(
            connection, batch_id, {"attempt": 0, "type": event_type, "at": time.time(), "error": str(exc)}
        )
        return None
    event_id = f"evt_{uuid.uuid4().hex}"
    fields = {"event_id": event_id, "batch_id": batch_id, "type": event_type, "url": url, "attempts": 0}
    fields["body"] = event_payload(event_id, event_type, batch, result).decode()
    flat = [str(x) for pair in fields.items() for x in pair]
    keys = [f"sluice:webhooks:event:{batch_id}:{event_type}", delivery_key(event_id), DUE_KEY]
    queued = connection.eval(_ENQUEUE, 3, *keys, event_id, KEEP_S, time.time(), *flat)
    return _text(queued)


def claim_due(connection: Redis, limit: int, lease_s: float) -> list[str]:
    """Take up to limit due deliveries, pushing each out by lease_s so a dead deliverer's come back."""
    now = time.time()
    return [_text(i) for i in connection.eval(_CLAIM, 1, DUE_KEY, now, now + lease_s, limit)]


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
    delivery = {_text(k): _text(v) for k, v in raw.items()}
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


webhooks_app = typer.Typer(help="Webhook delivery: the delivery process and per-batch delivery logs.")


@webhooks_app.command("run")
def run_command(
    redis_url: str = typer.Option("redis://127.0.0.1:6379/0", envvar="SLUICE_REDIS_URL"),
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
    redis_url: str = typer.Option("redis://127.0.0.1:6379/0", envvar="SLUICE_REDIS_URL"),
) -> None:
    """Print a batch's webhook delivery log."""
    for entry in delivery_log(Redis.from_url(redis_url), batch_id):
        typer.echo(json.dumps(entry))


if __name__ == "__main__":
    webhooks_app()
