"""Webhook events queued in Redis: the event a finished batch sends, and each batch's delivery log."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis import Redis

    from sluice.contract.settings import WebhookSettings

DUE_KEY = "sluice:webhooks:due"
EVENT_TYPES = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "cancelled": "batch.cancelled",
    "expired": "batch.expired",
}
KEEP_S = 30 * 86400

_ENQUEUE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  redis.call('HSET', KEYS[2], unpack(ARGV, 4))
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
  return ARGV[1]
end
return redis.call('GET', KEYS[1])
"""


def as_text(value: Any) -> str:
    """Text of a Redis reply (bytes) or of any value."""
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
    return [json.loads(as_text(raw)) for raw in connection.lrange(log_key(batch_id), 0, -1)]


def notify(
    connection: Redis,
    batch: Any,
    result: dict | None = None,
    *,
    settings: WebhookSettings,
) -> str | None:
    """Queue the event for a batch's final status; return its event id (None if nothing to send)."""
    # signing (urllib3, standardwebhooks) loads at a batch's end, not on every worker's start-up path
    from sluice.contract.signing import UnsafeWebhookURL, check_url

    status = as_text(getattr(_field(batch, "status"), "value", _field(batch, "status")))
    url = _field(batch, "webhook") or settings.webhook_url
    batch_id = as_text(_field(batch, "id"))
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
    return as_text(queued)
