"""OpenAI's cursor pagination over a per-project Redis sorted set: newest first, `after` an object id."""

from __future__ import annotations

from typing import Any

import redis

from sluice.producer.server.errors import APIError

MAX_LIMIT = 100


def page_ids(connection: redis.Redis, index: str, after: str | None, limit: int) -> tuple[list[str], bool]:
    """Up to limit ids after the cursor (newest first) and whether more follow."""
    if not 1 <= limit <= MAX_LIMIT:
        raise APIError(400, f"limit must be between 1 and {MAX_LIMIT}, got {limit}", param="limit")
    start = 0
    if after:
        rank = connection.zrevrank(index, after)
        if rank is None:
            raise APIError(400, f"after: no object with id '{after}'", param="after")
        start = rank + 1
    ids = [i.decode() for i in connection.zrevrange(index, start, start + limit)]
    return ids[:limit], len(ids) > limit


def list_body(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """The list object: data, first_id, last_id, has_more."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
