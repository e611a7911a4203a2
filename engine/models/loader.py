"""Load HF checkpoint folders (config.json + single or sharded safetensors) into our model, layer by layer.

On CPU a checkpoint of MAP_ALL_BYTES or more (any size with weight_loading=mmap) is mapped: a parameter whose
stored bytes are already what the model keeps (same dtype; a fused projection whose parts lie back to back in
the file) is the checkpoint's own page-cache pages, mapped copy-on-write: no copy, no second copy of the
weights in memory, the page cache shared by every worker on the host, as llama.cpp's mmap. Everything else
(smaller checkpoints, other dtypes, parts apart, other devices) is read with positioned reads straight into
the storage of its final parameter (a fused projection's parts into its rows; a large tensor in spans, one per
core, in parallel; off CPU, from the map straight to the device); on CPU that storage is one arena that
becomes huge pages once loaded (engine.weight_memory), its map the one the worker reserved at its start where
there is one, with the tensors it read into it then, while torch was being imported (engine.weight_reserve):
those are taken where they lie. The model is built with its random initialisation skipped, so no
weight is written twice.
"""

from __future__ import annotations

import functools
import itertools
import json
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from sluice.engine import weight_reserve
from sluice.engine.models.llama import LlamaModel, ModelConfig
from sluice.engine.models.paths import GENERIC
from sluice.engine.models.rope import RotaryEmbedding
from sluice.engine.multimodal.vl_config import is_generic_vision, is_vision_language
from sluice.engine.weight_memory import WeightArena

