"""One log line per Redis outage, not one per attempt: the first failure is logged, the rest are quiet until
Redis answers again (which is logged once too). Shared by the engine loop, rq's dequeue and the background threads."""

from __future__ import annotations

import logging
import threading
import time

import redis

REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
log = logging.getLogger("sluice.worker")


class Outage:
    """Whether Redis is known to be down, since when, and how many attempts failed meanwhile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.since: float | None = None
        self.attempts = 0

    def failed(self, where: str, exc: BaseException) -> None:
        """A Redis call failed: logged when it starts an outage, counted otherwise."""
        with self._lock:
            self.attempts += 1
            if self.since is not None:
                return
            self.since = time.monotonic()
        log.warning(
            "Redis unavailable (%s in %s: %s); waiting for it with backoff (up to 30 s), model kept loaded",
            type(exc).__name__, where, exc,
        )

    def recovered(self) -> None:
        """A Redis call succeeded: logs the end of an outage once."""
        with self._lock:
            if self.since is None:
                return
            seconds, attempts = time.monotonic() - self.since, self.attempts
            self.since, self.attempts = None, 0
        log.warning("Redis is back after %.1f s (%d failed attempts)", seconds, attempts)

    @property
    def down(self) -> bool:
        return self.since is not None


OUTAGE = Outage()


class RqOutageFilter(logging.Filter):
    """Turns rq's per-attempt 'could not connect to Redis' errors into the outage's single line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "could not connect to Redis" in str(record.msg):
            OUTAGE.failed("rq dequeue", ConnectionError(str(record.args[1]) if len(record.args) > 1 else ""))
            return False
        return True
