"""Decode A/B in one process: the int8 (LLM.int8()) engine with our LLMInt8Linear against the same CB/SCB in
bitsandbytes' Linear8bitLt, swapped in place, alternated; tok/s of a batch of 32-token greedy generations.

python bench/int8_vs_bnb.py [BATCH]  (run from bench/)
"""
import logging
import sys
import time

import bitsandbytes as bnb
from common import bench_model

from sluice.engine import LLM, SamplingParams
from sluice.engine.quantization.int8_cpu import LLMInt8Linear

for n in ("bitsandbytes.backends.cpu.ops", "bitsandbytes.autograd._functions"):
    logging.getLogger(n).setLevel(logging.ERROR)
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
llm = LLM(str(bench_model()), dtype="bfloat16", device="cpu", quantization="int8", kv_cache_memory_gb=0.5)
ours, theirs = {}, {}
for name, mod in llm.engine.model.named_modules():
    if isinstance(mod, LLMInt8Linear):
        b = bnb.nn.Linear8bitLt(mod.in_features, mod.out_features, bias=mod.bias is not None, has_fp16_weights=False,
                                threshold=mod.threshold, device="meta")
        b.weight = bnb.nn.Int8Params(mod.weight.data, requires_grad=False, has_fp16_weights=False, CB=mod.weight.data,
                                     SCB=mod.SCB)
        b.bias = mod.bias
        ours[name], theirs[name] = mod, b.eval()



def use(table):
    """Put these linears into the model."""
    for name, mod in table.items():
        parent, _, attr = name.rpartition(".")
        setattr(llm.engine.model.get_submodule(parent), attr, mod)


prompts = [[1, *range(5 + i, 37 + i)] for i in range(batch)]
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
res = {"ours": [], "bnb": []}
outs = {}
for _ in range(4):
    for name, table in (("ours", ours), ("bnb", theirs)):
        use(table)
        s = time.perf_counter()
        out = llm.generate(prompts, params, progress=False)
        res[name].append(batch * 32 / (time.perf_counter() - s))
        outs[name] = [o.token_ids for o in out]
same = sum(a == b for x, y in zip(outs["ours"], outs["bnb"], strict=True) for a, b in zip(x, y, strict=True))
print(f"batch {batch}: tok/s ours {sorted(res['ours'])[-2]:.1f} bnb {sorted(res['bnb'])[-2]:.1f} (2nd best of 4); "
      f"ratio {sorted(res['ours'])[-2] / sorted(res['bnb'])[-2]:.2f}; greedy tokens equal {same}/{batch * 32}")
