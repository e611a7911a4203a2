"""OpenAI's cursor pagination over a per-project Redis sorted set: newest first, `after` an object id."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from sluice.producer.server.errors import APIError

MAX_LIMIT = 100
SCAN = 200  # ids read from the index per round trip while filtering


def page_ids(
    connection: redis.Redis,
    index: str,
    after: str | None,
    limit: int,
    order: str = "desc",
    keep: Callable[[list[str]], list[str]] | None = None,
) -> tuple[list[str], bool]:
    """Up to limit ids after the cursor (newest first, or oldest first with order='asc') that keep lets
    through (filtered before paging), and whether more follow."""
    if not 1 <= limit <= MAX_LIMIT:
        raise APIError(400, f"limit must be between 1 and {MAX_LIMIT}, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    rank, scan = (connection.zrank,
                  connection.zrange) if order == "asc" else (connection.zrevrank, connection.zrevrange)
    start = 0
    if after:
        found = rank(index, after)
        if found is None:
            raise APIError(400, f"after: no object with id '{after}'", param="after")
        start = found + 1
    ids: list[str] = []
    while len(ids) <= limit:
        chunk = [i.decode() for i in scan(index, start, start + SCAN - 1)]
        if not chunk:
            break
        ids += keep(chunk) if keep is not None else chunk
        start += SCAN
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
