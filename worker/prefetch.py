"""Read the model's weight files into the page cache from a background thread, started before the worker's
imports, so that the disk read overlaps the seconds of Python start-up instead of following them.

Torch-free on purpose: it runs before torch (or anything else heavy) is imported.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

CHUNK = 16 * 1024 * 1024
MEMORY_SHARE = 0.5  # never prefetch more than this share of the memory available now


def model_argument(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> str | None:
    """The worker's model as its command line (`--model X` or `--model=X`) gives it, else $SLUICE_MODEL: from
    `environ` where given, otherwise through Settings (the one reader of the environment; imports pydantic)."""
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    if environ is not None:
        return environ.get("SLUICE_MODEL")
    try:
        from sluice.contract.settings import Settings

        return Settings().model
    except Exception:  # a bad SLUICE_* value is the worker's own error to report, not the prefetch's
        return None


def weight_files(model: str) -> list[Path]:
    """The safetensors files of a local model folder, in file order (none for a hub id or a missing folder)."""
    root = Path(model)
    index = root / "model.safetensors.index.json"
    try:
        if index.is_file():
            return sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
        return sorted(root.glob("*.safetensors"))
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
    """Read the files once, in order, up to `budget` bytes; returns the bytes read (data lands in the page cache)."""
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
    """Prefetch the weights of the model the worker's command line names; a model named only by $SLUICE_MODEL is
    looked up inside the thread, so that not even the settings import delays the main thread's start-up."""
    thread = threading.Thread(target=lambda: read_through(*_plan(model_argument(argv))), name="prefetch-weights",
                              daemon=True)
    thread.start()
    return thread


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
    files = weight_files(model) if model else []
    return files, int(available_memory() * MEMORY_SHARE) if files else 0