LinearHook = Callable[[str, nn.Linear], nn.Module]

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_config(path: str | Path) -> dict:
    """The checkpoint's config.json as a dict, with a clear error when it is missing."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in model folder {path!s}")
    return json.loads(cfg_file.read_text())


def weight_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every *.safetensors in the folder."""
    root = Path(path)
    files = weight_reserve.safetensors_files(root)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root} (only safetensors is supported)")
    return files


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes lie in its safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def source(self) -> tuple[str, int, int]:
        """(weight file name, offset, bytes): how engine.weight_reserve names the tensors it read ahead."""
        return self.file.name, self.offset, self.nbytes


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Every tensor of a safetensors file by name, from its JSON header (nothing else is read)."""
    entries = {}
    for name, t in weight_reserve.stored_tensors([file]).items():
        if t.dtype not in DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {t.dtype}, which the loader does not read")
        entries[name] = TensorEntry(file, DTYPES[t.dtype], t.shape, t.offset, t.nbytes)
    return entries


WEIGHT_LOADING = ("auto", "mmap",
                  "copy")  # mapped from MAP_ALL_BYTES, else read / mapped where the dtype matches / read
# From this size auto maps the checkpoint: copying it would take seconds and twice the memory, and the page
# cache is shared by every worker on the host. Below it auto reads every tensor into the huge-page arena
# (engine.weight_memory: faster decode steps than over 4 KB pages, page-cache maps included), on cache lines
# (rows off a cache line read slower while they fit the caches; docs/benchmarks.md).
MAP_ALL_BYTES = weight_reserve.MAP_ALL_BYTES
PARALLEL_CHUNK = 4 << 20  # tensors above this are read by several threads, a span each
READERS = min(8, os.cpu_count() or 1)


@functools.cache
def _readers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(READERS, thread_name_prefix="sluice-load")


def _pread_span(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise EOFError(f"weight file ends {len(view) - done} bytes early")
        done += n


def _pread_into(fd: int, out: torch.Tensor, offset: int) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes at `offset` of the open file `fd`; a large tensor
    in parallel spans, one per reader thread (the page faults of fresh memory and the copies out of the page
    cache then run on every core, faster than one thread)."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
    if len(view) <= PARALLEL_CHUNK or READERS == 1:
        _pread_span(fd, view, offset)
        return
    step = -(-len(view) // READERS)
    pool = _readers()
    spans = [pool.submit(_pread_span, fd, view[a : a + step], offset + a) for a in range(0, len(view), step)]
    for span in spans:
        span.result()


class CheckpointReader:
    """Tensors by name across one or many safetensors files, each read straight into the tensor that keeps it,
    or taken from `arena` where the worker's reservation read it there ahead (engine.weight_reserve)."""

    def __init__(self, path: str | Path) -> None:
        self.entries: dict[str, TensorEntry] = {}
        self._maps: dict[Path, torch.Tensor] = {}
        self.arena: WeightArena | None = None
        self._fields: dict[str, dict[str, str]] | None = None
        for file in weight_files(path):
            self.entries.update(read_header(file))

    def names(self) -> list[str]:
        return list(self.entries)

    def fields(self, tensor: str) -> dict[str, str]:
        """The tensors stored as fields of `tensor` (`<tensor>.<field>`: bitsandbytes' 4-bit state beside a
        weight), by field."""
        if self._fields is None:
            self._fields = {}
            for name in self.entries:
                owner, sep, field = name.partition(weight_reserve.STATE_FIELD)
                if sep:
                    self._fields.setdefault(f"{owner}.weight", {})[field] = name
        return self._fields.get(tensor, {})

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as stored."""
        return self.entries[name].shape

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` in its stored dtype, as a CPU tensor of the caller's own: where it was read ahead
        into the arena (the first ask only), that, else a fresh one. One read ahead as transient (the load
        rebuilds it: engine.weight_reserve.layout) lasts until the arena settles: keep a copy, or a module
        buffer (the arena's `adopt` moves those)."""
        e = self.entries[name]
        if self.arena is not None:
            found = self.arena.placed([e.source], e.shape, e.dtype)
            if found is not None:
                return found
        return self._fresh(name)

    def _fresh(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read_into(name, out)
        return out

    def _file_bytes(self, file: Path) -> torch.Tensor:
        """The whole file as a uint8 CPU tensor over a private (copy-on-write) map of it: writes to it never
        reach the file; the map lives as long as any tensor viewing it."""
        if file not in self._maps:
            with open(file, "rb") as f:
                self._maps[file] = torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY),
                                                    dtype=torch.uint8)
        return self._maps[file]

    def mapped(self, names: list[str]) -> torch.Tensor | None:
        """The tensors `names` stacked along their first dimension as one zero-copy view of the file map, or
        None where that cannot be: parts in other files or dtypes, apart or out of order in the file, of
        different trailing shapes, or empty."""
        es = [self.entries[n] for n in names]
        first, shape = es[0], es[0].shape
        if len(es) > 1:
            alike = all(e.file == first.file and e.dtype == first.dtype and e.shape
                        and e.shape[1:] == shape[1:]
                        for e in es)
            if not alike or any(a.offset + a.nbytes != b.offset for a, b in itertools.pairwise(es)):
                return None
            shape = (sum(e.shape[0] for e in es), *shape[1:])
        if not first.nbytes:
            return None
        span = self._file_bytes(first.file)[first.offset : first.offset + sum(e.nbytes for e in es)]
        return span.view(first.dtype).view(shape)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read the tensor `name` into the contiguous CPU tensor `out` of its shape (converted to out's
        dtype)."""
        e = self.entries[name]
        if tuple(out.shape) != e.shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {list(e.shape)}, the model expects {list(out.shape)}")
        if out.dtype != e.dtype:
            out.copy_(self.get(name))
        elif e.nbytes:
            fd = os.open(e.file, os.O_RDONLY)
            try:
                _pread_into(fd, out, e.offset)
            finally:
                os.close(fd)


def _read_param(reader: CheckpointReader, names: list[str], dtype, device: torch.device,
                weight_loading: str = "copy", arena: WeightArena | None = None) -> nn.Parameter:
    """One parameter from checkpoint tensors stacked along their first dimension: on CPU the file's own mapped
    bytes where `weight_loading` is mmap and they serve as they are, otherwise read in place (into `arena`
    where it has room)."""
    if device.type == "cpu" and weight_loading == "mmap":
        view = reader.mapped(names)
        if view is not None and view.dtype == dtype:
            return nn.Parameter(view, requires_grad=False)
    shapes = [reader.shape(n) for n in names]
    rows = [s[0] if s else 1 for s in shapes]
    shape = (sum(rows), *shapes[0][1:]) if len(names) > 1 else shapes[0]
    if arena is not None and all(reader.entries[n].dtype == dtype for n in names):  # read ahead, where it was
        ahead = arena.placed([reader.entries[n].source for n in names], shape, dtype)
        if ahead is not None:
            return nn.Parameter(ahead, requires_grad=False)
    out = arena.empty(shape, dtype) if arena is not None else None
    out = torch.empty(shape, dtype=dtype, device=device) if out is None else out
    start = 0
    for name, n in zip(names, rows, strict=True):
        part = out[start : start + n] if len(names) > 1 else out
        if device.type == "cpu":
            reader.read_into(name, part)
        else:  # from the page cache straight to the device, no private CPU copy on the way
            if tuple(part.shape) != reader.shape(name):
                raise ValueError(f"checkpoint tensor {name} has shape {list(reader.shape(name))}, "
                                 f"the model expects {list(part.shape)}")
            view = reader.mapped([name])
            part.copy_(view if view is not None else reader.get(name))
        start += n
    return nn.Parameter(out, requires_grad=False)


def _check_shape(name: str, param: nn.Parameter, expected: torch.Size) -> nn.Parameter:
    if param.shape != expected:
        raise ValueError(
            f"checkpoint {name} has shape {list(param.shape)}, the model expects {list(expected)}")
    return param


def _load_linear(mod: nn.Linear, reader: CheckpointReader, hf_prefix: str, parts, dtype, device,
                 weight_loading: str, arena: WeightArena | None) -> None:
    names = [f"{hf_prefix}{p}" for p in parts]
    weight = _read_param(reader, [f"{n}.weight" for n in names], dtype, device, weight_loading, arena)
    mod.weight = _check_shape(f"{names[0]}.weight", weight, mod.weight.shape)
    if mod.bias is not None:
        bias = _read_param(reader, [f"{n}.bias" for n in names], dtype, device, weight_loading, arena)
        mod.bias = _check_shape(f"{names[0]}.bias", bias, mod.bias.shape)


def _load_layer(layer: nn.Module, reader, i: int, dtype, device, hook: LinearHook | None,
                weight_loading: str, arena: WeightArena | None) -> None:
    """Layer i's tensors; a linear that `hook` replaces is read outside `arena` (the hook keeps its own)."""
    prefix = f"model.layers.{i}."
    for name, mod in list(layer.named_modules()):
        if isinstance(mod, nn.Linear):
            if not getattr(hook, "prequantized", False):
                _load_linear(mod, reader, prefix, LlamaModel.FUSED.get(name, (name,)), dtype, device,
                             weight_loading, None if hook is not None else arena)
            if hook is not None:
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent), attr, hook(f"{prefix}{name}", mod))
        elif hasattr(mod, "weight") and isinstance(mod.weight, nn.Parameter) and name:
            weight = _read_param(reader, [f"{prefix}{name}.weight"], dtype, device, weight_loading, arena)
            mod.weight = _check_shape(f"{prefix}{name}.weight", weight, mod.weight.shape)


