"""LoRA adapters: a decode batch mixing distinct adapters against the base model alone (the two engines'
decode steps alternated; the median of per-step ratios) and against transformers + PEFT serving the same
requests one adapter at a time; resident memory of a fresh engine as many adapters are registered and run;
cold load time.

    python bench/lora.py [--batch 32] [--adapters 8] [--rank 16] [--new 128] [--registered 100] [--rounds 40]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import BENCH_CONFIG, base_parser, bench_model, record, table  # noqa: I001
from safetensors.torch import save_file

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(folder: Path, rank: int, seed: int) -> Path:
    """A PEFT-format rank-`rank` adapter on every linear of the bench model, random A and B."""
    h, inter = BENCH_CONFIG["hidden_size"], BENCH_CONFIG["intermediate_size"]
    kv = h // BENCH_CONFIG["num_attention_heads"] * BENCH_CONFIG["num_key_value_heads"]
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(BENCH_CONFIG["num_hidden_layers"]):
        for name, (out, inp) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp,
                                                           generator=g) / inp**0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.01).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS,
              "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": "bench"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def peft_rate(base: Path, adapters: list[Path], prompts, new: int) -> float:
    """transformers + PEFT: one static batch per adapter (set_adapter), decode tokens/s as above."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    peft = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
    for i, a in enumerate(adapters[1:], 1):
        peft.load_adapter(a, adapter_name=f"a{i}")
    per = len(prompts) // len(adapters)
    decode = 0.0
    with torch.inference_mode():
        for i in range(len(adapters)):
            peft.set_adapter(f"a{i}")
            batch = torch.tensor(prompts[i * per:(i + 1) * per])
            mask = torch.ones_like(batch)
            t = time.perf_counter()
            peft.generate(input_ids=batch, attention_mask=mask, max_new_tokens=1, do_sample=False)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            peft.generate(input_ids=batch, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False)
            decode += time.perf_counter() - t - prefill
    return len(prompts) * (new - 1) / decode


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def parse_args():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--registered", type=int, default=100)
    p.add_argument("--rounds", type=int, default=40, help="decode steps of each engine, alternated")
    return p.parse_args()


def start_batch(llm, prompts, loras, steps: int) -> None:
    """Queue the batch (adapters loaded first) and run it past its prefill: every later step decodes."""
    from sluice.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for lora in {lora for lora in loras if lora is not None}:
        llm.engine.lora.add(lora)
        llm.engine.lora.wait(lora)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        llm.add_request(f"r{i}", prompt, params, lora_request=lora)
    for _ in range(3):
        llm.step()


def decode_rounds(args, base: Path, prompts, mixed) -> list[tuple[float, float]]:
    """(base alone, adapters mixed) seconds of one B-token decode step, the two engines' steps alternated."""
    from sluice.engine import LLM

    plain = LLM(base, dtype="bfloat16", enable_prefix_caching=False)
    tuned = LLM(base, dtype="bfloat16", enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                enable_prefix_caching=False)
    start_batch(plain, prompts, [None] * len(prompts), args.rounds)
    start_batch(tuned, prompts, mixed, args.rounds)
    rows = []
    for _ in range(args.rounds):
        pair = []
        for llm in (plain, tuned):
            t = time.perf_counter()
            llm.step()
            pair.append(time.perf_counter() - t)
        rows.append((pair[0], pair[1]))
    base_ms, mixed_ms = (statistics.median(r[i] for r in rows) * 1000 for i in (0, 1))
    print(f"steps: base {base_ms:.1f} ms, {args.adapters} adapters mixed {mixed_ms:.1f} ms "
          f"(medians of {args.rounds})")
    return rows


def memory_and_load(args, base: Path, root: Path, prompt: list[int]) -> dict[str, float]:
    """A fresh engine's RSS growth over `registered` adapters run one after another (its slots are
    allocated when it is made), one adapter's bytes and the slots', an adapter's cold load ms and its copy
    into a slot."""
    import gc

    from sluice.engine import LLM, SamplingParams
    from sluice.engine.lora import LoRARequest
    from sluice.engine.lora.adapter import check_base, read_adapter
    from sluice.engine.lora.slots import projection_shapes

    many = [write_adapter(root / f"m{i}", args.rank, 1000 + i) for i in range(args.registered)]
    fresh = LLM(base, dtype="bfloat16", enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                enable_prefix_caching=False)
    one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)  # loaded, in a slot, run
    fresh.generate([prompt], one_token, progress=False)  # the base model warm, no adapter yet
    gc.collect()
    before = rss()
    for i, a in enumerate(many):
        lora = LoRARequest(f"m{i}", 100 + i, str(a))
        fresh.generate([prompt], one_token, progress=False, lora_request=lora)
    gc.collect()
    grown = rss() - before
    slots = fresh.engine.lora.slots
    shapes, loads, copies = projection_shapes(fresh.engine.model.config), [], []
    for i, a in enumerate(many[:20]):
        t = time.perf_counter()
        adapter = read_adapter(f"m{i}", a, args.rank)
        check_base(adapter, BENCH_CONFIG["num_hidden_layers"], shapes)
        loads.append(time.perf_counter() - t)
        t = time.perf_counter()
        slots.load(0, adapter)
        copies.append(time.perf_counter() - t)
    return {"grown": grown, "one": read_adapter("m0", many[0], args.rank).nbytes,
            "slots": sum(t.nbytes for t in [*slots.a.values(), *slots.b.values()]),
            "load_ms": statistics.median(loads) * 1000, "copy_ms": statistics.median(copies) * 1000}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from sluice.engine.lora import LoRARequest

    base, root = bench_model(), Path(tempfile.mkdtemp(prefix="sluice-lora-bench-"))
    adapters = [write_adapter(root / f"a{i}", args.rank, i) for i in range(args.adapters)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 32000, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
    requests = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    rows = decode_rounds(args, base, prompts, [requests[i % args.adapters] for i in range(args.batch)])
    hf = peft_rate(base, adapters, prompts, args.new)
    mem = memory_and_load(args, base, root, prompts[0][:16])
    grown, one = mem["grown"], mem["one"]
    base_rate = args.batch / statistics.median(a for a, _ in rows)
    lora_med = args.batch / statistics.median(m for _, m in rows)
    b, n = args.batch, args.adapters
    speed = table(
        [f"B={b} decode tok/s: base", f"{n} rank-{args.rank} adapters mixed", "mixed / base",
         "transformers + PEFT", "mixed / PEFT"],
        [[f"{base_rate:.1f}", f"{lora_med:.1f}", f"{statistics.median(a / m for a, m in rows):.2f}x",
          f"{hf:.1f}", f"{lora_med / hf:.2f}x"]])
    memory = table(
        [f"{args.registered} registered, max_loras {n}: RSS growth", "slots (made with the engine)",
         "cold load", "copy into a slot"],
        [[f"{grown / 2**20:.1f} MiB = {grown / one:.1f} adapters of {one / 2**20:.1f} MiB",
          f"{mem['slots'] / 2**20:.1f} MiB", f"{mem['load_ms']:.1f} ms", f"{mem['copy_ms']:.1f} ms"]])
    note = (f"Decode steps of both engines alternated, medians of {args.rounds}; PEFT: set_adapter, "
            f"batches of {b // n}.")
    body = f"{speed}\n\n{memory}\n\n{note}"
    record("LoRA adapters (bench/lora.py)", body)


if __name__ == "__main__":
    main()
