"""Build the C++ CPU kernels in csrc/ once per ISA tier into a per-user cache; no toolchain or a compile error
means torch fallbacks.

Each extension is one shared object per tier (kernels.cpu_isa), compiled with that tier's explicit flags
(never -march=native) from the installed package's csrc/, under a key of its sources, the tier's flags, the
compiler (path, size, mtime), torch and Python: a cache on a shared volume or baked into an image never hands
an older CPU an instruction it lacks, and never a library built for another torch. Builds happen in a
temporary folder under an flock and are published by one rename, so N workers starting together build once and
never load a half-written library; a cached library is loaded directly, without running the compiler or ninja.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from sluice.kernels import cpu_isa, options

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BASE_CFLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
               "-fopenmp"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
# The libraries: csrc/ source -> name. cpu_kernels.cpp holds the kernels every step runs (PARTS, one submodule
# each); the sources it includes are not built on their own.
EXTENSIONS = {"cpu_kernels.cpp": "sluice_cpu_kernels", "moe.cpp": "sluice_moe_cpu"}
CORE = "cpu_kernels.cpp"
PARTS = ("elementwise", "rms_norm", "paged_attention", "bf16_gemv", "quant_linear", "nf4", "decode_stack",
         "masked_sample", "lora", "varlen_attention")
_built: dict[tuple[str, str], object | None] = {}
# The wheel's objects: prebuilt/<tier>/<module>.so and prebuilt/manifest.json (absent in a source checkout).
PREBUILT = Path(__file__).parent / "prebuilt"
MANIFEST = "manifest.json"


def enabled() -> bool:
    """False where SLUICE_CPU_KERNEL=0 or the engine's config (kernels.options) asks for torch's kernels."""
    return options.current().cpu_kernel


def cache_root() -> Path:
    """The per-user kernel cache: $XDG_CACHE_HOME/sluice/kernels (~/.cache/sluice/kernels by default)."""
    base = options.current().cache_home or str(Path.home() / ".cache")
    return Path(base) / "sluice" / "kernels"


def cflags(tier: str) -> list[str]:
    """Every compiler flag of an extension built for `tier`."""
    return BASE_CFLAGS + cpu_isa.compile_flags(tier)


def compiler() -> str | None:
    """The C++ compiler torch's build would use ($CXX, else c++), resolved on PATH; None when there is
    none."""
    found = shutil.which(options.current().cxx)
    return None if found is None else os.path.realpath(found)


def _compiler_identity() -> str:
    """The compiler's path, size and mtime (a new compiler version changes them) without running it."""
    path = compiler()
    if path is None:
        return "none"
    st = os.stat(path)
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def compiler_version() -> str:
    """The compiler's first `--version` line (runs it: for the build record and `sluice doctor` only)."""
    path = compiler()
    if path is None:
        return "none"
    try:
        return subprocess.run([path, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _sources(source: str) -> list[str]:
    """`source` and every csrc/ file it `#include "..."`s, transitively, each once, in the order first met."""
    found, todo = [], [source]
    while todo:
        name = todo.pop(0)
        if name not in found:
            found.append(name)
            todo += INCLUDE.findall((CSRC / name).read_text())
    return found


def _torch_version() -> str:
    import torch

    return torch.__version__


def object_tier(tier: str, source: str) -> str:
    """The tier whose object serves `tier` for `source`: itself, except `amx` where no source it includes has
    AMX code (then the avx512_bf16 object, the same code without the tile flags: one build fewer per
    kernel)."""
    if tier == "amx" and not any("__AMX" in (CSRC / f).read_text() for f in _sources(source)):
        return "avx512_bf16"
    return tier


def build_name(name: str, source: str, tier: str | None = None) -> str:
    """The extension's module name and cache folder: `name`, the tier of its object, and a hash of the sources
    it includes, the flags, the compiler, torch and Python (not the checkout's path: one cache serves every
    install)."""
    tier = object_tier(cpu_isa.tier() if tier is None else tier, source)
    key = b"".join(f.encode() + b"\0" + (CSRC / f).read_bytes() for f in _sources(source))
    key += "\0".join([*cflags(tier), _compiler_identity(), _torch_version(), sys.version]).encode()
    return f"{name}_{tier}_{hashlib.sha256(key).hexdigest()[:16]}"


def library_path(name: str, source: str, tier: str | None = None) -> Path:
    """Where the built extension lives (present or not)."""
    versioned = build_name(name, source, tier)
    return cache_root() / versioned / f"{versioned}.so"


def source_hash(source: str) -> str:
    """A hash of `source` and every csrc/ file it includes, names and contents."""
    return hashlib.sha256(b"".join(f.encode() + b"\0" + (CSRC / f).read_bytes()
                                   for f in _sources(source))).hexdigest()


def python_abi() -> str:
    """The running Python's extension ABI (cpython-311-x86_64-linux-gnu)."""
    return sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag


def prebuilt_flags(tier: str) -> list[str]:
    """The flags of the wheel's object for `tier`: the tier's own and the optional features (VNNI) the tier
    may use, as on a CPU that has them (a CPU without them gets other `cflags`, so builds its own)."""
    return BASE_CFLAGS + cpu_isa.compile_flags(tier, frozenset(cpu for cpu, _, _ in cpu_isa.OPTIONAL))


def prebuilt_objects() -> list[tuple[str, str, str]]:
    """(name, source, object tier) of every object a wheel carries: each library for each tier, the `amx` tier
    served by the `avx512_bf16` object where the library has no AMX code (`object_tier`)."""
    return [(name, source, t) for source, name in sorted(EXTENSIONS.items())
            for t in dict.fromkeys(object_tier(tier, source) for tier in cpu_isa.TIERS)]


@functools.cache
def _manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def prebuilt_path(name: str, source: str, tier: str | None = None) -> tuple[Path | None, str]:
    """The wheel's object for `name` at `tier` (default: the chosen one) where its manifest matches the
    running torch, Python ABI, kernel sources and this CPU's flags for the tier; else None and why not."""
    tier = object_tier(cpu_isa.tier() if tier is None else tier, source)
    manifest = _manifest(PREBUILT)
    if manifest is None:
        return None, "no prebuilt objects installed (a source install)"
    if manifest["torch"] != _torch_version():
        return None, f"the wheel's objects are for torch {manifest['torch']}, not {_torch_version()}"
    if manifest["python_abi"] != python_abi():
        return None, f"the wheel's objects are for {manifest['python_abi']}, not {python_abi()}"
    entry = next((e for e in manifest["objects"] if e["name"] == name and e["tier"] == tier), None)
    if entry is None:
        return None, f"the wheel has no {tier} object for {name}"
    if entry["source_hash"] != source_hash(source):
        return None, "the kernel sources differ from the wheel's"
    if entry["flags"] != cflags(tier):
        return None, f"this CPU's {tier} flags differ from the wheel's ({' '.join(entry['flags'])})"
    path = PREBUILT / entry["file"]
    return (path, "prebuilt (wheel)") if path.is_file() else (None, f"{path} is missing")


def compile_command(module: str, source: str, tier: str, target: Path) -> list[str]:
    """The compiler command that builds `source` as the extension `module` for `tier` into `target`, as
    torch's JIT build would (its includes, C++ standard and libraries) with the tier's explicit
    `prebuilt_flags`."""
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [*include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    cmd = [compiler() or options.current().cxx, "-shared", "-fPIC", "-std=c++20",
           f"-DTORCH_EXTENSION_NAME={module}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    cmd += [arg for path in includes for arg in ("-isystem", path)]
    cmd += [*prebuilt_flags(tier), str(CSRC / source), "-o", str(target), "-fopenmp"]
    return cmd + [f"-L{path}" for path in library_paths("cpu")] + ["-lc10", "-ltorch_cpu", "-ltorch",
                                                                   "-ltorch_python"]


def compile_prebuilt(out: Path, jobs: int | None = None) -> dict:
    """Compile every library for every tier (`prebuilt_objects`) into `out`/<tier>/ and write
    `out`/manifest.json: the package build's step for a platform wheel. Nothing is imported (a host may lack
    the tier's instructions)."""
    if compiler() is None:
        raise RuntimeError(
            f"building the prebuilt kernels needs a C++ compiler: {options.current().cxx} not found")
    entries = []
    for name, source, tier in prebuilt_objects():
        digest = source_hash(source)
        entries.append({"name": name, "source": source, "tier": tier, "source_hash": digest,
                        "file": f"{tier}/{name}_{tier}_{digest[:16]}.so", "flags": prebuilt_flags(tier)})

    def compile_one(entry: dict) -> None:
        target = out / entry["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        cmd = compile_command(target.stem, entry["source"], entry["tier"], target)
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {entry['file']} failed: {' '.join(cmd)}\n{result.stderr[-4000:]}")
        print(f"compiled {entry['file']} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, entries))
    manifest = {"torch": _torch_version(), "python_abi": python_abi(), "compiler_version": compiler_version(),
                "objects": entries}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _import(module: str, path: Path):
    """Import the extension `module` from its shared object `path` (no compiler, no ninja)."""
    if module in sys.modules:
        return sys.modules[module]
    spec = importlib.util.spec_from_file_location(module, path)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    sys.modules[module] = ext
    return ext


@contextmanager
def _visible_build(versioned: str, source: str, tier: str, folder: Path, why: str):
    """Say on stderr what is compiled, for which tier, where, why, and about how long, with a progress display
    (the compiler runs once per library: its bar completes when the library is built, the clock runs
    meanwhile)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    parts = f" ({len(PARTS)} parts: {', '.join(PARTS)})" if source == CORE else ""
    console.print(f"sluice: compiling the C++ CPU kernels {versioned}{parts} for the {tier} tier into "
                  f"{folder}, about a minute, once per machine ({why}; a wheel's prebuilt objects skip this)",
                  markup=False, highlight=False, soft_wrap=True)
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
    start = time.monotonic()
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(f"{source} [{tier}]", total=1)
        yield
        progress.update(task, completed=1)
    console.print(f"sluice: built {versioned} in {time.monotonic() - start:.0f} s", markup=False,
                  highlight=False)


@contextmanager
def _build_lock(root: Path, versioned: str):
    """An exclusive flock per extension, released by the OS even if its holder is killed."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{versioned}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(versioned: str, source: str, tier: str, final: Path, why: str = ""):
    """Compile into a fresh temporary folder, record how, and publish it as `final` by one rename."""
    from torch.utils.cpp_extension import load as torch_load

    for stale in final.parent.glob(f"{versioned}.tmp*"):  # a build killed midway: nobody else holds the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{versioned}.tmp", dir=final.parent))
    try:
        with _visible_build(versioned, source, tier, final.parent, why):
            ext = torch_load(name=versioned, sources=[str(CSRC / source)], extra_cflags=cflags(tier),
                             extra_ldflags=["-fopenmp"], build_directory=str(tmp), verbose=False)
        record = {"tier": tier, "flags": cflags(tier), "compiler": compiler(),
                  "compiler_version": compiler_version(),
                  "torch": _torch_version(), "sources": _sources(source)}
        (tmp / "build.json").write_text(json.dumps(record, indent=1))
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sys.modules[versioned] = ext
    return ext


def build(name: str, source: str, tier: str | None = None):
    """The extension `name` from csrc/`source` for `tier` (default: the chosen one): the wheel's prebuilt
    object where it matches, else built once per cache."""
    tier = object_tier(cpu_isa.tier() if tier is None else tier, source)
    wheel, why = prebuilt_path(name, source, tier)
    if wheel is not None:
        return _import(wheel.stem, wheel)
    versioned = build_name(name, source, tier)
    path = cache_root() / versioned / f"{versioned}.so"
    if path.exists():
        return _import(versioned, path)
    with _build_lock(cache_root(), versioned):
        if path.exists():  # another process built it while we waited
            return _import(versioned, path)
        return _build(versioned, source, tier, path.parent, why)


def part(name: str, tier: str | None = None):
    """The submodule `name` (one of PARTS: csrc/`name`.cpp's functions) of the core library for `tier`, or
    None when that library cannot be built (the caller falls back to torch)."""
    core = load(EXTENSIONS[CORE], CORE, tier)
    return None if core is None else getattr(core, name)


def load(name: str, source: str, tier: str | None = None):
    """The extension `name` built from csrc/`source` for `tier` (cached per process), or None when it cannot
    be built (no compiler, a compile error: the caller falls back to torch)."""
    key = (name, cpu_isa.tier() if tier is None else tier)
    if key not in _built:
        try:
            _built[key] = build(name, source, key[1])
        except Exception as exc:  # toolchain missing, compiler error: fall back to torch
            log.warning("CPU kernel %s (%s) unavailable, using torch: %s", name, key[1], exc)
            _built[key] = None
    return _built[key]
