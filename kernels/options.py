"""The kernels' options: the one place below the contract layer that reads the environment.

An engine owns its options (`Engine.kernel_options`: the environment's defaults with what its config sets, the
worker's Settings passed down through EngineConfig) and makes them `active` for its own calls (loading, each
step); the kernel modules read `current()` (the active engine's options, else the defaults) and never the
environment. What a kernel module derives from the options is kept with them (`derived`), so other options
derive it again and nothing has to be told of a change. `reset` reads the environment again (tests and benches
that change it)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

CPU_KERNEL = "SLUICE_CPU_KERNEL"
CPU_ISA = "SLUICE_CPU_ISA"
DEVICE_PATH = "SLUICE_DEVICE_PATH"
PACKED_WEIGHTS = "SLUICE_PACKED_WEIGHTS"


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """What the kernels take from the environment."""

    # SLUICE_CPU_KERNEL: False (0) runs the torch implementations instead of our C++ ones
    cpu_kernel: bool = True
    cpu_isa: str | None = None  # SLUICE_CPU_ISA: a cap on the CPU ISA tier the C++ kernels are built for
    # SLUICE_DEVICE_PATH: force FlatMetadata steps on (1) or off (0); None: CUDA
    device_path: bool | None = None
    cache_home: str | None = None  # XDG_CACHE_HOME: where built kernels are kept (None: ~/.cache)
    cxx: str = "c++"  # CXX: the C++ compiler
    onednn_max_cpu_isa: str = ""  # ONEDNN_MAX_CPU_ISA: oneDNN's own cap, upper case
    # SLUICE_PACKED_WEIGHTS: False (0) keeps bf16 linears on their row-major weights alone (kernels.linear's
    # panels are a second copy of each weight)
    packed_weights: bool = True
    # What kernel modules derived from these options (`derived`), kept with them.
    memo: dict[Callable, Any] = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> KernelOptions:
        """The options an environment sets (unset or empty variables keep the defaults)."""
        path = env.get(DEVICE_PATH)
        return cls(cpu_kernel=env.get(CPU_KERNEL, "1") != "0",
                   cpu_isa=env.get(CPU_ISA, "").strip().lower() or None,
                   device_path=path == "1" if path in ("0", "1") else None,
                   cache_home=env.get("XDG_CACHE_HOME") or None,
                   cxx=env.get("CXX") or "c++",
                   onednn_max_cpu_isa=env.get("ONEDNN_MAX_CPU_ISA", "").upper(),
                   packed_weights=env.get(PACKED_WEIGHTS, "1") != "0")

    def merged(self, **values) -> KernelOptions:
        """These options with the given fields replaced where their value is not None."""
        given = {k: v for k, v in values.items() if v is not None}
        return replace(self, **given) if given else self


T = TypeVar("T")
_defaults: list[KernelOptions] = []
_active: ContextVar[KernelOptions | None] = ContextVar("sluice_kernel_options", default=None)


def defaults() -> KernelOptions:
    """The process's default options: the environment's, read once (or those a test or bench `use`d)."""
    if not _defaults:
        _defaults.append(KernelOptions.from_env())
    return _defaults[0]


def current() -> KernelOptions:
    """The options the kernels run with now: the active engine's, else the defaults."""
    found = _active.get()
    return found if found is not None else defaults()


@contextmanager
def active(options: KernelOptions) -> Iterator[KernelOptions]:
    """Run the block (an engine's load or step) with `options` as the kernels' options."""
    token = _active.set(options)
    try:
        yield options
    finally:
        _active.reset(token)


class derived(Generic[T]):  # noqa: N801 (a decorator, read as one)
    """`compute()` (which reads `current()`) computed once per options object and kept with it; `cache_clear`
    forgets it for the current and the default options (a test that changed what it reads besides)."""

    def __init__(self, compute: Callable[[], T]) -> None:
        self.compute = compute
        functools.update_wrapper(self, compute)

    def __call__(self) -> T:
        memo = current().memo
        if self.compute not in memo:
            memo[self.compute] = self.compute()
        return memo[self.compute]

    def cache_clear(self) -> None:
        """Forget what was derived from the current and the default options."""
        for options in (current(), defaults()):
            options.memo.pop(self.compute, None)


def use(options: KernelOptions) -> None:
    """Make `options` the defaults, as an environment that set them would (tests and benches)."""
    _defaults[:] = [options]


def reset() -> None:
    """Forget the defaults: the next `current()` outside an engine reads the environment again (after a test
    or bench changed it)."""
    _defaults.clear()
