"""CPU weights in one arena of transparent huge pages.

A decode step streams every weight once. In 4 KB pages that is a TLB miss every 64 cache lines and a stop of
the hardware prefetchers at every page edge; in 2 MB pages the GEMVs and the memory-bound decode steps run
faster (docs/benchmarks.md, "Decode step, weights in huge pages vs 4 KB pages"); compute-bound steps are
unchanged. So on CPU the loader reads the weights it keeps straight into one arena (`empty`), copies in what
is made later, the quantized linears (`adopt`), and `settle` then turns the arena into huge pages in a
background thread: MADV_COLLAPSE (Linux 6.1+) copies each 2 MB while the engine already runs (at fault time,
with `defrag=madvise`, the same pages would cost the load several times its 4 KB faults). MADV_HUGEPAGE is set
too, so khugepaged collapses the arena over time where MADV_COLLAPSE is missing. The collapsing thread runs at
the lowest CPU priority (nice 19) and in the engine's idle time (`busy` / `idle`, a few MB a call; while the
engine has work, a span now and then only): copying the weights into huge pages costs CPU seconds a gigabyte
on a small host, and a step sharing the cores with it, even at nice 19, waited on it (a worker's first tokens
took several times as long: docs/benchmarks.md, coldstart). Page-cache maps of the checkpoint
(weight_loading=mmap) stay 4 KB pages: a file map collapses only on kernels built with READ_ONLY_THP_FOR_FS.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import math
import mmap
import os
import sys
import threading

import torch
from torch import nn

from sluice.engine.weight_reserve import HUGE_PAGE, SLOT_ALIGNMENT, Reservation

log = logging.getLogger(__name__)

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux's values (MADV_COLLAPSE is not in Python's mmap module)
# A call a span: the first that fails (no huge page to be had now) ends the pass; between two, the pass waits
# while the engine has work (`busy`), so a step that starts meanwhile shares the cores with at most one span's
# copy, but at most COLLAPSE_PACE seconds: an engine that is never idle still gets its huge pages, a span at a
# time.
COLLAPSE_SPAN = 4 << 20
COLLAPSE_PACE = 0.1
COLLAPSE_NICE = 19  # the collapsing thread's priority: the lowest, so serving's threads come first


def _slot(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


class WeightArena:
    """A bump allocator over one lazily committed anonymous map (pages are committed only where written), its
    start on a huge page boundary: a `reservation` of room enough (engine.weight_reserve: mapped, and the
    weights read into it, while torch was imported) is that map, its tensors read ahead taken as they lie
    (`placed`) and the allocator starting past them; else the arena maps its own."""

    def __init__(self, capacity: int, reservation: Reservation | None = None) -> None:
        if reservation is not None and reservation.capacity < capacity:
            reservation.close()
            reservation = None
        self.reservation = reservation
        self._map = reservation.map if reservation is not None else mmap.mmap(
            -1, capacity + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._start = (-self._bytes.data_ptr()) % HUGE_PAGE
        self.capacity, self.used = capacity, 0
        # transient tensors read ahead (offsets into the map, in order)
        self._passing: list[tuple[int, int]] = []
        if reservation is not None:
            self.capacity, self.used = reservation.capacity, _slot(reservation.ahead)
            self._passing = sorted((self._start + s.at, self._start + s.at + s.nbytes)
                                   for s in reservation.slots.values() if s.transient)
        # bytes the reservation had faulted in (or read) ahead (set by `finish_reservation`)
        self.prefaulted = 0
        self.settled = threading.Event()
        self.collapse_nice: int | None = None  # the collapsing thread's nice value, once it runs
        self._quiet = threading.Event()  # set while the engine has no work: the collapse goes on unpaced
        self._quiet.set()

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised contiguous tensor in the arena, or None when it does not fit."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.used + nbytes > self.capacity:
            return None
        at = self._start + self.used
        self.used += _slot(nbytes)
        return self._bytes[at : at + nbytes].view(dtype).view(shape)

    def placed(self, parts: list[tuple[str, int, int]], shape: tuple[int, ...] | torch.Size,
               dtype: torch.dtype) -> torch.Tensor | None:
        """The checkpoint tensors `parts` ((weight file name, offset, bytes) each), stacked, as the
        reservation read them ahead into the arena: a tensor of `shape` and `dtype` over their bytes; None
        where it did not."""
        if self.reservation is None:
            return None
        at = self.reservation.placed(parts)
        if at is None:
            return None
        at += self._start
        return self._bytes[at : at + sum(n for _, _, n in parts)].view(dtype).view(shape)

    def finish_reservation(self) -> int:
        """Once everything is in the arena (`settle` calls it: the loader's reads and the engine's adoptions
        done), a reservation stops faulting in and hands back its pages past `used` (none is kept unwritten);
        returns the bytes handed back."""
        if self.reservation is None:
            return 0
        reservation, self.reservation = self.reservation, None
        released = reservation.finish(self.used)
        self.prefaulted = reservation.faulted
        taken = [reservation.slots[n] for n in reservation.taken]
        log.info("weight arena: %d MB written, %d MB of it faulted in ahead at the start, %d MB of tensors "
                 "read ahead and taken, %d MB read ahead for the load to rebuild (handed back)",
                 self.used >> 20,
                 min(self.prefaulted, self.used) >> 20, sum(s.nbytes for s in taken if not s.transient) >> 20,
                 sum(s.nbytes for s in taken if s.transient) >> 20)
        return released

    def data_ptr(self) -> int:
        """The address of the arena's first byte (on a huge page boundary)."""
        return self._bytes.data_ptr() + self._start

    def holds(self, t: torch.Tensor) -> bool:
        base = self._bytes.data_ptr()
        return t.device.type == "cpu" and base <= t.untyped_storage().data_ptr() < base + len(self._map)

    def passing(self, t: torch.Tensor) -> bool:
        """Whether `t` lies on a transient tensor read ahead (its pages go back when the arena settles)."""
        at = t.data_ptr() - self._bytes.data_ptr()
        i = bisect.bisect_right(self._passing, (at, math.inf)) - 1
        return self.holds(t) and i >= 0 and at < self._passing[i][1]

    def adopt(self, model: nn.Module) -> int:
        """Move every CPU parameter and buffer of `model` that lies outside the arena, or on a transient
        tensor read ahead (`passing`), into it, views of one storage kept views of one copy (bitsandbytes'
        modules excepted: they keep tensors of their own beside their parameters); returns the bytes moved.
        Tensors that do not fit stay where they are."""
        storages: dict[int, list[torch.Tensor]] = {}
        moved = 0
        for mod in model.modules():
            if type(mod).__module__.startswith("bitsandbytes"):
                continue
            for t in [*mod._parameters.values(), *mod._buffers.values()]:
                if t is None or t.device.type != "cpu" or not t.numel():
                    continue
                if self._passing and self.passing(t):
                    moved += self._move(t)
                elif not self.holds(t):
                    views = storages.setdefault(t.untyped_storage().data_ptr(), [])
                    if all(v is not t for v in views):
                        views.append(t)
        for views in storages.values():
            old = views[0].untyped_storage()
            new = self.empty((old.nbytes(),), torch.uint8)
            if new is None:
                continue
            new.copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (old.nbytes(),)))
            for t in views:
                typed = new.view(t.dtype)
                t.data = typed.as_strided(t.shape, t.stride(), typed.storage_offset() + t.storage_offset())
            moved += old.nbytes()
        return moved

    def _move(self, t: torch.Tensor) -> int:
        """Copy the tensor `t` alone (not the storage it views: the arena's own) to a place of its own in the
        arena (a copy of torch's where it does not fit: those pages go back at `settle`); the bytes moved."""
        new = self.empty(t.shape, t.dtype)
        if new is None:
            t.data = t.clone()
            return 0
        new.copy_(t)
        t.data = new
        return t.nbytes

    def busy(self) -> None:
        """The engine has work: a background collapse waits up to COLLAPSE_PACE before each span until
        `idle`."""
        self._quiet.clear()

    def idle(self) -> None:
        """The engine has no work left: a background collapse goes on unpaced."""
        self._quiet.set()

    def settle(self, background: bool = True) -> None:
        """Ask for huge pages over the written part of the arena: MADV_HUGEPAGE, then MADV_COLLAPSE (in a
        daemon thread unless `background` is False). `settled` is set when done."""
        self.finish_reservation()
        end = (self._start + self.used) // HUGE_PAGE * HUGE_PAGE
        if sys.platform != "linux" or end <= self._start:
            self.settled.set()
            return
        if background:
            threading.Thread(target=self._collapse_behind, args=(end,), name="sluice-huge-pages",
                             daemon=True).start()
        else:
            self._collapse(end)

    def _collapse_behind(self, end: int) -> None:
        """_collapse from a thread of the lowest priority (this one), paced while the engine has work."""
        self.collapse_nice = _lower_priority()
        self._collapse(end, self._quiet)

    def _collapse(self, end: int, quiet: threading.Event | None = None) -> None:
        try:
            # a foreign call: the GIL is released meanwhile
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            base = self._bytes.data_ptr()
            madvise(base + self._start, end - self._start, MADV_HUGEPAGE)
            for at in range(self._start, end, COLLAPSE_SPAN):
                if quiet is not None:
                    quiet.wait(COLLAPSE_PACE)
                if madvise(base + at, min(COLLAPSE_SPAN, end - at), MADV_COLLAPSE) != 0:
                    log.debug("MADV_COLLAPSE: errno %d (khugepaged may collapse the weights later)",
                              ctypes.get_errno())
                    break
        finally:
            self.settled.set()


def _lower_priority() -> int | None:
    """Give the calling thread the lowest CPU priority (COLLAPSE_NICE, its own only: a Linux thread's nice
    value is per thread); its nice value afterwards, or None where that cannot be set."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, COLLAPSE_NICE)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (OSError, AttributeError):
        return None
