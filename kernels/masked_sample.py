"""One token per logits row by one C++ pass on CPU (csrc/masked_sample.cpp): the grammar's token bitmask, the
temperature, the sampler's keyed noise and the argmax, read straight from the model's logits with no float32
copy, no masked copy and no [rows, vocab] noise tensor. Where it does not serve (another device,
SLUICE_CPU_KERNEL=0, no compiler) `masked_sample` returns None and engine/sampler.py's torch path (xgrammar's
bitmask apply, softmax, `draw`) samples instead: the same tokens, up to ties in rounding.
"""

from __future__ import annotations

import torch

from sluice.kernels import cpp_build


def _ext():
    return cpp_build.part("masked_sample") if cpp_build.enabled() else None


def serves(logits: torch.Tensor) -> bool:
    """True when the C++ kernel samples these logits: on CPU, rows [R, n] of unit stride, the kernel built."""
    return (logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and _ext() is not None)


def masked_sample(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor,
                  bitmask: torch.Tensor | None = None,
                  mask_rows: torch.Tensor | None = None, mask_vocab: int = 0) -> torch.Tensor | None:
    """Token ids [R] from logits [R, n]: the first allowed maximum where temps[r] <= 0, else the exponential
    race argmax softmax(x / T) / -log(u) with u hashed from keys[r] (sampler.keyed_uniform's (lo, hi, pos,
    stream)); row r is masked by bitmask row mask_rows[r] (xgrammar's int32 layout; < 0: not masked) over
    tokens below mask_vocab. None where the kernel does not serve."""
    if not serves(logits):
        return None
    rows = logits.shape[0]
    if bitmask is None or mask_rows is None:
        bitmask, mask_rows = torch.zeros(0, 1, dtype=torch.int32), torch.full((rows,), -1, dtype=torch.long)
    return _ext().masked_sample(logits, temps, keys, bitmask, mask_rows, mask_vocab)
