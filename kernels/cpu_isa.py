"""The CPU instruction-set tier the C++ kernels are built for, chosen once per process from the CPU's flags.

Tiers, each a superset of the one before: `avx2` (AVX2 + FMA + F16C + BMI2), `avx512` (F/BW/VL/DQ, VNNI where
the CPU has it), `avx512_bf16` (plus AVX512-BF16 and VNNI), `amx` (plus AMX tile/bf16/int8). A host without
AVX2 (or not x86) gets `generic`: the kernels build without ISA flags and serve their scalar / at::vec paths.
`SLUICE_CPU_ISA=avx2|avx512|avx512_bf16|amx` caps the tier (read here: kernels/ may not import the
settings), so a capped process never runs an instruction above it, whatever its CPU has. Every Python
condition that picks a tier-specific path asks `tier()` / `at_least()`, never the CPU directly.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from sluice.kernels import options

TIERS = ("avx2", "avx512", "avx512_bf16", "amx")
GENERIC = "generic"
ENV = options.CPU_ISA
# /proc/cpuinfo flags each tier needs, on top of the tier before it
REQUIRED = {
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
# the compiler flags each tier adds to the one before it (explicit: never -march=native)
TIER_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mpopcnt"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd"),
    "avx512_bf16": ("-mavx512bf16", "-mavx512vnni"),
    "amx": ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}
# optional features a tier uses where the CPU has them: (cpu flag, compiler flag, lowest tier that may use
# it). The avx2 tier takes none, so it is the same object on every host (and an AVX-512 host's run of it is a
# Zen 2's).
OPTIONAL = (("avx512_vnni", "-mavx512vnni", "avx512"),)


def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags: /proc/cpuinfo's (what the kernel enabled), less any that the CPU itself
    does not report through CPUID (torch's cpuinfo), so an emulated or masked CPU is taken at its word."""
    return _cpu_flags()


# /proc/cpuinfo's names for the features torch's cpuinfo reports under other names
CPUINFO_NAMES = {"fma3": "fma", "avx512_f": "avx512f", "avx512_bw": "avx512bw", "avx512_vl": "avx512vl",
                 "avx512_dq": "avx512dq", "avx512_cd": "avx512cd"}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    cpuid = _cpuid_flags()
    listed = _cpuinfo("flags", "Features")
    if listed is not None:
        return confirmed(frozenset(listed.split()), cpuid)
    return cpuid if cpuid is not None else frozenset()


def _cpuinfo(*keys: str) -> str | None:
    """The value of /proc/cpuinfo's first line that starts with one of keys; None where there is none."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith(keys):
                return line.split(":", 1)[1]
    return None


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"), "" where it does not."""
    return (_cpuinfo("vendor_id") or "").strip()


_KNOWN = frozenset(f for names in REQUIRED.values() for f in names) | {"avx512cd"}


def confirmed(listed: frozenset[str], cpuid: frozenset[str] | None) -> frozenset[str]:
    """/proc/cpuinfo's flags less the tier features CPUID does not report (all of them where CPUID is
    unknown)."""
    return listed if cpuid is None else listed - (_KNOWN - cpuid)


def _cpuid_flags() -> frozenset[str] | None:
    """The features torch's cpuinfo finds by CPUID (and the OS's saved state), in /proc/cpuinfo's names;
    None where this torch cannot say."""
    import torch

    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is None:
        return None
    return frozenset(CPUINFO_NAMES.get(name, name) for name, on in caps().items() if on is True)


def host_tier(flags: frozenset[str] | None = None) -> str:
    """The highest tier whose flags the CPU has (`generic` when it lacks AVX2 or is not x86)."""
    if flags is None:
        if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
            return GENERIC
        flags = cpu_flags()
    best = GENERIC
    for name in TIERS:
        if not all(f in flags for f in REQUIRED[name]):
            break
        best = name
    return best


def cap(host: str, limit: str | None) -> str:
    """`host` held to at most `limit` (a tier name; None or empty: no cap); ValueError on an unknown name."""
    if not limit:
        return host
    if limit not in TIERS:
        raise ValueError(f"{ENV}={limit!r}: expected one of {', '.join(TIERS)}")
    if host == GENERIC:
        return GENERIC
    return TIERS[min(TIERS.index(host), TIERS.index(limit))]


def cap_setting() -> str | None:
    """SLUICE_CPU_ISA as set (lower case, kernels.options), or None."""
    return options.current().cpu_isa


@options.derived
def tier() -> str:
    """The tier the kernels build and run for: the host's, capped by SLUICE_CPU_ISA or the engine's config
    (kernels.options; `reset()` after changing the environment)."""
    return cap(host_tier(), cap_setting())


def reset() -> None:
    """Forget the options and the chosen tier (and the flags read), so the next `tier()` reads SLUICE_CPU_ISA
    again."""
    tier.cache_clear()
    _cpu_flags.cache_clear()
    options.reset()


def at_least(name: str, chosen: str | None = None) -> bool:
    """Whether the chosen tier (or `chosen`) includes tier `name`."""
    chosen = tier() if chosen is None else chosen
    return chosen != GENERIC and TIERS.index(chosen) >= TIERS.index(name)


def runnable_tiers() -> list[str]:
    """Every tier this process may execute (the host's, to the SLUICE_CPU_ISA cap), lowest first."""
    best = tier()
    return [] if best == GENERIC else list(TIERS[: TIERS.index(best) + 1])


def compile_flags(name: str, flags: frozenset[str] | None = None) -> list[str]:
    """The compiler's ISA flags for tier `name` on a CPU with `flags`: the tier's own, plus the optional
    features (VNNI) the CPU has and the tier may use."""
    if name == GENERIC:
        return []
    flags = cpu_flags() if flags is None else flags
    out: list[str] = []
    for t in TIERS[: TIERS.index(name) + 1]:
        out += TIER_FLAGS[t]
    out += [cc for cpu, cc, lowest in OPTIONAL if cpu in flags and at_least(lowest, name) and cc not in out]
    return out
