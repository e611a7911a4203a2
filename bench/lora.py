"""LoRA adapters: a decode batch mixing distinct adapters against the base model alone and against
transformers + PEFT serving the same requests one adapter at a time; memory with many adapters registered;
cold load time.

    python bench/lora.py [--batch 32] [--adapters 8] [--rank 16] [--new 128] [--registered 100]
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


def decode_rate(llm, prompts, loras, new: int) -> float:
    """Decode tokens/s of one batch: (all tokens - first tokens) / (time - time to the first tokens)."""
    from sluice.engine import SamplingParams

    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, first, progress=False, lora_request=loras)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts, full, progress=False, lora_request=loras)
    total = time.perf_counter() - t
    return len(prompts) * (new - 1) / max(total - prefill, 1e-9)


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
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args()


def decode_rounds(args, base: Path, prompts, mixed) -> tuple[list[tuple[float, float]], object]:
    """Per round, (base alone, adapters mixed) decode tok/s; the adapter engine (kept for the memory rows)."""
    from sluice.engine import LLM

    plain = LLM(base, dtype="bfloat16", enable_prefix_caching=False)  # both runs of a batch prefill
    tuned = LLM(base, dtype="bfloat16", enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                enable_prefix_caching=False)
    decode_rate(tuned, prompts[:2], mixed[:2], 4)  # warm both
    decode_rate(plain, prompts[:2], None, 4)
    rows = []
    for r in range(args.rounds):
        rows.append((decode_rate(plain, prompts, None, args.new),
                     decode_rate(tuned, prompts, mixed, args.new)))
        print(f"round {r}: base {rows[-1][0]:.1f} tok/s, {args.adapters} adapters mixed {rows[-1][1]:.1f} "
              "tok/s")
    return rows, tuned


def memory_and_load(args, tuned, root: Path, prompt: list[int]) -> tuple[int, int, float]:
    """RSS growth over `registered` adapters run one after another, one adapter's bytes, its cold load ms."""
    from sluice.engine.lora import LoRARequest
    from sluice.engine.lora.adapter import check_base, read_adapter
    from sluice.engine.lora.slots import projection_shapes

    many = [write_adapter(root / f"m{i}", args.rank, 1000 + i) for i in range(args.registered)]
    before = rss()
    for i, a in enumerate(many):
        tuned.generate([prompt], None, progress=False, lora_request=LoRARequest(f"m{i}", 100 + i, str(a)))
    grown = rss() - before
    shapes, loads = projection_shapes(tuned.engine.model.config), []
    for i, a in enumerate(many[:20]):
        t = time.perf_counter()
        check_base(read_adapter(f"m{i}", a, args.rank), BENCH_CONFIG["num_hidden_layers"], shapes)
        loads.append(time.perf_counter() - t)
    return grown, read_adapter("m0", many[0], args.rank).nbytes, statistics.median(loads) * 1000


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from sluice.engine.lora import LoRARequest

    base, root = bench_model(), Path(tempfile.mkdtemp(prefix="sluice-lora-bench-"))
    adapters = [write_adapter(root / f"a{i}", args.rank, i) for i in range(args.adapters)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 32000, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
    requests = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    rows, tuned = decode_rounds(args, base, prompts, [requests[i % args.adapters] for i in range(args.batch)])
    hf = peft_rate(base, adapters, prompts, args.new)
    grown, one, cold = memory_and_load(args, tuned, root, prompts[0][:16])
    lora_med = statistics.median(b for _, b in rows)
    body = table(
        ["what", "value"],
        [[f"B={args.batch} decode tok/s, base model alone (median of {args.rounds})",
          f"{statistics.median(a for a, _ in rows):.1f}"],
         [f"B={args.batch} decode tok/s, {args.adapters} rank-{args.rank} adapters (all linears) mixed",
          f"{lora_med:.1f}"],
         ["mixed / base alone (median of per-round ratios)",
          f"{statistics.median(b / a for a, b in rows):.2f}x"],
         ["transformers + PEFT, one adapter at a time (set_adapter, batches of "
          f"{args.batch // args.adapters})",
          f"{hf:.1f}"],
         ["mixed / transformers + PEFT", f"{lora_med / hf:.2f}x"],
         [f"RSS growth after {args.registered} adapters registered and run (max_loras {args.adapters})",
          f"{grown / 2**20:.1f} MiB = {grown / one:.1f} adapters of {one / 2**20:.1f} MiB"],
         [f"cold load of a rank-{args.rank} adapter (read + checked, median of 20)", f"{cold:.1f} ms"]])
    record("LoRA adapters (bench/lora.py)", body)


if __name__ == "__main__":
    main()
