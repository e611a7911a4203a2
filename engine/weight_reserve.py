"""The CPU weight arena's memory, mapped and filled with the weights while the worker is still importing
torch.

The first write to each page of fresh anonymous memory is a page fault, and in a VM guest (Firecracker) that
is expensive: reading a checkpoint into a fresh arena costs several times reading the same bytes into one
reused buffer (docs/benchmarks.md, coldstart). Importing torch keeps a core busy for a second or more and
leaves the others idle. So the worker's entry point, before its first heavy import, calls `reserve` with the
checkpoint's folder: it reads the safetensors headers (JSON: no torch), maps what engine.weight_memory's arena
will be, and from a thread (the import goes on meanwhile) reads every tensor the model keeps as stored into it
(`layout`: each on a cache line, a fused projection's parts back to back, as the loader places them;
`os.preadv`, which releases the GIL), then, past them, what the load only reads to rebuild (bitsandbytes'
state beside quantized codes: transient, handed back once loaded) and faults in the pages where the load will
write what it makes from those. Where it cannot read ahead (a memory budget smaller than the weights) it
faults the pages in instead (MADV_POPULATE_WRITE, Linux 5.14+, through ctypes: the GIL is released for the
call too). The loader's arena then `take`s that map instead of making its own and takes each tensor read ahead
as it is (`placed`: no second read); the reservation hands back the pages of transient tensors, of tensors
nobody took and those faulted past what the arena wrote (`Reservation.finish`): no second copy, nothing kept
unused. A map that does not fit (another model, dtype, a larger arena) is unmapped and the arena maps its own,
as before.

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from sluice.engine.models.fused_layout import FUSED

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # the arena starts on a huge page boundary (engine.weight_memory)
# bytes: every tensor in the arena starts on a cache line, as the vector kernels read best
SLOT_ALIGNMENT = 64
# Linux's values (MADV_POPULATE_WRITE is not in Python's mmap module)
MADV_DONTNEED, MADV_POPULATE_WRITE = 4, 23
# from this many stored bytes the loader maps the checkpoint (weight_loading auto): no arena
MAP_ALL_BYTES = 4 << 30
# Bytes faulted a call. A call holds the process's address-space lock (mmap_lock, read side) throughout, and
# every mmap/mprotect of the importing thread (dlopen of torch's libraries) waits for it to end: short calls
# keep those waits short (docs/benchmarks.md, coldstart); `finish` waits for at most one.
SPAN = HUGE_PAGE
# Reading ahead: a positioned read covers at most this many bytes of a file, so that the reading thread takes
# the GIL back (which the importing thread holds for up to its switch interval) a few dozen times a GB, not
# once a tensor or a page span; stretches of the file of at most GAP bytes between two tensors read ahead are
# read to scratch (a call goes on over them); IOV_MAX buffers a call at most.
READ_CALL = 64 << 20
GAP = 1 << 20
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16
# Tensors the load reads only to rebuild (bitsandbytes' 4-bit state, an int8 linear's row scales, a norm
# stored in another dtype) are read ahead too, past those kept, while they are at most this share of them
# (1/TRANSIENT_SHARE): their pages are handed back when the arena settles, whatever the load did with them.
TRANSIENT_SHARE = 4
STATE_FIELD = ".weight."  # bitsandbytes stores a 4-bit weight's state as `<linear>.weight.<field>` tensors
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
    """The arena's capacity for `nbytes` of weights as the model keeps them: room for what the load makes
    beside them (a linear quantized at load keeps scales beside its codes) and for later adoptions."""
    return nbytes + nbytes // 64 + (64 << 20)


def kept_bytes(tensors: Iterable[tuple[str, int]], itemsize: int) -> int:
    """The bytes the model keeps of tensors given as (safetensors dtype, stored bytes): floating ones in a
    dtype of `itemsize` bytes, the others as stored."""
    total = 0
    for dtype, nbytes in tensors:
        own, floating = DTYPES[dtype]
        total += nbytes // own * (itemsize if floating else own)
    return total


@dataclass(frozen=True, slots=True)
class Slot:
    """One checkpoint tensor read ahead: `nbytes` from `offset` of the weight file named `file` (its name in
    the folder), to `at` bytes past the arena's start; `transient`: the load only reads it (its pages go back
    when the arena settles)."""

    file: str
    offset: int
    nbytes: int
    at: int
    transient: bool = False


@dataclass(frozen=True, slots=True)
class Stored:
    """One checkpoint tensor as its file stores it."""

    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def stored_tensors(files: Iterable[Path]) -> dict[str, Stored]:
    """Every tensor of the safetensors files by name (their headers only)."""
    found = {}
    for file in files:
        data, header = read_header(file)
        for name, e in header.items():
            start, end = e["data_offsets"]
            found[name] = Stored(file.name, data + start, end - start, e["dtype"], tuple(e["shape"]))
    return found


def read_ahead(name: str, t: Stored, kept: str) -> bool:
    """Whether the model keeps tensor `name` as stored, so that it can be read ahead: floating ones stored in
    the `kept` dtype, the others as stored, except bitsandbytes' 4-bit state (`<linear>.weight.<field>`: the
    load rebuilds it) and empty ones."""
    if t.dtype not in DTYPES or not t.nbytes or STATE_FIELD in name:
        return False
    return t.dtype == kept or not DTYPES[t.dtype][1]


def _groups(names: list[str], tensors: dict[str, Stored]) -> Iterator[list[str]]:
    """The names in order, each alone or, for the parts of a FUSED projection (all there, alike), the parts in
    FUSED's order where the first of them comes."""
    done: set[str] = set()
    for name in names:
        if name in done:
            continue
        group = next((g for parts in FUSED.values() if (g := _fused_with(name, parts))), [name])
        if len(group) > 1 and not all(n in tensors and _alike(tensors[n], tensors[group[0]]) for n in group):
            group = [name]
        done.update(group)
        yield group


