"""LoRA adapters in the continuous batch, against PEFT's merge_and_unload() of the same adapters."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from sluice.engine import LLM, LoRARequest, RequestRejected, SamplingParams
from tests.checkpoints import make_checkpoint

GREEDY = SamplingParams(max_tokens=16, temperature=0)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (rank, alpha, targets, rsLoRA)
    "all8": (8, 16, ALL, False),
    "qv4": (4, 8, ["q_proj", "v_proj"], True),
    "mlp16": (16, 32, ["gate_proj", "up_proj", "down_proj"], False),
}


def make_adapter(base: Path, out: Path, rank: int, alpha: int, targets: list[str], rslora: bool = False,
                 seed: int = 0, **extra) -> Path:
    """A PEFT LoRA adapter of `base` with random A and B (so it changes the output), saved as PEFT saves
    it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                        init_lora_weights=False, **extra)
    peft = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft.save_pretrained(out)
    return out


def merged_greedy(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    outs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
        outs.append(out[0, len(p):].tolist())
    return outs


def prompts_of(n: int, seed: int = 3, lo: int = 3, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 400, (int(k),), generator=g).tolist()
            for k in torch.randint(lo, hi, (n,), generator=g)]


@pytest.fixture(scope="module")
def lora_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint(root / "base", "llama")
    adapters = {name: make_adapter(base, root / name, *spec, seed=i)
                for i, (name, spec) in enumerate(ADAPTERS.items())}
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    prompts = prompts_of(8)
    order = [None, "all8", "qv4", "mlp16", "all8", None, "mlp16", "qv4"]
    refs = {name: merged_greedy(base, adapters.get(name), prompts) for name in [None, *ADAPTERS]}
    expected = [refs[name][i] for i, name in enumerate(order)]
    return base, adapters, requests, prompts, order, expected, refs


def run(llm: LLM, case) -> list[list[int]]:
    _, _, requests, prompts, order, _, _ = case
    loras = [None if name is None else requests[name] for name in order]
    return [o.token_ids for o in llm.generate(prompts, GREEDY, progress=False, lora_request=loras)]


def test_adapters_change_the_output(lora_case):
    *_, refs = lora_case
    for name in ADAPTERS:
        assert refs[name] != refs[None], name


def test_mixed_adapters_in_one_batch_match_merged_models(lora_case):
    base, *_, expected, _ = lora_case
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=3, max_lora_rank=16)
    assert run(llm, lora_case) == expected
    assert llm.engine.lora.stats()["lora_loaded"] == 3


def test_fewer_slots_than_adapters_swap(lora_case):
    base, *_, expected, _ = lora_case
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16,
              max_cpu_loras=2)
    assert run(llm, lora_case) == expected
    assert len(llm.engine.lora.loaded) <= 2


def test_adapters_under_chunked_prefill_and_preemption(lora_case):
    base, *_, expected, _ = lora_case
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_batched_tokens=16)
    assert run(llm, lora_case) == expected
    per_block = llm.engine.kv_block_bytes
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=3, max_lora_rank=16,
              kv_cache_memory_gb=12 * per_block / 1024**3)
    assert run(llm, lora_case) == expected
    assert llm.stats()["num_preemptions"] > 0


def test_prefix_cache_never_serves_another_adapter(lora_case):
    base, adapters, requests, *_ = lora_case
    prompt = prompts_of(1, seed=9, lo=40, hi=41)[0]  # two full blocks of 16
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
    first = llm.generate([prompt], GREEDY, progress=False)[0]
    tuned = llm.generate([prompt], GREEDY, progress=False, lora_request=requests["all8"])[0]
    again = llm.generate([prompt], GREEDY, progress=False, lora_request=requests["all8"])[0]
    assert first.metrics.num_cached_tokens == 0 and tuned.metrics.num_cached_tokens == 0
    assert again.metrics.num_cached_tokens == 32  # its own adapter's blocks do serve it
    assert tuned.token_ids == again.token_ids == merged_greedy(base, adapters["all8"], [prompt])[0]


def test_bad_adapters_are_rejected_by_name_and_the_rest_run(lora_case, tmp_path):
    base, adapters, requests, prompts, *_ , refs = lora_case
    other = make_checkpoint(tmp_path / "other", "llama", hidden_size=48, intermediate_size=96)
    wrong_base = make_adapter(other, tmp_path / "wrong", 4, 8, ["q_proj"])
    dora = make_adapter(base, tmp_path / "dora", 4, 8, ["q_proj"], use_dora=True)
    too_big = make_adapter(base, tmp_path / "big", 32, 8, ["q_proj"])
    corrupt = make_adapter(base, tmp_path / "corrupt", 4, 8, ["q_proj"])
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
    engine = llm.engine
    cases = {"missing": (tmp_path / "nowhere", "not a folder"), "dora": (dora, "use_dora"),
             "big": (too_big, "exceeds max_lora_rank (16)")}
    for i, (name, (path, reason)) in enumerate(cases.items()):
        with pytest.raises(RequestRejected, match=rf"adapter .{name}.*{re.escape(reason)}"):
            engine.add_request(f"bad-{name}", prompts[0], GREEDY,
                               lora_request=LoRARequest(name, 50 + i, str(path)))
    engine.add_request("good", prompts[1], GREEDY, lora_request=requests["qv4"])
    engine.add_request("base", prompts[2], GREEDY)
    engine.add_request("wrong", prompts[3], GREEDY, lora_request=LoRARequest("wrong", 60, str(wrong_base)))
    engine.add_request("corrupt", prompts[4], GREEDY, lora_request=LoRARequest("corrupt", 61, str(corrupt)))
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert outs["good"].token_ids == merged_greedy(base, adapters["qv4"], [prompts[1]])[0]
    assert outs["base"].token_ids == refs[None][2]
    assert outs["wrong"].finish_reason == "error" and "adapter 'wrong'" in outs["wrong"].error
    assert "another base" in outs["wrong"].error
    assert outs["corrupt"].finish_reason == "error" and "adapter 'corrupt'" in outs["corrupt"].error