def _head(model: LlamaModel) -> nn.Linear:
    """The LM head as a linear (sharing the embedding table when tied)."""
    if model.lm_head is not None:
        return model.lm_head
    with skip_init():
        head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False, device="meta")
    head.weight = model.embed_tokens.weight
    return head


class SkipInit(TorchFunctionMode):
    """While active, torch.nn.init's initialisers (those with torch's `__torch_function__` hook: uniform_,
    normal_, constant_, kaiming_uniform_, all that nn.Linear and nn.Embedding call) return their tensor
    untouched, as transformers' `no_init_weights` does by patching them: every weight is about to be replaced
    by the checkpoint's. Nothing of torch is patched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def skip_init() -> SkipInit:
    """A context in which modules are built without their random initialisation (SkipInit)."""
    return SkipInit()


def build_model(config: ModelConfig) -> LlamaModel:
    """Our model for `config` with uninitialised CPU storage that is never written, so never committed: the
    loader replaces every tensor. (Not the meta device: its Python reference kernels import torch's compiler
    stack, a second or more of start-up; the rotary tables are built for one position, the loader builds
    them.)"""
    with skip_init():
        return LlamaModel(config, 1)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    linear_hook: LinearHook | None = None,
    config: ModelConfig | None = None,
    weight_loading: str = "auto",
    huge_pages: bool = True,
    reservation: weight_reserve.WeightReservation | None = None,
    hf_config: dict | None = None,
) -> LlamaModel:
    """Build our model from an HF folder, reading tensors layer by layer onto `device` (`config`: its
    config.json when the caller has already read it; `weight_loading`: one of WEIGHT_LOADING, for CPU: map
    the file's tensors where they serve as stored (auto: from MAP_ALL_BYTES of weights), always, or never. A
    linear hook reads private copies: what it keeps replaces the weights, and no map outlives the load.
    `huge_pages`: on CPU, private weights in engine.weight_memory's arena, `model.weight_arena`, which its
    owner settles; `reservation`: the map reserved for it at the process's start, engine.weight_reserve;
    `hf_config`: its config.json when the caller has read it.)"""
    if weight_loading not in WEIGHT_LOADING:
        raise ValueError(f"weight_loading must be one of {', '.join(WEIGHT_LOADING)}, got {weight_loading!r}")
    hf = hf_config if hf_config is not None else read_config(path)
    config = config or ModelConfig.from_hf(hf)
    if is_generic_vision(hf):  # transformers' vision-language model, images through models.vl_generic
        from sluice.engine.models.vl_generic import load_vl_generic

        return load_vl_generic(path, hf, dtype, device, config, linear_hook, huge_pages)
    if is_vision_language(hf):  # the vision tower and M-RoPE (models.qwen2_vl)
        return _load_vision_language(path, hf, config, dtype, device, max_positions)
    if config.path == GENERIC:  # transformers' own modules with our attention (models.generic)
        from sluice.engine.models.generic import load_generic

        return load_generic(path, dtype, device, config, linear_hook, huge_pages)
    return _load_native(path, config, dtype, device, max_positions, linear_hook, weight_loading, huge_pages,
                        reservation)


def _load_native(path: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_positions: int, linear_hook: LinearHook | None, weight_loading: str, huge_pages: bool,
                 reservation: weight_reserve.WeightReservation | None) -> LlamaModel:
    """Our own LlamaModel read from the checkpoint (load_model's native path)."""
    reader = CheckpointReader(path)
    mode = _weight_mode(reader, weight_loading, linear_hook)
    in_arena = device.type == "cpu" and mode == "copy" and huge_pages
    arena = _arena(reader, dtype, path, reservation) if in_arena else None
    reader.arena = arena
    if getattr(linear_hook, "prequantized", False):  # the hook reads its tensors through this reader (so it
        linear_hook.reader = reader  # takes what was read ahead into the arena)
    model = build_model(config)
    read_weights(model, reader, dtype, device, linear_hook, mode, arena)
    if getattr(linear_hook, "quantizes_head", False):
        model.lm_head = linear_hook("lm_head", _head(model))
    model.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope).to(device)
    if arena is not None:
        arena.adopt(model)
        model.weight_arena = arena  # for its owner to settle once it runs
    return model.eval()


