"""LoRA's grouped products (torch groups on CPU, the Triton kernel under TRITON_INTERPRET=1) against a
per-token reference: each token's x · A[slot]ᵀ · B[slot]ᵀ added to the base output, tokens without an adapter
untouched."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # conftest sets it before triton can load (triton reads it at import)

import pytest  # noqa: E402
import torch  # noqa: E402

from sluice.kernels.lora_groups import add_lora, token_groups  # noqa: E402

SLOTS = [-1, 2, 2, 0, -1, 1, 1, 1, 0, 2, -1, 3]  # contiguous runs and scattered tokens of each slot


def case(dtype, rank=24, k=40, n=72, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(SLOTS), k, generator=g).to(dtype)
    a = torch.randn(4, rank, k, generator=g).to(dtype)
    b = (torch.randn(4, n, rank, generator=g) * 0.1).to(dtype)
    y = torch.randn(len(SLOTS), n, generator=g).to(dtype)
    want = y.float().clone()
    for t, s in enumerate(SLOTS):
        if s >= 0:
            want[t] += b[s].float() @ (a[s].float() @ x[t].float())
    return x, a, b, y, want


def test_torch_groups_match_the_per_token_reference():
    x, a, b, y, want = case(torch.float32)
    groups = token_groups(SLOTS, x.device)
    assert any(isinstance(rows, slice) for _, rows in groups) and any(torch.is_tensor(r) for _, r in groups)
    got = add_lora(y.clone(), x, a, b, groups)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[[0, 4, 10]], y[[0, 4, 10]])  # tokens without an adapter keep the base output


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_the_per_token_reference(dtype):
    pytest.importorskip("triton", reason="triton cannot be imported on this platform")
    from sluice.kernels.triton.lora_bgmv import triton_add_lora

    x, a, b, y, want = case(dtype)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    got = triton_add_lora(y.clone(), x, a, b, slots)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got[[0, 4, 10]], y[[0, 4, 10]])