def test_unsupported_fields_are_named(lora_case, tmp_path):
    base, *_ = lora_case
    from sluice.engine.lora import LoRAError, read_adapter

    saved = make_adapter(base, tmp_path / "ok", 4, 8, ["q_proj"])
    config = json.loads((saved / "adapter_config.json").read_text())
    for field, value in [("modules_to_save", ["lm_head"]), ("bias", "all"), ("use_dora", True),
                         ("peft_type", "IA3"), ("target_modules", ["embed_tokens"])]:
        (saved / "adapter_config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(LoRAError, match=field.split("_")[0] if field != "target_modules" else "embed"):
            read_adapter("x", saved)


def test_an_engine_without_lora_refuses_adapters(lora_case):
    base, _, requests, prompts, *_ = lora_case
    llm = LLM(base, dtype="float32", device="cpu")
    with pytest.raises(RequestRejected, match="enable_lora"):
        llm.engine.add_request("x", prompts[0], GREEDY, lora_request=requests["all8"])


def effective_weights(llm: LLM) -> dict[str, torch.Tensor]:
    """Each decoder projection's weight as the engine's (quantized) linear applies it, read by an identity
    probe, split into the checkpoint's own linears."""
    from sluice.engine.lora.slots import LoRALinear, projection_shapes

    model, names = llm.engine.model, {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                      "self_attn.o_proj": ["o_proj"],
                                      "mlp.gate_up_proj": ["gate_proj", "up_proj"],
                                      "mlp.down_proj": ["down_proj"]}
    shapes = projection_shapes(model.config)
    out = {}
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            for proj, parts in names.items():
                block, attr = proj.split(".")
                linear = getattr(getattr(layer, block), attr)
                base = linear.base if isinstance(linear, LoRALinear) else linear
                inp = shapes[proj][0][1]
                w = base(torch.eye(inp, dtype=torch.float32)).T.float()
                rows = [o for o, _ in shapes[proj]]
                for name, part in zip(parts, w.split(rows), strict=True):
                    out[f"model.layers.{i}.{block}.{name}.weight"] = part.contiguous()
    return out


@pytest.mark.parametrize("quantization", ["int8", "int8_weight_only", "int4"])
def test_adapters_on_quantized_bases_match_the_dequantized_base(lora_case, quantization, tmp_path):
    """Every prompt position's logits with the adapter equal PEFT's merge into the dequantized base (the
    weights the quantized linears apply, read by an identity probe), far closer than the adapter's own
    effect."""
    base, adapters, requests, prompts, *_ = lora_case
    llm = LLM(base, dtype="float32", device="cpu", quantization=quantization, enable_lora=True, max_loras=3,
              max_lora_rank=16)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.load_state_dict(effective_weights(llm), strict=False)
    model.save_pretrained(tmp_path / "dequantized")
    plain = llm.score(prompts[:3])
    for name in ("all8", "mlp16"):
        merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized",
                                                                                dtype=torch.float32),
                                           adapters[name]).merge_and_unload()
        ours = llm.score(prompts[:3], lora_request=requests[name])
        for p, got, without in zip(prompts[:3], ours, plain, strict=True):
            with torch.no_grad():
                want = merged(torch.tensor([p])).logits[0]
            error = (got - want).abs().max().item()
            effect = (want - without).abs().max().item()
            assert error < 2e-2 and effect > 20 * error, (name, error, effect)


def test_speculative_decoding_and_grammars_keep_the_adapter(lora_case):
    base, adapters, requests, prompts, order, expected, _ = lora_case
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=3, max_lora_rank=16,
              speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    repeated = [p + p[:8] + p[:8] for p in prompts]  # n-gram proposals to verify
    loras = [None if name is None else requests[name] for name in order]
    refs = {name: merged_greedy(base, adapters.get(name), repeated) for name in {*order}}
    outs = llm.generate(repeated, GREEDY, progress=False, lora_request=loras)
    assert [o.token_ids for o in outs] == [refs[name][i] for i, name in enumerate(order)]
    assert llm.stats()["spec_proposed"] > 0
    schema = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}})
    grammar = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
    out = grammar.generate([prompts[0]], schema, progress=False, lora_request=requests["all8"])[0]
    assert isinstance(json.loads(out.text)["a"], int)
