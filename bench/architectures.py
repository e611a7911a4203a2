"""Decode throughput per architecture: the generic path (transformers' modules on our paged KV) vs the native
forward on the same Llama, native MoE, and both against HF static batched generate(), in one run (bf16, CPU).

python bench/architectures.py [--batch 32] [--prompt 64] [--tokens 64] [--headlines llama,generic,moe]
    [--archs llama,...] [--threads N] [--clock wall|cpu] [--moe-shape small|qwen3]
MoE headline only: --headlines moe --archs ''.

Ratios are taken within the run; the machine is shared, so absolute tok/s move between runs. On a loaded
machine `--threads 1 --clock cpu` counts tokens per second of this process's CPU time: every parallel region
of a multi-threaded step waits for its slowest thread, which other processes deschedule, so wall-clock rates
there measure the load more than the code (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import BenchParser, add_baseline
from transformers import AutoModelForCausalLM

from sluice.engine import LLM, SamplingParams
from sluice.engine.models import forced_generic, model_path_for
from sluice.engine.models.loader import read_config

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/, after site-packages (HF's `kernels`)
from tests.checkpoints import make_checkpoint  # noqa: E402

ARCHS = ["llama", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
         "gpt_neox", "qwen2_moe", "starcoder2"]
# Bigger than the test checkpoints so matmuls, not Python, set the pace; still minutes for all archs on 2
# cores.
SIZE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=1024)
MOE = dict(moe_intermediate_size=256, num_experts=8, num_local_experts=8, num_experts_per_tok=2)
# The MoE headline's Qwen3-MoE shapes (hidden 512, 4 layers as SIZE): "small" is the first one measured (8
# experts, top 2, width 0.5x hidden); "qwen3" keeps the released family's ratios (Qwen3-30B-A3B and
# -235B-A22B: 128 experts, top 8, expert width 0.375x hidden), so at batch 32 each expert sees about two
# tokens a step, not eight.
MOE_SHAPES = {"small": MOE, "qwen3": dict(moe_intermediate_size=192, num_experts=128, num_experts_per_tok=8)}
DEFAULT_MOE_SHAPE = "small"
DEFAULT_ROOT = Path(tempfile.gettempdir()) / "sluice-bench-archs"
PER_ARCH = {"gemma2": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=64),
            "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=64),
            "qwen3": dict(head_dim=64), "qwen3_moe": dict(head_dim=64, **MOE), "mixtral": MOE,
            "qwen2_moe": dict(MOE, shared_expert_intermediate_size=512),
            # no GQA: a stray key count would size the KV pool wrong
            "gpt_neox": dict(num_key_value_heads=None)}


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def timed(fn):
    """(result, seconds of `clock`) of fn()."""
    t = clock()
    out = fn()
    return out, clock() - t


def checkpoint(arch: str, root: Path) -> Path:
    path = root / arch
    if not (path / "config.json").is_file():
        make_checkpoint(path, arch, dtype=torch.bfloat16, **{**SIZE, **PER_ARCH.get(arch, {})})
    return path


def moe_checkpoint(shape: str, root: Path) -> Path:
    """The Qwen3-MoE checkpoint of MOE_SHAPES[shape] (the "small" one is the table's qwen3_moe)."""
    if shape == "small":
        return checkpoint("qwen3_moe", root)
    path = root / f"qwen3_moe-{shape}"
    if not (path / "config.json").is_file():
        make_checkpoint(path, "qwen3_moe", dtype=torch.bfloat16,
                        **{**SIZE, "head_dim": 64, **MOE_SHAPES[shape]})
    return path


def prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(4, 400, (batch, length), generator=g).tolist()


def engine_tps(path: Path, batch: int, length: int, tokens: int, generic: bool = False,
               cpp_moe: bool = True) -> float:
    """Output tok/s of our engine on `batch` prompts, `tokens` each (warm-up excluded); `cpp_moe=False`: the
    MoE blocks' torch grouping instead of the C++ experts."""
    if generic:
        with forced_generic():
            llm = LLM(str(path), dtype="bfloat16", device="cpu")
    else:
        llm = LLM(str(path), dtype="bfloat16", device="cpu")
    if not cpp_moe:
        for block in llm.engine.model.modules():
            if hasattr(block, "cpp_experts"):
                block.cpp_experts = False
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts(2, length), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                 progress=False)
    outs, secs = timed(lambda: llm.generate(prompts(batch, length), params, progress=False))
    return sum(len(o.token_ids) for o in outs) / secs


