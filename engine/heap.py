"""The C heap's free pages handed back to the OS once the engine drains.

glibc keeps the pages of a batch's freed temporaries (prefill activations, int8 products) for reuse, so a
process that has served one large batch stays at its peak while idle; `malloc_trim` returns them.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None on a C library without it."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def trim() -> bool:
    """Return the heap's free pages to the OS; True when some were released."""
    release = _malloc_trim()
    return bool(release is not None and release(0))
