"""Per-project cap on enqueued tokens (like OpenAI's batch queue limit), held in Redis.

A submit reserves its batch's estimated tokens (contract/shards.estimate_tokens, per shard) against its
project's cap in one script, or is refused with the cap and the project's usage; each shard's tokens are
released when the shard is recorded as finished, and whatever a batch still holds when it reaches a terminal
status. Releases are idempotent: a re-run shard, or a second terminal path, frees nothing twice.
"""

from __future__ import annotations

import redis

USAGE = "sluice:quota:"  # + project -> tokens its unfinished shards are estimated at
HELD = "sluice:batch:{}:tokens"  # hash: "project" -> project, shard number -> tokens not yet released
DEFAULT_PROJECT = "default"

RESERVE = """
local used = tonumber(redis.call('get', KEYS[1]) or '0')
local cap, total = tonumber(ARGV[1]), tonumber(ARGV[2])
if cap > 0 and used + total > cap then return {0, used} end
redis.call('incrby', KEYS[1], total)
redis.call('hset', KEYS[2], 'project', ARGV[3])
for i = 4, #ARGV do redis.call('hset', KEYS[2], tostring(i - 4), ARGV[i]) end
return {1, used}
"""

# the usage key is built here from the batch's project (Sluice runs on one Redis, not a cluster)
RELEASE = """
local project = redis.call('hget', KEYS[1], 'project')
if not project then return 0 end
local freed = 0
if #ARGV == 0 then
  local all = redis.call('hgetall', KEYS[1])
  for i = 1, #all, 2 do
    if all[i] ~= 'project' then freed = freed + tonumber(all[i + 1]) end
  end
  redis.call('del', KEYS[1])
else
  for i = 1, #ARGV do
    local tokens = redis.call('hget', KEYS[1], ARGV[i])
    if tokens then
      freed = freed + tonumber(tokens)
      redis.call('hdel', KEYS[1], ARGV[i])
    end
  end
end
if freed > 0 then redis.call('decrby', '""" + USAGE + """' .. project, freed) end
return freed
"""


class TokenLimitExceeded(Exception):
    """A submit whose estimated tokens would take its project past its enqueued-token cap."""

    code = "token_limit_exceeded"

    def __init__(self, project: str, cap: int, used: int, wanted: int) -> None:
        self.project, self.cap, self.used, self.wanted = project, cap, used, wanted
        super().__init__(
            f"enqueued token limit reached for project {project!r}: limit {cap} enqueued tokens "
            f"(SLUICE_MAX_ENQUEUED_TOKENS), {used} already enqueued, this batch is estimated at {wanted} "
            "(its JSON bytes / 4); submit again once some in-progress batches have finished"
        )


class TokenQuota:
    """Reserve and release a project's enqueued tokens."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection
        self._reserve = connection.register_script(RESERVE)
        self._release = connection.register_script(RELEASE)

    def reserve(self, project: str, batch_id: str, shard_tokens: list[int], cap: int) -> None:
        """Hold the batch's per-shard tokens for project, or raise TokenLimitExceeded (cap 0: no cap)."""
        total = sum(shard_tokens)
        ok, used = self._reserve(keys=[USAGE + project, HELD.format(batch_id)],
                                 args=[cap, total, project, *shard_tokens])
        if not ok:
            raise TokenLimitExceeded(project, cap, int(used), total)

    def release_shard(self, batch_id: str, shard: int) -> int:
        """Free a finished shard's tokens (once); returns the tokens freed."""
        return int(self._release(keys=[HELD.format(batch_id)], args=[str(shard)]))

    def release_batch(self, batch_id: str) -> int:
        """Free whatever the batch still holds (it reached a terminal status); returns the tokens freed."""
        return int(self._release(keys=[HELD.format(batch_id)], args=[]))

    def usage(self, project: str) -> int:
        """Tokens the project's unfinished shards are estimated at."""
        return int(self.connection.get(USAGE + project) or 0)
