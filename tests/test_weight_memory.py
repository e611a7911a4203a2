"""CPU weights in one arena that becomes transparent huge pages (engine.weight_memory)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from sluice.engine import LLM, SamplingParams, weight_memory, weight_reserve
from sluice.engine.weight_memory import COLLAPSE_NICE, HUGE_PAGE, WeightArena
from tests.checkpoints import make_checkpoint


def _mapping(ptr: int) -> dict[str, int]:
    """The kB fields of /proc/self/smaps for the mapping that holds address `ptr`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= ptr < hi
        elif inside and line.endswith(" kB"):
            fields[head[0].rstrip(":")] = int(head[1])
    return fields


def _collapse_supported() -> bool:
    """MADV_COLLAPSE is Linux 6.1+, and THP must not be switched off."""
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return enabled.is_file() and "[never]" not in enabled.read_text() and (major, minor) >= (6, 1)


@pytest.fixture(scope="module")
def mid_llama(tmp_path_factory) -> Path:
    """A bf16 llama of ~20 MB: several huge pages of weights."""
    return make_checkpoint(tmp_path_factory.mktemp("mid"), dtype=torch.bfloat16, hidden_size=512,
                           intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4)


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), dtype="bfloat16", device="cpu", max_model_len=96, max_num_seqs=2, **kw)


@pytest.mark.parametrize("quantization", [None, "int8_weight_only", "int4_weight_only"])
def test_weights_live_in_one_arena_of_huge_pages_and_decode_the_same(mid_llama, quantization):
    """Every parameter and buffer (quantized linears' codes and scales included) lies in the arena, which is
    committed only where written and, settled after the engine's first step, backed by huge pages (by a thread
    of the lowest priority, the engine's own threads untouched); greedy tokens are those of the same model on
    ordinary pages."""
    llm = _llm(mid_llama, quantization=quantization)
    plain = _llm(mid_llama, quantization=quantization, huge_pages=False)
    model, arena = llm.engine.model, llm.engine.model.weight_arena
    tensors = [*model.parameters(), *model.buffers()]
    assert all(arena.holds(t) for t in tensors)
    assert not hasattr(plain.engine.model, "weight_arena")
    assert not any(arena.holds(t) for t in plain.engine.model.parameters())
    assert arena.used >= sum(t.numel() * t.element_size() for t in tensors) > 4 * HUGE_PAGE
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 11, 3], [8, 1, 4]]
    assert not arena.settled.is_set()
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids
                                                                    for o in plain.generate(prompts, params)]
    assert arena.settled.wait(60)
    assert arena.collapse_nice == COLLAPSE_NICE > os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    smaps = _mapping(arena.data_ptr())
    assert smaps["Rss"] * 1024 <= arena.used + 2 * HUGE_PAGE < arena.capacity  # the slack is never committed
    if _collapse_supported():
        assert smaps["AnonHugePages"] * 1024 >= (arena.used // HUGE_PAGE - 1) * HUGE_PAGE
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids
                                                                    for o in plain.generate(prompts, params)]


