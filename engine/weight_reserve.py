"""The CPU weight arena's memory, mapped and faulted in while the worker is still importing torch.

The first write to each page of fresh anonymous memory is a page fault, and in a VM guest (Firecracker) that is
expensive: reading a checkpoint into a fresh arena costs several times reading the same bytes into one reused
buffer (docs/benchmarks.md, cold start). Importing torch keeps one core busy for a second and more and leaves the
others idle. So the worker's entry point, before its first heavy import, calls `reserve` with the checkpoint's
folder: it reads the safetensors headers (JSON: no torch), maps what engine.weight_memory's arena will be, and
faults its pages in from a thread (MADV_POPULATE_WRITE, Linux 5.14+, through ctypes, which releases the GIL for
the call: the import goes on meanwhile). The loader's arena then `take`s that map instead of making its own, and
hands back the pages faulted past what it wrote (`Reservation.finish`): no second copy, nothing kept unused. A
map that does not fit (another model, dtype, a larger arena) is unmapped and the arena maps its own, as before.

Torch-free on purpose: it runs before torch is imported.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # the arena starts on a huge page boundary (engine.weight_memory)
MADV_DONTNEED, MADV_POPULATE_WRITE = 4, 23  # Linux's values (MADV_POPULATE_WRITE is not in Python's mmap module)
MAP_ALL_BYTES = 4 << 30  # from this many stored bytes the loader maps the checkpoint (weight_loading auto): no arena
# Bytes faulted a call. A call holds the process's address-space lock (mmap_lock, read side) throughout, and every
# mmap/mprotect of the importing thread (dlopen of torch's libraries) waits for it to end: short calls keep those
# waits short (docs/benchmarks.md, cold start, session 5); `finish` waits for at most one.
SPAN = HUGE_PAGE
# safetensors dtype → (bytes an element, floating point: kept in the model's dtype)
DTYPES = {
    "BF16": (2, True), "F16": (2, True), "F32": (4, True), "F64": (8, True), "F8_E4M3": (1, True),
    "F8_E5M2": (1, True), "I8": (1, False), "U8": (1, False), "I16": (2, False), "I32": (4, False),
    "I64": (8, False), "BOOL": (1, False),
}


def read_header(file: Path) -> tuple[int, dict[str, dict]]:
    """A safetensors file's JSON header: the offset its data starts at, and its tensors by name."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def safetensors_files(root: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every *.safetensors in the folder."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(root.glob("*.safetensors"))


def arena_capacity(nbytes: int) -> int:
    """The arena's capacity for `nbytes` of weights as the model keeps them: room for what the quantized linears
    keep beside them (their row sums: a little more than their bytes) and for later adoptions."""
    return nbytes + nbytes // 64 + (64 << 20)


def kept_bytes(tensors: Iterable[tuple[str, int]], itemsize: int) -> int:
    """The bytes the model keeps of tensors given as (safetensors dtype, stored bytes): floating ones in a dtype of
    `itemsize` bytes, the others as stored."""
    total = 0
    for dtype, nbytes in tensors:
        own, floating = DTYPES[dtype]
        total += nbytes // own * (itemsize if floating else own)
    return total


def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # a foreign call: the GIL is released meanwhile
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