def _load_vision_language(path: str | Path, hf_config: dict, config: ModelConfig, dtype: torch.dtype,
                          device: torch.device, max_positions: int) -> LlamaModel:
    """Qwen2-VL or Qwen2.5-VL from an HF folder: the language model as the native path reads Qwen2, then its
    vision tower (models.qwen2_vl, models.qwen2_5_vl)."""
    from sluice.engine.models.qwen2_5_vl import vision_tower
    from sluice.engine.models.qwen2_vl import Qwen2VLModel, load_vision_tower

    section = config.rope.get("mrope_section") or [16, 24, 24]
    with skip_init():
        model = Qwen2VLModel(config, 1, section)
    reader = CheckpointReader(path)
    read_weights(model, reader, dtype, device, None, "copy", None)
    load_vision_tower(model, reader, vision_tower(hf_config), dtype, device)
    model.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope).to(device)
    return model.eval()


def _weight_mode(reader: CheckpointReader, weight_loading: str, linear_hook: LinearHook | None) -> str:
    """"mmap" or "copy": a linear hook always reads copies; "auto" maps checkpoints of MAP_ALL_BYTES or
    more."""
    mode = weight_loading if linear_hook is None else "copy"
    if mode == "auto":
        mode = "mmap" if sum(e.nbytes for e in reader.entries.values()) >= MAP_ALL_BYTES else "copy"
    return mode


def read_weights(model: LlamaModel, reader: CheckpointReader, dtype: torch.dtype, device: torch.device,
                  linear_hook: LinearHook | None, mode: str, arena: WeightArena | None) -> None:
    """Every parameter of `model` read from the checkpoint in place of its placeholder (asserts none is
    left)."""
    placeholders = list(model.parameters())
    model.embed_tokens.weight = _read_param(reader, ["model.embed_tokens.weight"], dtype, device, mode, arena)
    model.norm.weight = _read_param(reader, ["model.norm.weight"], dtype, device, mode, arena)
    if model.lm_head is not None:
        name = "lm_head.weight" if "lm_head.weight" in reader else "model.embed_tokens.weight"
        model.lm_head.weight = _read_param(reader, [name], dtype, device, mode, arena)
    for i, layer in enumerate(model.layers):
        _load_layer(layer, reader, i, dtype, device, linear_hook, mode, arena)
    left = {id(p) for p in placeholders} & {id(p) for p in model.parameters()}
    assert not left, f"{len(left)} parameter(s) never read from the checkpoint"


def _arena(reader: CheckpointReader, dtype: torch.dtype, path: str | Path,
           reservation: weight_reserve.WeightReservation | None) -> WeightArena | None:
    """An arena with room for every checkpoint tensor in the dtype the model keeps it (floating ones in
    `dtype`; quantized linears keep fewer bytes than that, their scales a little more), committed only where
    written: `reservation` where it is the map reserved for `path` at the worker's start and has room
    (engine.weight_reserve); None where the address space cannot be had (the tensors then go to torch's
    allocator)."""
    nbytes = sum(e.nbytes // e.dtype.itemsize * (dtype.itemsize if e.dtype.is_floating_point
                                                 else e.dtype.itemsize)
                 for e in reader.entries.values())
    capacity = weight_reserve.arena_capacity(nbytes)
    try:
        return WeightArena(capacity, weight_reserve.take(reservation, path, capacity))
    except OSError:
        return None