@pytest.mark.parametrize("pace", [60.0, 0.01])
def test_the_huge_page_collapse_waits_while_the_engine_has_work(mid_llama, monkeypatch, pace):
    """The collapse the first step starts goes on in the engine's idle time: while a request is unfinished it
    waits (the steps do not share the cores with it), a span every COLLAPSE_PACE seconds at most, so that an
    engine never idle settles too; once the engine drains, it goes on at once and the arena settles into huge
    pages."""
    monkeypatch.setattr(weight_memory, "COLLAPSE_PACE", pace)
    llm = _llm(mid_llama)
    engine, arena = llm.engine, llm.engine.model.weight_arena
    engine.add_request("long", [5, 9, 2, 7], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()  # the first step: the arena settles, its collapse thread starts and waits
    assert engine.has_unfinished() and not arena._quiet.is_set()
    if pace > 1:
        assert not arena.settled.wait(1.0)
    else:  # a few spans, paced: done while the request still runs
        assert arena.settled.wait(60) and engine.has_unfinished()
    while engine.has_unfinished():
        engine.step()
    assert arena._quiet.is_set() and arena.settled.wait(60)
    if _collapse_supported():
        assert _mapping(arena.data_ptr())["AnonHugePages"] * 1024 >= (arena.used // HUGE_PAGE - 1) * HUGE_PAGE


def test_a_draft_models_weights_settle_too(mid_llama):
    """A draft model loads into an arena of its own, settled with the target's after the first step."""
    llm = _llm(mid_llama,
               speculative={"method": "draft", "model": str(mid_llama), "num_speculative_tokens": 2})
    arenas = [llm.engine.model.weight_arena, llm.engine.proposer.runner.model.weight_arena]
    assert arenas[0] is not arenas[1] and not any(a.settled.is_set() for a in arenas)
    llm.generate([[5, 9, 2, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert all(a.settled.wait(60) for a in arenas)


class _Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(4096, dtype=torch.float32).view(64, 64), requires_grad=False)
        self.register_buffer("codes", torch.arange(1000, dtype=torch.int16))
        self.register_buffer("tail", self.codes[600:].view(20, 20).t())  # a strided view of codes' storage
        self.register_buffer("big", torch.ones(100_000))


def test_adopt_keeps_views_of_one_storage_views_of_one_copy():
    """adopt moves a storage once with every view of it (offset and strides kept), so writes through one still
    show through the other; what does not fit stays where it was, unchanged."""
    mod, expected = _Views(), {k: v.clone() for k, v in _Views().state_dict().items()}
    arena = WeightArena(64 * 64 * 4 + 1000 * 2 + 1024)
    moved = arena.adopt(mod)
    assert moved == 64 * 64 * 4 + 1000 * 2
    assert (arena.holds(mod.weight) and arena.holds(mod.codes) and arena.holds(mod.tail)
            and not arena.holds(mod.big))
    assert mod.tail.untyped_storage().data_ptr() == mod.codes.untyped_storage().data_ptr()
    assert isinstance(mod.weight, nn.Parameter) and mod.weight.data_ptr() % 64 == 0
    for k, v in mod.state_dict().items():
        assert torch.equal(v, expected[k]), k
    mod.codes[610] = -1
    assert mod.tail[10, 0] == -1  # tail[i, j] is codes[600 + 20 j + i]


def _reserve(path: Path, kept: str, budget: int = 1 << 40) -> weight_reserve.Reservation:
    reservation = weight_reserve.reserve(path, kept, budget)
    assert reservation is not None
    return reservation


def test_the_arena_is_the_map_reserved_and_faulted_in_before_the_load(mid_llama):
    """A reservation made from the headers alone (engine.weight_reserve, as the worker's entry point makes it)
    is the arena: the same map; with a memory budget below the weights' size, its first budget's bytes faulted
    in ahead (POPULATE_WRITE: the kernel's count of the map's resident pages covers them before anything is
    written), nothing read ahead; the model decodes as one loaded without."""
    reservation = _reserve(mid_llama, "BF16", budget=(8 << 20) + 4096)
    reservation._thread.join(60)
    assert not reservation.slots and reservation.faulted == reservation.fault == (8 << 20) + 4096
    assert _mapping(reservation.address + reservation.start)["Rss"] * 1024 >= reservation.fault
    llm = _llm(mid_llama, weight_reservation=reservation)
    arena = llm.engine.model.weight_arena
    assert arena.data_ptr() == reservation.address + reservation.start
    assert arena.used <= reservation.capacity == arena.capacity
    assert weight_reserve.discard(reservation) is False  # taken: nothing left to unmap
    plain = _llm(mid_llama, huge_pages=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 11, 3]]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids
                                                                    for o in plain.generate(prompts, params)]
    assert arena.prefaulted == reservation.fault  # the first step settled the arena, its reservation finished


def test_the_weights_read_ahead_are_the_models_own(mid_llama):
    """With room in its budget the reservation reads every tensor the model keeps as stored into the arena
    while torch would still be importing: the loader takes each where it lies (the fused q/k/v and gate/up
    weights one view over parts read back to back), reads none again, and the model decodes as one loaded
    without."""
    reservation = _reserve(mid_llama, "BF16")
    stored = weight_reserve.stored_tensors(weight_reserve.safetensors_files(mid_llama))
    assert (set(reservation.slots) == set(stored)
            and reservation.ahead >= sum(t.nbytes for t in stored.values()))
    llm = _llm(mid_llama, weight_reservation=reservation)
    model, arena = llm.engine.model, llm.engine.model.weight_arena
    assert reservation.taken == set(reservation.slots) == reservation.read
    base = reservation.address + reservation.start
    qkv = model.layers[1].self_attn.qkv_proj.weight
    assert qkv.data_ptr() == base + reservation.slots["model.layers.1.self_attn.q_proj.weight"].at
    assert model.embed_tokens.weight.data_ptr() == base + reservation.slots["model.embed_tokens.weight"].at
    assert arena.used >= reservation.ahead and all(arena.holds(t) for t in model.parameters())
    plain = _llm(mid_llama, huge_pages=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 11, 3]]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids
                                                                    for o in plain.generate(prompts, params)]
    for name, p in plain.engine.model.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_every_native_architecture_takes_every_tensor_read_ahead(tmp_path, arch):
    """Biases of fused projections (Qwen2), per-head norms (Qwen3) and experts (Mixtral, Qwen3-MoE) are read
    ahead where the loader wants them too: nothing is read twice or left untaken, and greedy tokens match a
    plain load."""
    path = make_checkpoint(tmp_path / arch, arch, dtype=torch.bfloat16)
    reservation = _reserve(path, "BF16")
    llm = _llm(path, weight_reservation=reservation)
    assert reservation.taken == set(reservation.slots) == reservation.read
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = _llm(path, huge_pages=False)
    assert llm.generate([[3, 5, 7]], params)[0].token_ids == plain.generate([[3, 5, 7]], params)[0].token_ids


