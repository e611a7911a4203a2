"""LoRA's grouped products against a per-token reference: each token's x · A[slot]ᵀ · B[slot]ᵀ added to the
base output, tokens without an adapter untouched: torch groups, the C++ kernel on every CPU tier this host
runs, the Triton kernel under TRITON_INTERPRET=1; and the decode stack adding the step's adapters bitwise as
the layers do."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # conftest sets it before triton can load (triton reads it at import)

import pytest  # noqa: E402
import torch  # noqa: E402

from sluice.engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from sluice.kernels import decode_stack  # noqa: E402
from sluice.kernels.lora_groups import add_lora, cpu_kernel, token_groups  # noqa: E402
from tests.test_decode_stack import KV, WIDE, python_layers, step  # noqa: E402
from tests.test_engine import random_prompts  # noqa: E402
from tests.test_lora import ALL, make_adapter  # noqa: E402
from tests.tiers import tier_fixture  # noqa: E402

SLOTS = [-1, 2, 2, 0, -1, 1, 1, 1, 0, 2, -1, 3]  # contiguous runs and scattered tokens of each slot
cpu_tier = tier_fixture(autouse=False)


def case(dtype, rank=24, k=40, n=72, seed=0, slots=SLOTS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), k, generator=g).to(dtype)
    a = torch.randn(4, rank, k, generator=g).to(dtype)
    b = (torch.randn(4, n, rank, generator=g) * 0.1).to(dtype)
    y = torch.randn(len(slots), n, generator=g).to(dtype)
    want = y.float().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            want[t] += b[s].float() @ (a[s].float() @ x[t].float())
    return x, a, b, y, want


def test_torch_groups_match_the_per_token_reference():
    x, a, b, y, want = case(torch.float32)
    groups = token_groups(SLOTS, x.device)
    assert any(isinstance(rows, slice) for _, rows in groups) and any(torch.is_tensor(r) for _, r in groups)
    got = add_lora(y.clone(), x, a, b, groups)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[[0, 4, 10]], y[[0, 4, 10]])  # tokens without an adapter keep the base output


def cpp():
    ext = cpu_kernel()
    assert ext is not None, "csrc/lora.cpp did not build (see the warning)"
    return ext


def part_reference(x, a, b, y, slots, splits, scale):
    """The reference of a fused projection: part p's output rows from its own rank columns only."""
    want, rp = y.float().clone(), a.shape[1] // len(splits)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        first = 0
        for p, out in enumerate(splits):
            cols, rows = slice(p * rp, (p + 1) * rp), slice(first, first + out)
            want[t, rows] += scale * (b[s, rows, cols].float() @ (a[s, cols].float() @ x[t].float()))
            first += out
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, rank, splits", [(40, 24, [72]), (43, 20, [72]), (43, 24, [36, 20, 16])],
                         ids=["whole-vectors", "tails", "fused-parts"])
def test_cpp_kernel_matches_the_per_token_reference(cpu_tier, dtype, k, rank, splits):
    """Every tier's C++ kernel: x [T, K], per-token slots, A [S, R, K], B [S, N, R] and a scale added into y
    in place, fp32 sums; a fused projection's parts read only their own rank columns (the others hold
    garbage)."""
    x, a, b, y, _ = case(dtype, rank=rank, k=k)
    slots = [s if s != 3 else -1 for s in SLOTS] + [3] * 9  # a group of more than one shrink block
    x, y = torch.cat([x, x[:9] * 0.5]), torch.cat([y, y[:9]])
    rp = rank // len(splits)
    if len(splits) > 1:  # garbage in every rank column outside each part's own: never read
        first = 0
        for p, out in enumerate(splits):
            b[:, first:first + out, :p * rp] = 1e3
            b[:, first:first + out, (p + 1) * rp:] = -1e3
            first += out
    want = part_reference(x, a, b, y, slots, splits, 0.5)
    got = y.clone()
    out = cpp().lora_add(got, x, a, b, torch.tensor(slots), 0.5, splits if len(splits) > 1 else [])
    assert out.data_ptr() == got.data_ptr()  # in place
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), want, atol=tol * 4, rtol=tol)
    untouched = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(got[untouched], y[untouched])


def test_cpp_mapping_is_the_step_grouping(cpu_tier):
    """A LoraMapping set once per step serves every projection; None (a step without adapters) adds nothing;
    torch's per-group path with the same groups agrees."""
    ext = cpp()
    x, a, b, y, want = case(torch.float32)
    mapping = ext.LoraMapping()
    assert not mapping.active
    mapping.set(torch.tensor(SLOTS, dtype=torch.int32))
    assert mapping.active
    got = add_lora(y.clone(), x, a, b, token_groups(SLOTS, x.device), mapping=mapping)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    mapping.set(None)
    assert not mapping.active and torch.equal(ext.lora_add_mapped(y.clone(), x, a, b, mapping), y)


