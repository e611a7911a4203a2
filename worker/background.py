"""Background threads that never die silently: an exception is logged and the loop starts again."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sluice.worker.outage import OUTAGE, REDIS_ERRORS

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 30.0


def supervised(name: str, target: Callable[[threading.Event], None],
               stop: threading.Event) -> threading.Thread:
    """Run target(stop) in a daemon thread; when it raises, log it and run it again after a backoff."""

    def loop() -> None:
        backoff = 1.0
        while not stop.is_set():
            try:
                target(stop)
                return
            except REDIS_ERRORS as exc:
                OUTAGE.failed(f"background {name}", exc)
            except Exception:
                log.exception("background %s failed; restarting in %.0f s", name, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


def every(seconds: float, action: Callable[[], None]) -> Callable[[threading.Event], None]:
    """A target that calls action every `seconds` until stopped (errors go to `supervised`)."""

    def target(stop: threading.Event) -> None:
        while not stop.wait(seconds):
            action()

    return target