def test_a_sharded_checkpoint_is_read_ahead_across_its_files(tmp_path):
    """A checkpoint in several safetensors files (an index naming them) is read ahead file by file; the load
    takes every tensor where it lies and decodes as one loaded without."""
    path = make_checkpoint(tmp_path / "sharded", dtype=torch.bfloat16, hidden_size=256, intermediate_size=768,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           max_shard_size="2MB")
    files = weight_reserve.safetensors_files(path)
    assert len(files) > 2 and (path / "model.safetensors.index.json").is_file()
    reservation = _reserve(path, "BF16")
    assert {s.file for s in reservation.slots.values()} == {f.name for f in files}
    llm = _llm(path, weight_reservation=reservation)
    assert reservation.taken == set(reservation.slots) == reservation.read
    plain = _llm(path, huge_pages=False)
    for name, p in plain.engine.model.named_parameters():
        assert torch.equal(p, llm.engine.model.get_parameter(name)), name


def test_a_read_ahead_that_fails_part_way_leaves_the_rest_to_the_loader(mid_llama, monkeypatch):
    """A reservation whose reads fail part way (here: after three reads, a weight file gone) hands over what
    it read; the loader reads the rest itself, into the arena past the part read ahead, and the weights are
    the checkpoint's."""
    calls = weight_reserve.read_calls
    monkeypatch.setattr(weight_reserve, "READ_CALL", 1 << 16)
    monkeypatch.setattr(weight_reserve, "read_calls",
                        lambda slots: [*calls(slots)[:3], ("gone", 0, [("x", 8)])])
    reservation = _reserve(mid_llama, "BF16")
    reservation._thread.join(60)
    llm = _llm(mid_llama, weight_reservation=reservation)
    assert 0 < len(reservation.taken) == len(reservation.read) < len(reservation.slots)
    plain = _llm(mid_llama, huge_pages=False)
    for name, p in plain.engine.model.named_parameters():
        assert torch.equal(p, llm.engine.model.get_parameter(name)), name


