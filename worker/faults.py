"""SLUICE_FAULTS: in-process fault injection for the fault suite, off unless the variable is set.

Only for faults no real process can produce on demand. A comma-separated list of `name=value`:
`step_error=MARKER` (engine steps raise while a request whose prompt contains MARKER is in flight),
`slow_load=SECONDS` (each shard read from its slice of the input sleeps first, a window to cut a worker off in
right after it claimed the shard),
`slow_save=SECONDS` (each shard save sleeps first, as a slow upload would),
`slow_finalize=SECONDS` (each finalize sleeps before writing, a window to kill it in).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache

from sluice.contract.settings import Settings

KNOWN = {"step_error", "slow_load", "slow_save", "slow_finalize"}


class InjectedFault(RuntimeError):
    """An error raised on purpose by SLUICE_FAULTS."""


@dataclass(frozen=True)
class Faults:
    """The faults switched on for this process."""

    step_error: str | None = None
    slow_load: float = 0.0
    slow_save: float = 0.0
    slow_finalize: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """Faults from a `name=value,...` string; unknown names are refused."""
        values: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, _, value = item.partition("=")
            if name not in KNOWN:
                raise ValueError(f"SLUICE_FAULTS: unknown fault {name!r}; known: {', '.join(sorted(KNOWN))}")
            values[name] = value
        return cls(
            step_error=values.get("step_error") or None,
            slow_load=float(values.get("slow_load") or 0),
            slow_save=float(values.get("slow_save") or 0),
            slow_finalize=float(values.get("slow_finalize") or 0),
        )

    def check_step(self, prompts: list[str]) -> None:
        """Raise as a broken engine step would when a marked prompt is in flight."""
        if self.step_error and any(self.step_error in p for p in prompts):
            raise InjectedFault(f"injected step error ({self.step_error!r} in flight)")

    def before_load(self) -> None:
        if self.slow_load:
            time.sleep(self.slow_load)

    def before_save(self) -> None:
        if self.slow_save:
            time.sleep(self.slow_save)

    def before_finalize(self) -> None:
        if self.slow_finalize:
            time.sleep(self.slow_finalize)


def faults(settings: Settings) -> Faults:
    """The faults settings ask for (SLUICE_FAULTS; none by default), parsed once per value."""
    return _parsed(settings.faults)


@cache
def _parsed(spec: str) -> Faults:
    return Faults.parse(spec)
