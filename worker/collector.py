"""The cyclic garbage collector paused over the worker's imports.

Importing torch, the engine and the service stack creates a few hundred thousand objects that live as long as
the process (modules, functions, classes); every full collection that the allocation counts trigger meanwhile
walks all of them again, a large share of the worker's import time (docs/benchmarks.md, coldstart). The
worker's entry points pause the collector before their first import; `sluice worker` resumes it once its
imports are done, with every object alive then frozen (`gc.freeze`: left out of every later collection, so the
load and the serving loop run with the collector on, as before, and no longer rescan the start-up's objects).
What the imports left as cyclic garbage (a few thousand small objects) stays allocated.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Turn the cyclic collector off until `resume` (nothing where something else already turned it off)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> bool:
    """Freeze every object alive now and turn the collector back on, if `pause` turned it off; True if so."""
    global _paused
    if not _paused:
        return False
    gc.freeze()
    gc.enable()
    _paused = False
    return True
