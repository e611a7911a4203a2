"""Read the model's weight files into the page cache from a background thread, started before the worker's
imports, so that the disk read overlaps the seconds of Python start-up instead of following them; and, as
early, reserve the CPU weight arena (engine.weight_reserve: the weights read into it while torch is imported;
that read then is the prefetch).

Torch-free on purpose: it runs before torch (or anything else heavy) is imported.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from sluice.engine import weight_reserve

CHUNK = 16 * 1024 * 1024
MEMORY_SHARE = 0.5  # never prefetch (or fault in ahead) more than this share of the memory available now
# --dtype → the safetensors dtype the floating weights are kept in
KEPT = {"bfloat16": "BF16", "bf16": "BF16", "float16": "F16", "fp16": "F16", "half": "F16", "float32": "F32",
        "fp32": "F32"}
STARTED: list[weight_reserve.PendingReservation] = []  # the process's reservation, once reserve_for made it
GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd")  # where present, device auto may well be a GPU: nothing reserved


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value the command line gives an option (`--flag X` or `--flag=X`; the last one wins), else None."""
    found = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(f"{flag}="):
            found = arg.split("=", 1)[1]
    return found


def model_argument(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> str | None:
    """The worker's model as its command line (`--model X` or `--model=X`) gives it, else $SLUICE_MODEL: from
    `environ` where given, otherwise through Settings (the one reader of the environment; imports
    pydantic)."""
    found = flag_value(argv, "--model")
    if found is not None:
        return found
    if environ is not None:
        return environ.get("SLUICE_MODEL")
    try:
        from sluice.contract.settings import Settings

        return Settings().model
    except Exception:  # a bad SLUICE_* value is the worker's own error to report, not the prefetch's
        return None


def local_weight_files(model: str) -> list[Path]:
    """The safetensors files of a local model folder, in file order (none for a hub id or a missing
    folder)."""
    try:
        return weight_reserve.safetensors_files(Path(model))
    except (OSError, ValueError, KeyError):
        return []


def available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (0 where it cannot be read: then nothing is prefetched)."""
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 0


def read_through(files: Sequence[Path], budget: int) -> int:
    """Read the files once, in order, up to `budget` bytes; returns the bytes read (data lands in the page
    cache)."""
    buffer = bytearray(CHUNK)
    done = 0
    for path in files:
        try:
            with open(path, "rb", buffering=0) as f:
                while done < budget:
                    n = f.readinto(memoryview(buffer)[: min(CHUNK, budget - done)])
                    if not n:
                        break
                    done += n
        except OSError:
            continue
    return done


def prefetch_for(argv: Sequence[str]) -> threading.Thread:
    """Prefetch the weights of the model the worker's command line names; a model named only by $SLUICE_MODEL
    is looked up inside the thread, so that not even the settings import delays the main thread's start-up."""
    thread = threading.Thread(target=prefetch_argv, args=(argv,), name="prefetch-weights", daemon=True)
    thread.start()
    return thread


def prefetch_argv(argv: Sequence[str], reservation: weight_reserve.WeightReservation | None = None) -> int:
    """Read the weights of the model the command line names through the page cache, unless the arena's
    reservation (default: the process's, reserve_for) reads them; returns the bytes read here."""
    model = model_argument(argv)
    reservation = reservation if reservation is not None else process_reservation()
    if not model or weight_reserve.reading_ahead(reservation, model):
        return 0
    return read_through(*_plan(model))


def prefetch(model: str | None) -> threading.Thread | None:
    """Start reading the model's weights into the page cache in a daemon thread (None: nothing to read)."""
    files, budget = _plan(model)
    if not files:
        return None
    thread = threading.Thread(target=read_through, args=(files, budget), name="prefetch-weights", daemon=True)
    thread.start()
    return thread


def _plan(model: str | None) -> tuple[list[Path], int]:
    """The model's weight files and the byte budget for reading them (no files: nothing to read)."""
    files = local_weight_files(model) if model else []
    return files, int(available_memory() * MEMORY_SHARE) if files else 0


def arena_plan(argv: Sequence[str], model: str | None) -> tuple[str, str, int, bool] | None:
    """engine.weight_reserve.reserve's arguments for the CPU weight arena the worker's command line will load
    `model` into (folder, safetensors dtype of its floating weights, bytes to read or fault in ahead at most,
    auto weight loading), or None where it loads none or that cannot be told without torch: another device (or
    device auto on a host with a GPU), quantization at load, mapped weights, no huge-page arena, a dtype it
    does not know."""
    if not model or not (Path(model) / "config.json").is_file():
        return None
    device = flag_value(argv, "--device") or "auto"
    if device != "cpu" and (device != "auto" or any(Path(p).exists() for p in GPU_DEVICES)):
        return None
    loading = flag_value(argv, "--weight-loading") or "auto"
    if flag_value(argv, "--quantization") or "--no-huge-pages" in argv or loading not in ("auto", "copy"):
        return None
    kept = KEPT.get(_dtype(argv, Path(model)))
    return (model, kept, int(available_memory() * MEMORY_SHARE), loading == "auto") if kept else None


def _dtype(argv: Sequence[str], model: Path) -> str:
    """The worker's --dtype; for auto (the default) the checkpoint's, as the engine resolves it on CPU."""
    dtype = flag_value(argv, "--dtype") or "auto"
    if dtype != "auto":
        return dtype
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    stored = str(config.get("torch_dtype") or config.get("dtype") or "float32").replace("torch.", "")
    return "bfloat16" if stored == "float16" else stored


def reserve_for(argv: Sequence[str]) -> weight_reserve.PendingReservation:
    """Reserve the CPU weight arena of the model the worker's command line names (arena_plan) from a daemon
    thread: the main thread goes on to its imports at once. The process's reservation from then on, which the
    worker hands to its LLM (worker.cli.load)."""
    pending = weight_reserve.reserve_later(lambda: arena_plan(argv, model_argument(argv)))
    STARTED[:] = [pending]
    return pending


def process_reservation() -> weight_reserve.PendingReservation | None:
    """The reservation `reserve_for` started in this process (the worker's entry point), if any."""
    return STARTED[0] if STARTED else None
