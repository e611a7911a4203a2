"""The device path on CPU: a padded decode forward with no host syncs, fixed op shapes, padding that is
exact."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sluice import kernels
from sluice.engine import LLM, SamplingParams
from sluice.engine.cuda_graphs import DecodeGraphs, capture_sizes
from sluice.engine.model_runner import ModelRunner
from sluice.engine.models.loader import load_model
from sluice.kernels import options

FORBIDDEN = ("nonzero", "_local_scalar_dense", "unique", "masked_select", "item", "boolean index")
INDEX_OPS = ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default")
BS, NUM_BLOCKS = 8, 96


class OpRecorder(TorchDispatchMode):
    """Every aten op a region runs, with the shapes of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        name = str(func)
        if name in INDEX_OPS and any(t is not None and t.dtype == torch.bool for t in args[1]):
            # syncs: the mask's true count sizes the result (nonzero below the dispatcher)
            name += " boolean index"
        self.ops.append((name, tuple(tuple(t.shape) for t in tensors)))
        return func(*args, **(kwargs or {}))

    def forbidden(self) -> list[str]:
        return [name for name, _ in self.ops if any(f in name for f in FORBIDDEN)]


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setenv("SLUICE_DEVICE_PATH", "1")
    options.reset()


def runner(path, kv: str) -> ModelRunner:
    model = load_model(path, torch.float32, torch.device("cpu"), 512)
    r = ModelRunner(model, NUM_BLOCKS, BS, torch.int8 if kv == "int8" else torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for cache in r.kv_caches:
        for name in ("k", "v"):
            t = getattr(cache, name)
            t.copy_(torch.randint(-100, 100, t.shape, generator=g) if kv == "int8"
                    else torch.randn(t.shape, generator=g))
        if kv == "int8":
            cache.k_scale.fill_(0.01)
            cache.v_scale.fill_(0.02)
    return r


def decode_batch(n: int, seed: int):
    """n decode rows: random contexts (1 .. 50), disjoint block tables, the new token's slot and position."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, 50, (n,), generator=g).tolist()
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, used = [], 0
    for c in ctx:
        k = -(-c // BS)
        tables.append(perm[used:used + k])
        used += k
    slots = [t[(c - 1) // BS] * BS + (c - 1) % BS for t, c in zip(tables, ctx, strict=True)]
    ids = torch.randint(0, 100, (n,), generator=g).tolist()
    return ids, [c - 1 for c in ctx], slots, ctx, tables


@pytest.mark.parametrize("kv", ["plain", "int8"])
def test_padded_decode_forward_makes_no_host_syncs(tiny_llama, device_path, kv):
    r = runner(tiny_llama, kv)
    graphs = DecodeGraphs(r.model, r.kv_caches, 8, 8, torch.device("cpu"), capture=False)
    size = graphs.load(*decode_batch(3, seed=1))
    assert size == 4
    with torch.inference_mode(), OpRecorder() as rec:
        graphs.runs[size]()
    assert rec.ops and not rec.forbidden()


def test_recorder_sees_the_syncs_of_the_bucketed_path(tiny_llama, monkeypatch):
    monkeypatch.setenv("SLUICE_DEVICE_PATH", "0")
    options.reset()
    # the bucketed torch groups (the CPU kernels since read int8 KV themselves)
    r = runner(tiny_llama, "plain")
    ids, pos, slots, ctx, tables = decode_batch(3, seed=1)
    meta = kernels.build_metadata([1] * 3, ctx, tables, torch.tensor(slots), BS, torch.device("cpu"))
    with torch.inference_mode(), OpRecorder() as rec:
        r.model(torch.tensor(ids), torch.tensor(pos), r.kv_caches, meta, torch.arange(3))
    assert any("boolean index" in name for name in rec.forbidden())  # the padded group rows picked by a mask


def test_batches_padded_to_one_size_record_identical_op_shapes(tiny_llama, device_path):
    r = runner(tiny_llama, "plain")
    graphs = DecodeGraphs(r.model, r.kv_caches, 16, 8, torch.device("cpu"), capture=False)
    recorded = []
    for n, seed in ((9, 2), (14, 3)):
        size = graphs.load(*decode_batch(n, seed))
        with torch.inference_mode(), OpRecorder() as rec:
            graphs.runs[size]()
        recorded.append(rec.ops)
    assert size == 16 and recorded[0] == recorded[1]


@pytest.mark.parametrize("kv", ["plain", "int8"])
def test_padded_decode_equals_unpadded(tiny_llama, device_path, kv):
    r = runner(tiny_llama, kv)
    graphs = DecodeGraphs(r.model, r.kv_caches, 8, 8, torch.device("cpu"), capture=False)
    ids, pos, slots, ctx, tables = decode_batch(5, seed=4)
    with torch.inference_mode():
        padded = graphs.run(ids, pos, slots, ctx, tables).clone()
        meta = kernels.build_flat_metadata([1] * 5, ctx, tables, slots, torch.device("cpu"), 2)
        plain = r.model(torch.tensor(ids), torch.tensor(pos), r.kv_caches, meta, torch.arange(5))
    assert padded.shape == plain.shape == (5, r.model.config.vocab_size)
    assert (padded - plain).abs().max().item() < 1e-5


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]


@pytest.mark.parametrize("extra", [{}, {"kv_cache_dtype": "int8"},
                                   {"speculative": {"method": "ngram", "num_speculative_tokens": 3}}])
def test_engine_on_the_device_path_matches_the_default_path(tiny_llama, monkeypatch, extra):
    """Chunked prefill, decode replayed through padded static buffers, n-gram verify rows and int8 KV."""
    prompts = [[5 + i % 7, 6, 7] * (3 + 4 * i) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=40, max_num_seqs=8, **extra)
    monkeypatch.setenv("SLUICE_DEVICE_PATH", "0")
    options.reset()
    want = [o.token_ids for o in LLM(tiny_llama, **kw).generate(prompts, params, progress=False)]
    monkeypatch.setenv("SLUICE_DEVICE_PATH", "1")
    options.reset()
    llm = LLM(tiny_llama, **kw)
    r = llm.engine.runner
    assert r.plan.flat and r.graphs is None
    r.graphs = DecodeGraphs(r.model, r.kv_caches, 8, 16, torch.device("cpu"), capture=False)
    sizes = []
    load = r.graphs.load
    r.graphs.load = lambda *a: sizes.append(load(*a)) or sizes[-1]
    got = [o.token_ids for o in llm.generate(prompts, params, progress=False)]
    assert got == want
    assert sizes or "speculative" in extra


def test_step_buffers_reused_across_steps_hold_no_stale_rows():
    """A big prefill step then a small mixed step in the same buffers: exactly the layout built by hand."""
    from sluice.kernels.flat_metadata import StepBuffers

    b = StepBuffers(64, 8, 6, torch.device("cpu"))
    b.load(list(range(40)), list(range(40)), list(range(40)), [39], [40], [40], [[5, 4, 3]], 2)
    ids, pos, meta, rows = b.load([7, 8, 9, 1], [3, 4, 5, 9], [11, 12, 13, -1], [2, 3], [3, 1], [6, 10],
                                  [[2], [0, 1]], 2)
    assert ids.tolist() == [7, 8, 9, 1] and pos.tolist() == [3, 4, 5, 9] and rows.tolist() == [2, 3]
    assert meta.slot_mapping.tolist() == [11, 12, 13, -1]
    assert meta.query_start.tolist() == [0, 3] and meta.query_len.tolist() == [3, 1]
    assert meta.seq_len.tolist() == [6, 10] and meta.token_seq.tolist() == [0, 0, 0, 1]
    assert meta.block_tables.shape == (2, 2) and meta.block_tables[1].tolist() == [0, 1]
    assert meta.block_tables[0, 0].item() == 2
    assert meta.tile_seq.tolist() == [0, 1] and meta.tile_q0.tolist() == [0, 0] and meta.block_q == 4


def test_padded_load_fills_padding_rows_and_fixed_views():
    from sluice.kernels.flat_metadata import StepBuffers

    b = StepBuffers(8, 8, 4, torch.device("cpu"))
    b.load(list(range(8)), list(range(8)), list(range(8)), [], [1] * 8, [5] * 8, [[1]] * 8, 2, pad_to=8)
    ids, _, meta, rows = b.load([4, 5], [6, 7], [20, 21], [], [1, 1], [7, 8], [[2], [3]], 2, pad_to=4,
                                num_splits=2)
    assert ids.tolist() == [4, 5, 0, 0] and rows.tolist() == [0, 1, 2, 3]
    assert meta.slot_mapping.tolist() == [20, 21, -1, -1] and meta.seq_len.tolist() == [7, 8, 0, 0]
    assert meta.query_len.tolist() == [1] * 4 and meta.query_start.tolist() == [0, 1, 2, 3]
    assert meta.block_tables.shape == (4, 4) and meta.num_splits == 2 and meta.block_q == 1


def test_runner_keeps_its_step_buffers(tiny_llama, device_path):
    """Steps of the device path reuse one set of buffers (same storage), regrown only when outgrown."""
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_num_batched_tokens=40, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate([[5, 6, 7] * 3], params, progress=False)
    r = llm.engine.runner
    first = r.buffers.host["input_ids"].data_ptr()
    llm.generate([[5, 6, 7] * 4, [8, 9]], params, progress=False)
    assert r.buffers.host["input_ids"].data_ptr() == first


def test_default_splits_are_powers_of_two():
    from sluice.kernels.flat_metadata import default_splits

    for seqs in (1, 2, 3, 5, 64):
        for heads in (1, 2, 8):
            for ctx in (257, 700, 1100, 3000, 9000):
                s = default_splits(seqs, heads, ctx, 1)
                assert s >= 1 and s & (s - 1) == 0
    assert default_splits(1, 8, 768, 1) == 2  # 3 wanted, rounded down
