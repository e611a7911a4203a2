"""Build the C++ CPU kernels in csrc/ on first use; a missing toolchain or a compile error means torch fallbacks."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fopenmp"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_built: dict[str, object | None] = {}


@functools.cache
def enabled() -> bool:
    """False when SLUICE_CPU_KERNEL=0 asks for the torch implementations (read once: the kernels ask ~100 times a
    decode step, and an environment lookup is ~1.5 us; `enabled.cache_clear()` after changing it)."""
    return os.environ.get("SLUICE_CPU_KERNEL", "1") != "0"


@contextmanager
def _build_lock(name: str):
    """An exclusive flock on the extension's build folder, released by the OS even if its holder is killed.

    torch's own lock is a file that a build killed midway (a SIGKILLed worker) leaves behind, and every later
    load then waits on it forever; under our flock no build is running, so such a file is stale and goes.
    """
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    with open(folder / "sluice-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sources(source: str) -> list[str]:
    """`source` and every csrc/ file it `#include "..."`s, transitively, each once, in the order first met."""
    found, todo = [], [source]
    while todo:
        name = todo.pop(0)
        if name not in found:
            found.append(name)
            todo += INCLUDE.findall((CSRC / name).read_text())
    return found


def build_name(name: str, source: str) -> str:
    """The extension's name on disk: `name` and a hash of its source and the local files it includes, flags and
    folder (ninja rebuilds when a source's path changes, so two checkouts sharing one build folder would rebuild
    over each other)."""
    key = b"".join((CSRC / f).read_bytes() for f in _sources(source))
    key += " ".join(CFLAGS).encode() + str(CSRC.resolve()).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return f"{name}_{digest}"


def load(name: str, source: str):
    """The extension `name` built from csrc/`source` (cached per process), or None when it cannot be built.

    The build folder is named after the source's hash as well, so checkouts with different sources (or an
    upgrade under running workers) each keep their own build instead of rebuilding over one another.
    """
    if name not in _built:
        try:
            from torch.utils.cpp_extension import load as build

            versioned = build_name(name, source)
            with _build_lock(versioned):
                _built[name] = build(name=versioned, sources=[str(CSRC / source)], extra_cflags=CFLAGS,
                                     extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # toolchain missing, compiler error: fall back to torch
            log.warning("CPU kernel %s unavailable, using torch: %s", name, exc)
            _built[name] = None
    return _built[name]
