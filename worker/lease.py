"""Fencing of shard attempts: a lease token per attempt, attempt-specific output keys, a compare-and-set
commit.

Each attempt at a shard takes the next token from a counter in Redis (INCR) and writes its output to
`{batch}/shards/{n}.{token}.jsonl`. The commit records that token as the shard's committed attempt only if the
token is still the shard's current one, no attempt committed before, and the batch is neither finalizing nor
ended; finalize reads only the committed attempt's file. A worker cut off from Redis (or paused) while its
shard was given to another comes back holding a stale token: its commit is refused, it discards its output,
and nothing it does changes a batch's files.
"""

from __future__ import annotations

from enum import StrEnum

import redis

from sluice.contract.batch import PREFIX, batch_key, shards_key
from sluice.contract.redis_conn import wait_for_replica

COMMIT_WAIT_MS = 1000  # how long a commit point waits for a replica's acknowledgement (Sentinel set-ups only)
CLOSED = ("finalizing", "completed", "failed", "expired", "cancelled")


class Commit(StrEnum):
    """What a commit attempt found."""

    ok = "ok"  # this attempt is (now) the shard's committed one
    lease_lost = "lease_lost"  # another attempt took the shard since this one began
    committed = "committed"  # another attempt committed first
    batch_closed = "batch_closed"  # the batch is finalizing or ended: its files are no longer open


def lease_key(batch_id: str, shard: int) -> str:
    return f"{PREFIX}{batch_id}:lease:{shard}"


def committed_key(batch_id: str) -> str:
    return f"{PREFIX}{batch_id}:committed"


def attempt_key(batch_id: str, shard: int, token: int) -> str:
    """The storage key of one attempt's output."""
    return f"{batch_id}/shards/{shard}.{token}.jsonl"


# KEYS: lease, committed, (unused); ARGV: shard. 0 when the shard is committed already, else the new token.
_BEGIN = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
return redis.call('INCR', KEYS[1])
"""

# KEYS: lease, committed, batch record, shard counts; ARGV: shard, token, counts entry, closed statuses...
_COMMIT = """
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 'lease_lost' end
local done = redis.call('HGET', KEYS[2], ARGV[1])
if done then
  if done == ARGV[2] then return 'ok' end
  return 'committed'
end
local raw = redis.call('GET', KEYS[3])
if raw then
  local status = cjson.decode(raw)['status']
  for i = 4, #ARGV do
    if status == ARGV[i] then return 'batch_closed' end
  end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
return 'ok'
"""


def begin_attempt(connection: redis.Redis, batch_id: str, shard: int) -> int | None:
    """A new lease token for an attempt at the shard (waited onto a replica); None if the shard is
    committed."""
    keys = [lease_key(batch_id, shard), committed_key(batch_id), batch_key(batch_id)]
    token = int(connection.eval(_BEGIN, len(keys), *keys, shard))
    if token:
        wait_for_replica(connection, COMMIT_WAIT_MS)
    return token or None


def lease_holds(connection: redis.Redis, batch_id: str, shard: int, token: int) -> bool:
    """Whether token is still the shard's current lease."""
    current = connection.get(lease_key(batch_id, shard))
    return current is not None and int(current) == token


def leases_lost(connection: redis.Redis, attempts: dict[str, tuple[str, int, int]]) -> list[str]:
    """Those of attempts ({name: (batch id, shard, token)}) whose lease another attempt has taken."""
    if not attempts:
        return []
    names = list(attempts)
    current = connection.mget([lease_key(b, s) for b, s, _ in attempts.values()])
    return [n for n, c in zip(names, current, strict=True) if c is None or int(c) != attempts[n][2]]


def commit(connection: redis.Redis, batch_id: str, shard: int, token: int, counts: str) -> Commit:
    """Make token the shard's committed attempt and record its counts (JSON entry), if its lease still holds
    and the batch is open; a committed attempt is waited onto a replica before it counts as done."""
    keys = [lease_key(batch_id, shard), committed_key(batch_id), batch_key(batch_id), shards_key(batch_id)]
    answer = connection.eval(_COMMIT, len(keys), *keys, shard, token, counts, *CLOSED)
    result = Commit(answer.decode() if isinstance(answer, bytes) else answer)
    if result is Commit.ok:
        wait_for_replica(connection, COMMIT_WAIT_MS)
    return result


def committed_token(connection: redis.Redis, batch_id: str, shard: int) -> int | None:
    """The token of the shard's committed attempt, None when no attempt committed."""
    raw = connection.hget(committed_key(batch_id), str(shard))
    return None if raw is None else int(raw)
