"""Where a batch-32 decode step of the native MoE forward goes (torch profiler, bf16, CPU): the router, the
experts (grouping, products and combine: one C++ call, or the torch grouping's ops), attention, norms, the LM
head and the rest of the engine step, per decode step.

python bench/moe_profile.py [--batch 32] [--prompt 32] [--tokens 32] [--threads N] [--torch-grouping]
    [--shape ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import architectures as arch
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from sluice import kernels
from sluice.engine import LLM, SamplingParams
from sluice.engine.kv_cache import LayerKVCache
from sluice.engine.models import llama, moe
from sluice.kernels import linear as linear_mod

PARTS = {"model forward": (llama.LlamaModel, "forward"),
         "decoder layers": (llama.LlamaModel, "hidden_states"),
         "moe block": (moe.SparseMoe, "forward"), "router": (moe.SparseMoe, "route"),
         "attention": (llama.Attention, "forward"), "linears": (linear_mod.Linear, "forward"),
         "q/k norms": (llama.RMSNorm, "forward"), "rope": (kernels, "rope_qk"),
         "kv write": (LayerKVCache, "write"),
         "paged attention": (LayerKVCache, "attend"), "residual+norm": (llama.RMSNorm, "add"),
         "lm head": (llama.LlamaModel, "compute_logits")}
CPU = defaultdict(float)  # thread CPU seconds per labelled part (the engine's forward runs on this thread)


def labelled(owner, name: str, label: str) -> None:
    """Wrap owner.name (a method or a module's function) in a profiler range called `label` that also adds up
    its thread CPU time (this script only)."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.thread_time()
        with record_function(label):
            out = fn(*args, **kwargs)
        CPU[label] += time.thread_time() - start
        return out

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--torch-grouping", action="store_true",
                   help="the MoE blocks' torch grouping, not the C++ call")
    p.add_argument("--shape", choices=list(arch.MOE_SHAPES), default=arch.DEFAULT_MOE_SHAPE)
    p.add_argument("--root", type=Path, default=arch.DEFAULT_ROOT)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    for label, (cls, name) in PARTS.items():
        if hasattr(cls, name):
            labelled(cls, name, label)
    llm = LLM(str(arch.moe_checkpoint(a.shape, a.root)), dtype="bfloat16", device="cpu")
    if a.torch_grouping:
        for block in llm.engine.model.modules():
            if hasattr(block, "cpp_experts"):
                block.cpp_experts = False
    prompts = arch.prompts(a.batch, a.prompt)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), progress=False)
    for i, r in enumerate(prompts):  # the prefill outside the profile, then decode steps only
        llm.add_request(str(i), r, SamplingParams(max_tokens=a.tokens + 1, temperature=0, ignore_eos=True))
    step_all(llm, 1)
    CPU.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.thread_time()
        with record_function("step"):
            steps = step_all(llm, a.tokens - 1)
        CPU["step"] = time.thread_time() - start
    report(prof, steps)


def step_all(llm: LLM, limit: int) -> int:
    """Run up to `limit` engine steps; the number run."""
    n = 0
    while n < limit and llm.has_unfinished():
        llm.step()
        n += 1
    return n


def report(prof, steps: int) -> None:
    """Per decode step: each labelled part's thread CPU time and profiler wall time (inclusive; the profiler's
    own overhead is in both), then the top ops by self time."""
    wall = {ev.key: ev.cpu_time_total / steps for ev in prof.key_averages() if ev.key in ("step", *PARTS)}
    print(f"{steps} decode steps; per step: thread CPU us (share of the step), profiler wall us")
    for k in ("step", *PARTS):
        cpu = CPU.get(k, 0.0) / steps * 1e6
        print(f"{k:>16}: {cpu:8.0f} ({cpu / (CPU['step'] / steps * 1e6):4.0%}) {wall.get(k, 0.0):8.0f}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    sys.exit(main())
