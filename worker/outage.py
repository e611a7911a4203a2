"""One log line per Redis outage, not one per attempt: the first failure is logged, the rest are quiet until
Redis answers again (which is logged once too). Shared by the engine loop, rq's dequeue and the background
threads."""

from __future__ import annotations

import logging
import threading
import time

import redis

REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
log = logging.getLogger("sluice.worker")
UNAVAILABLE = "Redis unavailable (%s in %s: %s); waiting for it with backoff (up to 30 s), model kept loaded"


def unavailable_args(where: str, exc: BaseException) -> tuple:
    """The arguments of the UNAVAILABLE line."""
    return type(exc).__name__, where, exc


class Outage:
    """Whether Redis is known to be down, since when, and how many attempts failed meanwhile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.since: float | None = None
        self.attempts = 0

    def failed(self, where: str, exc: BaseException) -> None:
        """A Redis call failed: logged when it starts an outage, counted otherwise."""
        if self.starts():
            log.warning(UNAVAILABLE, *unavailable_args(where, exc))

    def starts(self) -> bool:
        """Counts a failed Redis call; True when it starts an outage (the caller logs UNAVAILABLE)."""
        with self._lock:
            self.attempts += 1
            if self.since is not None:
                return False
            self.since = time.monotonic()
            return True

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
        """rq's first failed attempt becomes the outage's warning, the later ones are dropped."""
        if "could not connect to Redis" not in str(record.msg):
            return True
        if not OUTAGE.starts():
            return False
        # Rewritten in place, not logged from here: since Python 3.13.4 a record logged while this
        # thread is inside another logger's handle() is dropped without a trace (CPython gh-91555).
        exc = ConnectionError(str(record.args[1]) if len(record.args) > 1 else "")
        record.name, record.levelno, record.levelname = log.name, logging.WARNING, "WARNING"
        record.msg, record.args = UNAVAILABLE, unavailable_args("rq dequeue", exc)
        return True
