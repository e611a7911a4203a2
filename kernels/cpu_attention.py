"""A fused CPU paged-attention kernel (C++ in csrc/paged_attention.cpp, built on first use).

The torch path gathers blocks into a padded copy and then multiplies; this kernel walks the block tables
directly, so decode attention touches the KV cache once per layer. It is optional: when the toolchain is
missing or the build fails, `available()` is False and the torch implementation is used.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fopenmp"]

_module = None
_failed = False


def _build():
    global _module, _failed
    if _module is not None or _failed:
        return _module
    try:
        from torch.utils.cpp_extension import load

        _module = load(name="sluice_paged_attention_cpu", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                       extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # toolchain missing, compiler error: fall back to torch
        log.warning("CPU paged-attention kernel unavailable, using torch: %s", exc)
        _failed = True
    return _module


def available() -> bool:
    """True when the kernel is enabled (SLUICE_CPU_KERNEL != 0) and built."""
    return os.environ.get("SLUICE_CPU_KERNEL", "1") != "0" and _build() is not None


def paged_attention_cpu(q, k_cache, v_cache, out, qstart, qlen, ctx, block_tables, scale) -> None:
    """Write into out [T, H, D] the attention of each listed sequence's queries over its blocks."""
    _build().paged_attention_cpu(q.contiguous(), k_cache, v_cache, out, qstart, qlen, ctx, block_tables, scale)