def test_cpp_kernel_refuses_what_it_cannot_run(cpu_tier):
    """Mixed dtypes, a slot past the stacked slots and shapes that do not pair: a clear error, y untouched."""
    ext = cpp()
    x, a, b, y, _ = case(torch.float32)
    before = y.clone()
    with pytest.raises(RuntimeError, match="share one dtype"):
        ext.lora_add(y, x.bfloat16(), a, b, torch.tensor(SLOTS))
    with pytest.raises(RuntimeError, match="slot 7 of the mapping, but only 4 slots"):
        ext.lora_add(y, x, a, b, torch.tensor([7] * len(SLOTS)))
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        ext.lora_add(y, x[:, :8], a, b, torch.tensor(SLOTS))
    with pytest.raises(RuntimeError, match="out_splits must sum to N"):
        ext.lora_add(y, x, a, b, torch.tensor(SLOTS), 1.0, [10, 10])
    assert torch.equal(y, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_the_per_token_reference(dtype):
    pytest.importorskip("triton", reason="triton cannot be imported on this platform")
    from sluice.kernels.triton.lora_bgmv import triton_add_lora

    x, a, b, y, want = case(dtype)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    got = triton_add_lora(y.clone(), x, a, b, slots)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got[[0, 4, 10]], y[[0, 4, 10]])


@pytest.fixture
def lora_llm(checkpoint_factory, tmp_path):
    """A bf16 engine over a tiny Llama with three adapters loaded: two on every linear, one on q/v only."""
    path = checkpoint_factory("llama", **WIDE)
    specs = [(8, 16, ALL), (4, 8, ALL), (8, 16, ["q_proj", "v_proj"])]
    requests = [LoRARequest(f"a{i}", i + 1, str(make_adapter(path, tmp_path / f"a{i}", *s, seed=i)))
                for i, s in enumerate(specs)]

    def make() -> LLM:
        llm = LLM(path, **KV, enable_lora=True, max_loras=3, max_lora_rank=8)
        for r in requests:
            llm.engine.lora.add(r)
            llm.engine.lora.wait(r)
        return llm

    return make, requests


needs_stack = pytest.mark.skipif(not decode_stack.available(), reason="no decode stack on this tier")


@pytest.fixture
def stack_calls(monkeypatch) -> list[int]:
    """The token count of every step that ran on a stack."""
    calls = []
    run, logits = decode_stack.DecodeStack.run, decode_stack.DecodeStack.logits

    def spy_run(self, x, cos_sin, meta):
        calls.append(x.shape[0])
        return run(self, x, cos_sin, meta)

    def spy_logits(self, ids, positions, tables, meta):
        calls.append(ids.shape[0])
        return logits(self, ids, positions, tables, meta)

    monkeypatch.setattr(decode_stack.DecodeStack, "run", spy_run)
    monkeypatch.setattr(decode_stack.DecodeStack, "logits", spy_logits)
    return calls


@needs_stack
def test_decode_stack_adds_the_steps_adapters_bitwise_as_the_layers(lora_llm, monkeypatch, stack_calls):
    """Decode and verify steps mixing three adapters and base tokens run on the stack with the same logits as
    the Python layers; tokens without an adapter get the base model's logits, and a step without adapters adds
    none."""
    make, requests = lora_llm
    llm = make()
    query_lens = [1, 1, 2, 1, 3, 1]
    loras = [requests[0], None, requests[1], requests[2], requests[0], None]
    llm.engine.lora.prepare_step(loras, query_lens)
    stacked = step(llm, query_lens)
    assert stack_calls == [sum(query_lens)]
    llm.engine.lora.prepare_step([None] * len(loras), query_lens)
    base = step(llm, query_lens)
    python_layers(monkeypatch)
    assert torch.equal(step(llm, query_lens), base)
    llm.engine.lora.prepare_step(loras, query_lens)
    assert torch.equal(step(llm, query_lens), stacked)
    assert len(stack_calls) == 2
    plain = [1, 8]  # the flat rows of the requests without an adapter
    assert torch.equal(stacked[plain], base[plain])
    assert all(not torch.equal(stacked[r], base[r]) for r in range(len(stacked)) if r not in plain)


@needs_stack
def test_mixed_adapter_generate_keeps_the_stack(lora_llm, monkeypatch, stack_calls):
    """Greedy tokens and logprobs of a batch mixing adapters, its decode steps on the stack, as the layers
    give."""
    make, requests = lora_llm
    prompts = random_prompts(6, 5, 20, seed=4)
    loras = [requests[i % 3] if i != 4 else None for i in range(len(prompts))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    stacked = make().generate(prompts, params, progress=False, lora_request=loras)
    assert len(stack_calls) >= params.max_tokens - 1
    python_layers(monkeypatch)
    calls = len(stack_calls)
    reference = make().generate(prompts, params, progress=False, lora_request=loras)
    assert len(stack_calls) == calls
    assert [o.token_ids for o in stacked] == [o.token_ids for o in reference]
    assert [o.logprobs for o in stacked] == [o.logprobs for o in reference]