def test_tensors_read_ahead_that_nothing_takes_are_handed_back(mid_llama, tmp_path):
    """A checkpoint tensor the model does not keep (here an extra 6 MB one) is read ahead like the others; its
    pages go back to the system when the arena settles, and the weights taken keep theirs."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(mid_llama / "model.safetensors")
    tensors["model.unused.weight"] = torch.ones(3 << 20, dtype=torch.bfloat16)
    for f in mid_llama.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).symlink_to(f)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reservation = _reserve(tmp_path, "BF16")
    llm = _llm(tmp_path, weight_reservation=reservation)
    arena = llm.engine.model.weight_arena
    assert set(reservation.slots) - reservation.taken == {"model.unused.weight"}
    rss = _mapping(arena.data_ptr())["Rss"] * 1024
    released = arena.finish_reservation()
    assert (6 << 20) - 2 * 4096 <= released <= 6 << 20
    assert _mapping(arena.data_ptr())["Rss"] * 1024 <= rss - released + 4096
    out = llm.generate([[5, 9, 2, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    plain = _llm(mid_llama, huge_pages=False)
    assert out[0].token_ids == plain.generate([[5, 9, 2, 7]], SamplingParams(max_tokens=4, temperature=0,
                                                                            ignore_eos=True))[0].token_ids


def test_the_read_ahead_layout_and_its_reads():
    """The layout keeps floating tensors stored in the kept dtype and the others as stored, each group on a
    cache line and a fused projection's parts back to back in the model's order; past them, as transient,
    those the load rebuilds (bitsandbytes' 4-bit state, a norm in another dtype) while they are few; the reads
    cover the file in few calls, stepping over short stretches."""
    S = weight_reserve.Stored
    tensors = {
        "model.layers.0.self_attn.k_proj.weight": S("a", 0, 256, "BF16", (16, 8)),
        "model.layers.0.self_attn.o_proj.weight": S("a", 256, 200, "BF16", (12, 8)),
        "model.layers.0.self_attn.q_proj.weight": S("a", 456, 512, "BF16", (32, 8)),
        "model.layers.0.self_attn.v_proj.weight": S("a", 968, 256, "BF16", (16, 8)),
        "model.norm.weight": S("a", 1224, 64, "F32", (16,)),
        "model.layers.0.mlp.up_proj.weight": S("b", 8, 100, "U8", (100, 1)),
        "model.layers.0.mlp.up_proj.weight.absmax": S("b", 108, 4, "U8", (4,)),
        "model.layers.0.mlp.gate_proj.weight": S("b", (2 << 20) + 112, 100, "I8", (100, 1)),
    }
    slots, end = weight_reserve.layout(tensors, "BF16")
    passing = {n for n, s in slots.items() if s.transient}
    assert passing == {"model.norm.weight", "model.layers.0.mlp.up_proj.weight.absmax"}
    assert min(slots[n].at for n in passing) > max(s.at for n, s in slots.items() if n not in passing)
    assert all(slots[n].at % 64 == 0 for n in passing)
    kept_end = max(s.at + s.nbytes for s in slots.values() if not s.transient)
    big = tensors | {"model.big_norm.weight": S("a", 1288, kept_end // 4, "F32", (kept_end // 16,))}
    assert not any(s.transient for s in weight_reserve.layout(big, "BF16")[0].values())  # too many: none
    assert end == max(s.at + s.nbytes for s in slots.values())
    slots = {n: s for n, s in slots.items() if not s.transient}
    q, k, v = (slots[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert k.at == q.at + 512 and v.at == k.at + 256 and q.at % 64 == 0
    gate, up = slots["model.layers.0.mlp.gate_proj.weight"], slots["model.layers.0.mlp.up_proj.weight"]
    assert gate.at != up.at + 100  # I8 and U8 parts are not alike: each alone
    assert all(s.at % 64 == 0 for s in (q, gate, up, slots["model.layers.0.self_attn.o_proj.weight"]))
    calls = weight_reserve.read_calls(slots)
    assert calls[0] == ("a", 0, [("model.layers.0.self_attn.k_proj.weight", 256),
                                 ("model.layers.0.self_attn.o_proj.weight", 200),
                                 ("model.layers.0.self_attn.q_proj.weight", 512),
                                 ("model.layers.0.self_attn.v_proj.weight", 256)])
    assert calls[1] == ("b", 8, [("model.layers.0.mlp.up_proj.weight", 100)])  # the next is 2 MB on: a call
    assert calls[2] == ("b", (2 << 20) + 112, [("model.layers.0.mlp.gate_proj.weight", 100)])
    near = {n: s for n, s in slots.items() if s.file == "a"} | {"x": weight_reserve.Slot("a", 1300, 10, 5000)}
    assert weight_reserve.read_calls(near)[0][2][-2:] == [(None, 1300 - 1224), ("x", 10)]


@pytest.mark.parametrize("mode", ["int8", "int4-nf4", "int4-fp4-double"])
def test_a_prequantized_checkpoints_state_is_read_ahead_and_handed_back(mid_llama, tmp_path, mode):
    """The state beside a pre-quantized linear's codes (int8: its row scales; int4: absmax, quant map, nested
    state, bitsandbytes' JSON) is read ahead too, past the codes, as transient, and the pages past it where
    the load writes what it makes (NF4's bf16 absmax) are faulted in; the load takes every tensor read ahead
    (but int8's weight_format markers, which it does not read), keeps nothing on those pages (the arena adopts
    the buffers lying there), and their pages go back when the arena settles; greedy tokens, before and after,
    are a plain load's."""
    from sluice.cli.quantize import quantize

    quant = {"int8": ("int8", "nf4", False), "int4-nf4": ("int4", "nf4", False),
             "int4-fp4-double": ("int4", "fp4", True)}
    quantize(mid_llama, tmp_path, *quant[mode], dtype="bfloat16")
    reservation = _reserve(tmp_path, "BF16")
    passing = {n: s for n, s in reservation.slots.items() if s.transient}
    assert passing and all(n.endswith((".SCB", ".weight_format")) or ".weight." in n for n in passing)
    reservation._thread.join(60)
    # its fp32 absmax becomes a bf16 copy in the arena: those pages are faulted in ahead
    if mode == "int4-nf4":
        assert reservation.faulted > -(-reservation.ahead // 4096) * 4096
    llm = _llm(tmp_path, weight_reservation=reservation)
    model, arena = llm.engine.model, llm.engine.model.weight_arena
    assert set(reservation.slots) == reservation.read
    assert set(reservation.slots) - reservation.taken == {n for n in reservation.slots
                                                          if n.endswith(".weight_format")}
    assert all(arena.holds(t) and not arena.passing(t) for t in [*model.parameters(), *model.buffers()])
    plain = _llm(tmp_path, huge_pages=False)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = plain.generate([[5, 9, 2, 7]], params)[0].token_ids
    assert llm.generate([[5, 9, 2, 7]], params)[0].token_ids == want
    assert arena.settled.wait(60) and arena.reservation is None
    rss = {a: _resident(arena.data_ptr() - arena._start + a, s.nbytes) for a, s in
           ((arena._start + s.at, s) for s in passing.values()) if s.nbytes >= 3 * 4096}
    assert all(pages <= 2 for pages in rss.values()), rss  # at most the pages shared with a neighbour
    assert llm.generate([[5, 9, 2, 7]], params)[0].token_ids == want


def _resident(address: int, nbytes: int) -> int:
    """How many pages of [address, address + nbytes) are resident (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    first = address // mmap.PAGESIZE * mmap.PAGESIZE
    pages = -(-(address + nbytes - first) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) == 0
    return sum(b & 1 for b in vec)


def test_pages_faulted_past_what_the_arena_wrote_are_handed_back(mid_llama):
    """A reservation that guessed too large (weights kept in 4 bytes, loaded in bf16) is still the arena; the
    pages it faulted in past what the load wrote are handed back, so the map holds what the weights need."""
    reservation = _reserve(mid_llama, "F32")
    reservation._thread.join(60)
    assert not reservation.slots  # no tensor is stored as kept: nothing read ahead, the pages faulted in
    llm = _llm(mid_llama, weight_reservation=reservation)
    arena = llm.engine.model.weight_arena
    assert arena.data_ptr() == reservation.address + reservation.start
    llm.generate([[5, 9, 2, 7]], SamplingParams(max_tokens=2, temperature=0))
    assert arena.settled.wait(60) and arena.prefaulted > 1.9 * arena.used
    assert _mapping(arena.data_ptr())["Rss"] * 1024 <= arena.used + HUGE_PAGE


def test_a_reservation_that_does_not_fit_is_unmapped_and_another_models_is_left(mid_llama, tmp_path):
    """Too small a reservation (weights guessed at one byte) is unmapped when the load looks for it and the
    arena maps its own; one for another folder is left for that model, and `discard` unmaps it."""
    small = _reserve(mid_llama, "F8_E4M3")
    arena = _llm(mid_llama, weight_reservation=small).engine.model.weight_arena
    assert small.map.closed and arena.prefaulted == 0
    assert arena.data_ptr() != small.address + small.start
    other = tmp_path / "other"
    other.mkdir()
    for f in mid_llama.iterdir():
        (other / f.name).symlink_to(f)
    elsewhere = _reserve(other, "BF16")
    assert _llm(mid_llama, weight_reservation=elsewhere).engine.model.weight_arena.prefaulted == 0
    assert not elsewhere.map.closed
    assert weight_reserve.discard(elsewhere) is True and elsewhere.map.closed
