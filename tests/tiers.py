"""Kernel tests run on every CPU ISA tier this host can execute (an AVX-512 host runs the avx2 tier too).

`TEST_TIERS` is the runnable tiers (to the SLUICE_CPU_ISA cap), but `amx` only where a csrc/ file has AMX
code: until then its object is the avx512_bf16 one (cpp_build.object_tier). A test module takes every tier
with `cpu_tier = tier_fixture()` (autouse) at module level, or a test asks for the `cpu_tier` fixture itself.
"""

from __future__ import annotations

import pytest

from sluice.kernels import cpp_build, cpu_isa, int4_weights


def _amx_code() -> bool:
    return any("__AMX" in p.read_text() for p in cpp_build.CSRC.iterdir() if p.suffix in (".cpp", ".h"))


TEST_TIERS = [t for t in cpu_isa.runnable_tiers() if t != "amx" or _amx_code()] or [cpu_isa.GENERIC]


def use_tier(monkeypatch, tier: str) -> None:
    """Make `tier` this process's chosen tier until the test ends (its kernels load from that tier's
    objects)."""
    if tier == cpu_isa.GENERIC:
        monkeypatch.delenv(cpu_isa.ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_isa.ENV, tier)
    cpu_isa.reset()
    int4_weights.cpu_layout.cache_clear()


def tier_fixture(autouse: bool = True):
    """A fixture parametrized over TEST_TIERS that makes each the chosen tier for the test."""
    @pytest.fixture(params=TEST_TIERS, autouse=autouse)
    def cpu_tier(request, monkeypatch) -> str:
        use_tier(monkeypatch, request.param)
        yield request.param
        cpu_isa.reset()
        int4_weights.cpu_layout.cache_clear()

    return cpu_tier