def _fused_with(name: str, parts: tuple[str, ...]) -> list[str]:
    """The names of all `parts` of the projection `name` is a part of (same prefix and suffix); [] if none."""
    for part in parts:
        prefix, sep, suffix = name.partition(f".{part}.")
        if sep:
            return [f"{prefix}.{p}.{suffix}" for p in parts]
    return []


def _alike(a: Stored, b: Stored) -> bool:
    """Whether two parts stack along their first dimension: one dtype, the same shape past it, neither
    empty."""
    return a.dtype == b.dtype and a.shape[1:] == b.shape[1:] and a.nbytes > 0


def layout(tensors: dict[str, Stored], kept: str) -> tuple[dict[str, Slot], int]:
    """Where each tensor that can be read ahead goes in the arena: those the model keeps as stored
    (`read_ahead`) first, each group (`_groups`) on a cache line, its parts back to back; then, while they are
    few enough (TRANSIENT_SHARE), every other non-empty one (transient), each on a cache line; and the end of
    the last (bytes past the arena's start)."""
    names = [n for n, t in tensors.items() if read_ahead(n, t, kept)]
    slots, end = {}, 0
    for group in _groups(names, {n: tensors[n] for n in names}):
        end = -(-end // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
        for name in group:
            t = tensors[name]
            slots[name], end = Slot(t.file, t.offset, t.nbytes, end), end + t.nbytes
    rest = [n for n, t in tensors.items() if n not in slots and t.dtype in DTYPES and t.nbytes]
    if sum(tensors[n].nbytes for n in rest) * TRANSIENT_SHARE <= end:
        for name in rest:
            t = tensors[name]
            end = -(-end // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
            slots[name], end = Slot(t.file, t.offset, t.nbytes, end, transient=True), end + t.nbytes
    return slots, end


def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # a foreign call: the GIL is released meanwhile
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def read_calls(slots: dict[str, Slot]) -> list[tuple[str, int, list[tuple[str | None, int]]]]:
    """The positioned reads that fill `slots`, in file order: (file, offset, parts), each part (name, bytes)
    going to that slot, or (None, bytes): a stretch of at most GAP bytes between two of them, read to scratch
    so that the call goes on; a call covers at most READ_CALL bytes of the file (a larger tensor: one call)
    and IOV_MAX parts."""
    calls: list[tuple[str, int, list[tuple[str | None, int]]]] = []
    end, size = None, 0
    for name, s in sorted(slots.items(), key=lambda kv: (kv[1].file, kv[1].offset)):
        call = calls[-1] if calls else None
        gap = s.offset - end if call is not None and call[0] == s.file else -1
        if call is None or not 0 <= gap <= GAP or size + gap + s.nbytes > READ_CALL or len(
            call[2]) + 2 > IOV_MAX:
            calls.append((s.file, s.offset, [(name, s.nbytes)]))
            size = s.nbytes
        else:
            call[2].extend([(None, gap)] if gap else [])
            call[2].append((name, s.nbytes))
            size += gap + s.nbytes
        end = s.offset + s.nbytes
    return calls


def _preadv_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Fill `bufs` in order from `offset` of the open file `fd` (one call, more only where the kernel reads
    less)."""
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n <= 0:
            raise EOFError(f"weight file ends {sum(map(len, bufs))} bytes early")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs.pop(0))
        if n:
            bufs[0] = bufs[0][n:]


class Reservation:
    """An anonymous map of `capacity` bytes (plus the huge page its start is aligned to), filled by a daemon
    thread: the checkpoint tensors of `slots` read from the files in `root` to their places, then the next
    `fault` bytes past them faulted in (where the load writes what it makes: the quantized linears' scales),
    or else (no slots) its first `fault` bytes from that start faulted in."""

    def __init__(self, key: str, capacity: int, fault: int, root: Path | None = None,
                 slots: dict[str, Slot] | None = None) -> None:
        self.key, self.capacity, self.root = key, capacity, root
        self.map = mmap.mmap(-1, capacity + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(anchor)
        del anchor  # no export of the map left behind: it can still be closed
        self.start = (-self.address) % HUGE_PAGE
        self.slots = slots or {}
        # the read-ahead part's end
        self.ahead = max((s.at + s.nbytes for s in self.slots.values()), default=0)
        self._source = {(s.file, s.offset, s.nbytes): name for name, s in self.slots.items()}
        self.taken_by_arena = False  # `take` handed the map to a weight arena
        self.read: set[str] = set()  # names read so far
        self.taken: set[str] = set()  # names handed to the load (`placed`)
        self.past = -(-self.ahead // mmap.PAGESIZE) * mmap.PAGESIZE  # the first page past the read-ahead part
        self.fault, self.faulted = min(self.past + fault if self.slots else fault, capacity), 0
        self._stop, self._done = threading.Event(), threading.Condition()
        self._reading = True
        work = self._read_in if self.slots else self._fault_in
        self._thread = threading.Thread(target=work, name="sluice-prefault", daemon=True)
        self._thread.start()

    def _fault_in(self) -> None:
        """Fault the pages in up to `fault` (`_populate`)."""
        try:
            self._populate(0)
        finally:
            self._finished()

    def _populate(self, at: int) -> None:
        """Fault the pages from `at` to `fault` in, a span a call, until done, stopped, or refused (a kernel
        before 5.14, no memory)."""
        madvise = _madvise()
        while at < self.fault and not self._stop.is_set():
            n = min(SPAN, self.fault - at)
            if madvise(self.address + self.start + at, n, MADV_POPULATE_WRITE) != 0:
                log.debug("MADV_POPULATE_WRITE: errno %d (the arena faults its pages as it is written)",
                          ctypes.get_errno())
                return
            at += n
            self.faulted = max(self.faulted, at)

    def _read_in(self) -> None:
        """Read every slot's tensor to its place (`read_calls`: few, large positioned reads in file order,
        each taking the GIL back only once), until done, stopped, or a read fails (the load then reads what is
        missing itself). The copies fault the arena's pages in as they write them (the VMA's own lock, not the
        process's address-space lock that the importing thread's maps take)."""
        fds: dict[str, int] = {}
        scratch = memoryview(bytearray(GAP))
        try:
            with memoryview(self.map) as view:
                for file, offset, parts in read_calls(self.slots):
                    if self._stop.is_set():
                        break
                    if file not in fds:
                        fds[file] = os.open(self.root / file, os.O_RDONLY)
                    bufs = [scratch[:n] if name is None else view[self.start + self.slots[name].at :][:n]
                            for name, n in parts]
                    _preadv_all(fds[file], bufs, offset)
                    del bufs
                    names = [name for name, _ in parts if name is not None]
                    self.faulted = max(self.faulted,
                                       *(self.slots[n].at + self.slots[n].nbytes for n in names))
                    with self._done:
                        self.read.update(names)
                        self._done.notify_all()
            self._populate(self.past)
        except (OSError, EOFError):
            log.debug("reading the weights ahead stopped", exc_info=True)
        finally:
            for fd in fds.values():
                os.close(fd)
            self._finished()

    def _finished(self) -> None:
        with self._done:
            self._reading = False
            self._done.notify_all()

    def placed(self, parts: list[tuple[str, int, int]]) -> int | None:
        """Where the tensors `parts` ((weight file name, offset, bytes) each, in order) were read ahead, back
        to back, in bytes past the start; None where they were not, or not so (waits for their reads). Each
        tensor is handed out once: a second ask reads it again, elsewhere."""
        names = [self._source.get(p) for p in parts]
        if not names or None in names or self.taken.intersection(names):
            return None
        slots = [self.slots[n] for n in names]
        if any(a.at + a.nbytes != b.at for a, b in pairwise(slots)):
            return None
        with self._done:
            self._done.wait_for(lambda: self.read.issuperset(names) or not self._reading)
            if not self.read.issuperset(names):
                return None
        self.taken.update(names)
        return slots[0].at

    def finish(self, used: int) -> int:
        """Stop reading or faulting and hand back the pages faulted past the first `used` bytes from the start
        (the arena writes none of them: a later write gets a fresh page) and those only transient tensors or
        tensors nobody took lie on; returns the bytes handed back."""
        self._stop.set()
        self._thread.join()
        spans = [(s.at, s.at + s.nbytes) for name, s in self.slots.items() if s.transient
                 or name not in self.taken]
        spans.append((used, max(used, self.faulted)))
        madvise, released = _madvise(), 0
        kept = [(s.at, s.at + s.nbytes) for name, s in self.slots.items() if name in self.taken
                and not s.transient]
        for first, end in _whole_pages(spans, kept):
            madvise(self.address + self.start + first, end - first, MADV_DONTNEED)
            released += end - first
        return released

    def close(self) -> None:
        """Stop reading or faulting and unmap."""
        self._stop.set()
        self._thread.join()
        self.map.close()


def _whole_pages(free: list[tuple[int, int]], kept: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The whole pages (byte spans past the start, which lies on a page) inside each run of `free` spans that
    no `kept` span interrupts (the spans do not overlap)."""
    page = mmap.PAGESIZE
    marks = sorted([(a, b, True) for a, b in free if b > a] + [(a, b, False) for a, b in kept])
    run: tuple[int, int] | None = None
    for a, b, is_free in [*marks, (0, 0, False)]:
        if is_free and run is not None:
            run = (run[0], max(run[1], b))
            continue
        if run is not None and run[1] // page > -(-run[0] // page):
            yield -(-run[0] // page) * page, run[1] // page * page
        run = (a, b) if is_free else None


PLAN_WAIT = 30.0  # seconds a reservation's user waits at most for reserve_later's thread to decide it


class PendingReservation:
    """The reservation `reserve_later`'s thread decides (None: nothing reserved): what a worker hands to
    `LLM(weight_reservation=...)` before it is known; `result` waits for the decision."""

    def __init__(self) -> None:
        self._decided = threading.Event()
        self._reservation: Reservation | None = None

    def decide(self, reservation: Reservation | None) -> None:
        """Set the reservation (None: none) and wake whoever waits for it."""
        self._reservation = reservation
        self._decided.set()

    def result(self, timeout: float = PLAN_WAIT) -> Reservation | None:
        """The reservation once decided (None if none, or not decided within `timeout` seconds)."""
        self._decided.wait(timeout)
        return self._reservation


WeightReservation = Reservation | PendingReservation  # what `LLM(weight_reservation=...)` takes


def resolved(reservation: WeightReservation | None) -> Reservation | None:
    """The reservation itself, a pending one's once decided."""
    return reservation.result() if isinstance(reservation, PendingReservation) else reservation


def key_of(model_dir: str | Path) -> str:
    """The name a reservation is kept under: the checkpoint folder's real path."""
    return os.path.realpath(model_dir)


def reserve(model_dir: str | Path, kept: str, budget: int, map_large: bool = True) -> Reservation | None:
    """Map the arena for the checkpoint in `model_dir`, its floating tensors kept in the safetensors dtype
    `kept`, and start reading the weights into it (`layout`), or, where they are more than `budget` bytes,
    faulting in `budget` bytes of it; None (nothing done) off Linux, where the folder has no readable
    safetensors, or where the loader will map it (`map_large`: weight_loading auto)."""
    if sys.platform != "linux" or kept not in DTYPES:
        return None
    try:
        root = Path(model_dir)
        tensors = stored_tensors(safetensors_files(root))
        nbytes = kept_bytes(((t.dtype, t.nbytes) for t in tensors.values()), DTYPES[kept][0])
        if not nbytes or budget <= 0 or (map_large
                                         and sum(t.nbytes for t in tensors.values()) >= MAP_ALL_BYTES):
            return None
        slots, end = layout(tensors, kept)
        if end > budget:  # without the transient ones, else none
            slots = {n: s for n, s in slots.items() if not s.transient}
            end = max((s.at + s.nbytes for s in slots.values()), default=0)
        ahead = slots if end <= budget else None
        passing = sum(s.nbytes + SLOT_ALIGNMENT for s in slots.values() if s.transient) if ahead else 0
        made = nbytes - sum(s.nbytes for s in slots.values() if not s.transient)  # what the load makes, about
        fault = min(made, budget - end) if ahead else min(nbytes, budget)
        return Reservation(key_of(root), arena_capacity(nbytes) + passing, fault, root, ahead)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def reading_ahead(reservation: WeightReservation | None, model_dir: str | Path) -> bool:
    """Whether the reservation (once decided) reads the weights of the checkpoint in `model_dir` (so they come
    through the page cache: nothing else need read them ahead)."""
    found = resolved(reservation)
    return found is not None and found.key == key_of(model_dir) and bool(found.slots) and not found.map.closed


def reserve_later(plan: Callable[[], tuple[str | Path, str, int, bool] | None]) -> PendingReservation:
    """`reserve(*plan())` from a daemon thread (the plan may import what the caller should not wait for; None:
    nothing to reserve); the pending reservation it decides."""
    pending = PendingReservation()

    def run() -> None:
        found = None
        try:
            args = plan()
            if args is not None:
                found = reserve(*args)
        except Exception:  # a wrong guess costs only the overlap: the arena maps its own
            log.debug("no arena reserved", exc_info=True)
        finally:
            pending.decide(found)

    threading.Thread(target=run, name="sluice-reserve", daemon=True).start()
    return pending


def take(reservation: WeightReservation | None, model_dir: str | Path, capacity: int) -> Reservation | None:
    """The reservation if it is for the checkpoint in `model_dir` and has room for an arena of `capacity`
    bytes (it is then the caller's); one for it that is too small is unmapped, one for another model left to
    its owner."""
    found = resolved(reservation)
    if found is None or found.key != key_of(model_dir) or found.taken_by_arena or found.map.closed:
        return None
    if found.capacity < capacity:
        found.close()
        return None
    found.taken_by_arena = True
    return found


def discard(reservation: WeightReservation | None) -> bool:
    """Unmap a reservation no arena took (its model loaded elsewhere, or not at all); True if it did."""
    found = resolved(reservation)
    if found is None or found.taken_by_arena or found.map.closed:
        return False
    found.close()
    return True
