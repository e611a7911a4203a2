"""`sluice doctor`: what a user pastes into a bug report (CPU flags and tier, C++ kernels, versions, device);
`--build` compiles every CPU kernel for the chosen tier ahead of time (an image build, a fleet's first start)
unless the wheel's prebuilt object serves it."""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path

import typer

# the host flags worth a line in a report: the ones the tiers are chosen from, and a few that tell CPUs apart
REPORTED_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw",
                  "avx512vl",
                  "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text(errors="replace").splitlines() if info.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor() or platform.machine())


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()})"
    return f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def kernel_report(build: bool = False) -> list[dict[str, object]]:
    """Per CPU kernel library: where the chosen tier's object comes from (the wheel's prebuilt one, built
    here, or the torch fallback), whether it is ready, and its path (built now with `build` where not
    prebuilt)."""
    from sluice.kernels import cpp_build

    rows = []
    for source, name in sorted(cpp_build.EXTENSIONS.items()):
        wheel, why = cpp_build.prebuilt_path(name, source)
        cached = cpp_build.library_path(name, source)
        if build and wheel is None and not cached.exists():
            cpp_build.load(name, source)
        rows.append({"kernel": name, "source": source, "origin": _origin(wheel, cached),
                     "built": wheel is not None or cached.exists(), "path": str(wheel or cached),
                     "prebuilt": "matches" if wheel is not None else why})
    return rows


def _origin(wheel: Path | None, cached: Path) -> str:
    """'prebuilt (wheel)', 'built here (cache)', or why the torch implementations serve instead."""
    from sluice.kernels import cpp_build

    if not cpp_build.enabled():
        return "torch fallback (SLUICE_CPU_KERNEL=0)"
    if wheel is not None:
        return "prebuilt (wheel)"
    if cached.exists():
        return "built here (cache)"
    if cpp_build.compiler() is None:
        return "torch fallback (no prebuilt object matches and no C++ compiler)"
    return "not built yet: builds here on first use"


def model_report(model: str) -> dict[str, str]:
    """Which engine path a checkpoint folder takes (native or generic) and why, or why it is refused."""
    from sluice.engine.models import model_path_for
    from sluice.engine.models.loader import read_config

    try:
        path, reason = model_path_for(read_config(model))
    except (ValueError, FileNotFoundError) as exc:
        return {"model": model, "model_path": "refused", "model_reason": str(exc)}
    return {"model": model, "model_path": path, "model_reason": reason}


def report(build: bool = False, model: str | None = None) -> dict[str, object]:
    """Everything `sluice doctor` prints, as a dict."""
    import torch

    from sluice.kernels import cpp_build, cpu_isa

    flags = cpu_isa.cpu_flags()
    return {
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu": _cpu_model(), "cpu_flags": [f for f in REPORTED_FLAGS if f in flags],
        "host_tier": cpu_isa.host_tier(), "tier": cpu_isa.tier(), "tier_cap": cpu_isa.cap_setting(),
        "tier_flags": cpu_isa.compile_flags(cpu_isa.tier()),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_kernels_enabled": cpp_build.enabled(), "compiler": cpp_build.compiler(),
        "compiler_version": cpp_build.compiler_version(), "kernel_cache": str(cpp_build.cache_root()),
        "kernels": kernel_report(build and cpp_build.enabled()),
        "torch": torch.__version__, "transformers": _version("transformers"), "sluice": _version("sluice"),
        "device": _device(), **(model_report(model) if model else {}),
    }


def doctor(
    build: bool = typer.Option(False, "--build", help="compile every CPU kernel for the chosen tier now"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    model: str = typer.Option(None, "--model",
                              help="a checkpoint folder: which engine path it takes and why"),
) -> None:
    """Print the host's CPU flags, the kernel tier chosen, the C++ kernels' state and the versions in use."""
    info = report(build, model)
    if as_json:
        typer.echo(json.dumps(info, indent=1))
        return
    for key, value in info.items():
        if key == "kernels":
            continue
        typer.echo(f"{key}: {' '.join(value) if isinstance(value, list) else value}")
    for row in info["kernels"]:
        typer.echo(f"kernel {row['kernel']}: {row['origin']} {row['path']}")
    if build and not all(row["built"] for row in info["kernels"]) and info["cpu_kernels_enabled"]:
        raise typer.Exit(1)