def hf_tps(path: Path, batch: int, length: int, tokens: int) -> float:
    """Output tok/s of HF generate() on the whole batch at once (equal-length prompts: no padding)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts(batch, length))
    run = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)  # noqa: E731
    with torch.inference_mode():
        run(2)
        _, secs = timed(lambda: run(tokens))
    return batch * tokens / secs


def alternated(systems, repeats: int) -> list[float]:
    """Each system's median tok/s over `repeats` rounds, the systems alternated within every round."""
    runs = [[] for _ in systems]
    for _ in range(repeats):
        for out, run in zip(runs, systems, strict=True):
            out.append(run())
    return [statistics.median(r) for r in runs]


def llama_headline(a) -> None:
    """Generic vs native path on Llama and both vs HF generate, alternated."""
    llama = checkpoint("llama", a.root)
    native, generic, hf = alternated([lambda: engine_tps(llama, a.batch, a.prompt, a.tokens),
                                      lambda: engine_tps(llama, a.batch, a.prompt, a.tokens, True),
                                      lambda: hf_tps(llama, a.batch, a.prompt, a.tokens)], a.repeats)
    print(f"llama batch {a.batch}: native {native:.0f} tok/s, generic {generic:.0f} ({generic / native:.2f}x "
          f"native), HF static generate {hf:.0f} (generic {generic / hf:.2f}x, native {native / hf:.2f}x)",
          flush=True)


def generic_headline(a) -> None:
    """Generic vs native path on Llama alone (no HF generate), alternated."""
    llama = checkpoint("llama", a.root)
    native, generic = alternated([lambda: engine_tps(llama, a.batch, a.prompt, a.tokens),
                                  lambda: engine_tps(llama, a.batch, a.prompt, a.tokens, True)], a.repeats)
    print(f"llama batch {a.batch}: native {native:.0f} tok/s, generic {generic:.0f} ({generic / native:.2f}x "
          "native)",
          flush=True)


def moe_headline(a) -> None:
    """Native MoE (C++ experts, then the torch grouping: SLUICE_CPU_KERNEL=0 semantics per block) vs HF
    generate."""
    moe = moe_checkpoint(a.moe_shape, a.root)
    ours, torch_moe, ref = alternated([lambda: engine_tps(moe, a.batch, a.prompt, a.tokens),
                                       lambda: engine_tps(moe, a.batch, a.prompt, a.tokens, cpp_moe=False),
                                       lambda: hf_tps(moe, a.batch, a.prompt, a.tokens)], a.repeats)
    print(f"qwen3_moe ({a.moe_shape}) batch {a.batch}: native MoE {ours:.0f} tok/s (torch grouping "
          f"{torch_moe:.0f}: C++ experts {ours / torch_moe:.2f}x), HF static generate {ref:.0f} "
          f"({ours / ref:.2f}x)", flush=True)


def table(a) -> None:
    """The per-architecture rows (single measurements); nothing where `--archs ''`."""
    if not a.archs:
        return
    print("| architecture | path | tok/s batch 1 | tok/s batch 32 | HF generate batch 32 |\n"
          "|---|---|---|---|---|")
    for arch in filter(None, a.archs.split(",")):
        path = checkpoint(arch, a.root)
        one, many = (engine_tps(path, b, a.prompt, a.tokens) for b in (1, a.batch))
        print(f"| {arch} | {model_path_for(read_config(path))[0]} | {one:.0f} | {many:.0f} | "
              f"{hf_tps(path, a.batch, a.prompt, a.tokens):.0f} |", flush=True)


def main() -> None:
    p = add_baseline(BenchParser(description=__doc__))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--headlines", default="llama,moe",
                   help="which alternated headline comparisons to run (generic: generic vs native on Llama "
                        "alone)")
    p.add_argument("--archs", default=",".join(ARCHS), help="per-architecture table ('' skips it)")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of each headline system (median)")
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    p.add_argument("--moe-shape", choices=list(MOE_SHAPES), default=DEFAULT_MOE_SHAPE,
                   help="the MoE headline's shape")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--clock", choices=list(CLOCK), default="wall",
                   help="cpu: tok/s per second of process CPU time")
    a = p.parse_args()
    global clock
    clock = CLOCK[a.clock]
    if a.threads:
        torch.set_num_threads(a.threads)
    heads = a.headlines.split(",")
    if "llama" in heads:
        llama_headline(a)
    if "generic" in heads:
        generic_headline(a)
    if "moe" in heads:
        moe_headline(a)
    table(a)


if __name__ == "__main__":
    main()