class Reservation:
    """An anonymous map of `capacity` bytes (plus the huge page its start is aligned to) whose first `fault`
    bytes from that start are faulted in by a daemon thread."""

    def __init__(self, key: str, capacity: int, fault: int) -> None:
        self.key, self.capacity = key, capacity
        self.map = mmap.mmap(-1, capacity + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(anchor)
        del anchor  # no export of the map left behind: it can still be closed
        self.start = (-self.address) % HUGE_PAGE
        self.fault, self.faulted = min(fault, capacity), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fault_in, name="sluice-prefault", daemon=True)
        self._thread.start()

    def _fault_in(self) -> None:
        """Fault the pages in, a span a call, until done, stopped, or refused (a kernel before 5.14, no memory)."""
        madvise = _madvise()
        while self.faulted < self.fault and not self._stop.is_set():
            n = min(SPAN, self.fault - self.faulted)
            if madvise(self.address + self.start + self.faulted, n, MADV_POPULATE_WRITE) != 0:
                log.debug("MADV_POPULATE_WRITE: errno %d (the arena faults its pages as it is written)",
                          ctypes.get_errno())
                return
            self.faulted += n

    def finish(self, used: int) -> int:
        """Stop faulting and hand back the pages faulted past the first `used` bytes from the start (the arena
        writes none of them: a later write gets a fresh page); returns the bytes handed back."""
        self._stop.set()
        self._thread.join()
        keep = -(-(self.start + used) // mmap.PAGESIZE) * mmap.PAGESIZE
        end = self.start + self.faulted
        if end <= keep:
            return 0
        _madvise()(self.address + keep, end - keep, MADV_DONTNEED)
        return end - keep

    def close(self) -> None:
        """Stop faulting and unmap."""
        self.finish(0)
        self.map.close()


_reserved: Reservation | None = None
_lock = threading.Lock()
_planned = threading.Event()  # clear while reserve_later's thread has not yet decided
_planned.set()
PLAN_WAIT = 30.0  # seconds `take` waits for that decision at most


def key_of(model_dir: str | Path) -> str:
    """The name a reservation is kept under: the checkpoint folder's real path."""
    return os.path.realpath(model_dir)


def reserve(model_dir: str | Path, itemsize: int, budget: int, map_large: bool = True) -> Reservation | None:
    """Map and start faulting in the arena for the checkpoint in `model_dir`, its floating tensors kept in a
    dtype of `itemsize` bytes, at most `budget` bytes of it faulted in; None (nothing done) off Linux, where the
    folder has no readable safetensors, or where the loader will map it (`map_large`: weight_loading auto)."""
    global _reserved
    if sys.platform != "linux":
        return None
    try:
        root = Path(model_dir)
        tensors = [(e["dtype"], e["data_offsets"][1] - e["data_offsets"][0])
                   for file in safetensors_files(root) for e in read_header(file)[1].values()]
        kept = kept_bytes(tensors, itemsize)
        if not kept or budget <= 0 or (map_large and sum(n for _, n in tensors) >= MAP_ALL_BYTES):
            return None
        reservation = Reservation(key_of(root), arena_capacity(kept), min(kept, budget))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    with _lock:
        old, _reserved = _reserved, reservation
    if old is not None:
        old.close()
    return reservation


def reserve_later(plan: Callable[[], tuple[str | Path, int, int, bool] | None]) -> threading.Thread:
    """`reserve(*plan())` from a daemon thread (the plan may import what the caller should not wait for; None:
    nothing to reserve); `take` waits for it to have decided."""
    _planned.clear()

    def run() -> None:
        try:
            found = plan()
            if found is not None:
                reserve(*found)
        except Exception:  # a wrong guess costs only the overlap: the arena maps its own
            log.debug("no arena reserved", exc_info=True)
        finally:
            _planned.set()

    thread = threading.Thread(target=run, name="sluice-reserve", daemon=True)
    thread.start()
    return thread


def take(model_dir: str | Path, capacity: int) -> Reservation | None:
    """The reservation for the checkpoint in `model_dir` if it has room for an arena of `capacity` bytes (it is
    then the caller's); a reservation for it that is too small is unmapped. Others are left for their model."""
    global _reserved
    _planned.wait(PLAN_WAIT)
    with _lock:
        found = _reserved
        if found is None or found.key != key_of(model_dir):
            return None
        _reserved = None
    if found.capacity < capacity:
        found.close()
        return None
    return found


def discard() -> bool:
    """Unmap the reservation nobody took (its model loaded elsewhere, or not at all); True if there was one."""
    global _reserved
    _planned.wait(PLAN_WAIT)
    with _lock:
        found, _reserved = _reserved, None
    if found is not None:
        found.close()
    return found is not None
