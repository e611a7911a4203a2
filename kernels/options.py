"""The kernels' options: the one place below the contract layer that reads the environment.

Read once per process (`current`), or set by the engine from its config (`use`: the worker passes its Settings'
values down through EngineConfig); the kernel modules read `current()` and never the environment. `reload` reads
the environment again (tests and benches that change it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

CPU_KERNEL = "SLUICE_CPU_KERNEL"
CPU_ISA = "SLUICE_CPU_ISA"
DEVICE_PATH = "SLUICE_DEVICE_PATH"


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """What the kernels take from the environment."""

    cpu_kernel: bool = True  # SLUICE_CPU_KERNEL: False (0) runs the torch implementations instead of our C++ ones
    cpu_isa: str | None = None  # SLUICE_CPU_ISA: a cap on the CPU ISA tier the C++ kernels are built for
    device_path: bool | None = None  # SLUICE_DEVICE_PATH: force FlatMetadata steps on (1) or off (0); None: CUDA
    cache_home: str | None = None  # XDG_CACHE_HOME: where built kernels are kept (None: ~/.cache)
    cxx: str = "c++"  # CXX: the C++ compiler
    onednn_max_cpu_isa: str = ""  # ONEDNN_MAX_CPU_ISA: oneDNN's own cap, upper case

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> KernelOptions:
        """The options an environment sets (unset or empty variables keep the defaults)."""
        path = env.get(DEVICE_PATH)
        return cls(cpu_kernel=env.get(CPU_KERNEL, "1") != "0",
                   cpu_isa=env.get(CPU_ISA, "").strip().lower() or None,
                   device_path=path == "1" if path in ("0", "1") else None,
                   cache_home=env.get("XDG_CACHE_HOME") or None,
                   cxx=env.get("CXX") or "c++",
                   onednn_max_cpu_isa=env.get("ONEDNN_MAX_CPU_ISA", "").upper())

    def merged(self, **values) -> KernelOptions:
        """These options with the given fields replaced where their value is not None."""
        given = {k: v for k, v in values.items() if v is not None}
        return replace(self, **given) if given else self


_current: list[KernelOptions] = []
_derived: list[Callable[[], None]] = []  # what kernel modules cached from the options, forgotten when they change


def on_change(forget: Callable[[], None]) -> None:
    """Have `forget` called whenever the options change (a kernel module's cache of what it derived from them)."""
    _derived.append(forget)


def current() -> KernelOptions:
    """This process's options: those last `use`d, else the environment's, read once."""
    if not _current:
        _current.append(KernelOptions.from_env())
    return _current[0]


def use(options: KernelOptions) -> None:
    """Make `options` this process's (what the kernel modules derived from the previous ones is forgotten)."""
    _current[:] = [options]
    for forget in _derived:
        forget()


def configure(**values) -> KernelOptions:
    """This process's options with the given fields (those not None) replaced: the engine's config passes the
    values its caller (the worker, from Settings) chose."""
    options = current().merged(**values)
    if options != current():
        use(options)
    return options


def reset() -> None:
    """Forget the options: the next `current()` reads the environment again (after a test or bench changed it)."""
    _current.clear()
    for forget in _derived:
        forget()
