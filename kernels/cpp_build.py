"""Build the C++ CPU kernels in csrc/ on first use; a missing toolchain or a compile error means torch fallbacks."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fopenmp"]
_built: dict[str, object | None] = {}


def enabled() -> bool:
    """False when SLUICE_CPU_KERNEL=0 asks for the torch implementations."""
    return os.environ.get("SLUICE_CPU_KERNEL", "1") != "0"


def load(name: str, source: str):
    """The extension `name` built from csrc/`source` (cached per process), or None when it cannot be built."""
    if name not in _built:
        try:
            from torch.utils.cpp_extension import load as build

            _built[name] = build(name=name, sources=[str(CSRC / source)], extra_cflags=CFLAGS,
                                 extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # toolchain missing, compiler error: fall back to torch
            log.warning("CPU kernel %s unavailable, using torch: %s", name, exc)
            _built[name] = None
    return _built[name]
