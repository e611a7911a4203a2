"""One-shot GPU check: exactness vs transformers, decode throughput, launches/syncs per step, HBM roofline.

    python bench/gpu_check.py [--out DIR]              # one CUDA GPU, < 8 minutes on an H200
    python bench/gpu_check.py --device cpu --small     # smoke run of every stage on CPU (tiny shapes)

Writes DIR/gpu_check.json (DIR: --out, else $OUT, else results/) after every stage, so a run cut short
still leaves what it measured. A stage that fails records its error and the next one runs.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from sluice.engine import LLM, SamplingParams  # noqa: E402

BUNDLED = ROOT / "models" / "sluice-tiny"
BIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
           num_key_value_heads=8, vocab_size=128256, max_position_embeddings=2048)
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
MODES = {"bf16": None, "int8_weight_only": "int8_weight_only", "bnb_int8": "int8", "bnb_nf4": "int4"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
BUDGET_S = 450


class Check:
    """Runs stages in order under one time budget and writes the JSON after each."""

    def __init__(self, args) -> None:
        self.args, self.dev = args, torch.device(args.device)
        self.out = Path(args.out or os.environ.get("OUT") or ROOT / "results")
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.result: dict = {"command": " ".join(sys.argv), "stages": {}}

    def stage(self, name: str, fn) -> None:
        if time.monotonic() - self.start > BUDGET_S:
            self.result["stages"][name] = {"skipped": "time budget spent"}
        else:
            t0 = time.monotonic()
            try:
                value = fn()
            except Exception as e:  # a failing stage is a result too; the others still run
                value = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            value["seconds"] = round(time.monotonic() - t0, 1)
            self.result["stages"][name] = value
        free()
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=2))
        print(name, json.dumps(self.result["stages"][name])[:600], flush=True)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def environment(dev: torch.device) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
            "triton": _version("triton"), "bitsandbytes": _version("bitsandbytes"), "device": str(dev)}
    if dev.type == "cuda":
        info |= {"gpu": torch.cuda.get_device_name(dev), "cuda": torch.version.cuda,
                 "memory_gib": round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 1)}
    return info


def _version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return __import__(name).__version__
    except Exception as e:  # installed but not importable (e.g. bitsandbytes without its CUDA library)
        return f"unimportable: {e}"


def random_llama(small: bool) -> Path:
    """A random Llama built from its config (the ~1B shape, or a tiny one), saved as bf16 safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(tempfile.mkdtemp(prefix="sluice-gpu-check-"))
    cfg = LlamaConfig(**(SMALL if small else BIG), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    return path


def engine(path: Path, dev: torch.device, dtype: str, **kw) -> LLM:
    return LLM(str(path), dtype=dtype, device=dev.type, tokenizer=str(BUNDLED),
               kv_cache_memory_gb=kw.pop("kv_gb", 8.0), **kw)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, length), generator=g).tolist()


def greedy_exactness(dev: torch.device, small: bool) -> dict:
    """Greedy tokens of the bundled model: ours vs transformers (full forward per token), fp32 (must match)
    and bf16."""
    from transformers import AutoModelForCausalLM

    ps = prompts(4 if small else 8, 12, 8192, seed=1)
    new = 8 if small else 32
    out = {}
    for dtype in ("float32", "bfloat16"):
        hf = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=getattr(torch, dtype)).to(dev)
        want = [hf_greedy(hf, p, new, dev) for p in ps]
        del hf
        llm = engine(BUNDLED, dev, dtype, kv_gb=1.0)
        got = [o.token_ids
               for o in llm.generate(ps, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
                                     progress=False)]
        del llm
        same = sum(a == b for a, b in zip(got, want, strict=True))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), new)
                  for a, b in zip(got, want, strict=True)]
        out[dtype] = {"sequences_equal": same, "sequences": len(ps), "first_divergence": prefix}
    out["pass"] = out["float32"]["sequences_equal"] == len(ps)
    return out


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], new: int, dev: torch.device) -> list[int]:
    """Greedy tokens from transformers' full forward at each step (EOS is just another token, as
    ignore_eos)."""
    ids = torch.tensor([prompt], device=dev)
    for _ in range(new):
        ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def prompt_logits(dev: torch.device, path: Path, small: bool) -> dict:
    """Prompt logits of the random ~1B Llama: ours through the paged engine vs transformers' forward."""
    from transformers import AutoModelForCausalLM

    vocab = (SMALL if small else BIG)["vocab_size"]
    ps = prompts(2, 64 if small else 256, vocab, seed=2)
    out = {}
    for dtype, tol in (("float32", 1e-3), ("bfloat16", 5e-2)):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(dev)
        with torch.no_grad():
            want = [hf(torch.tensor([p], device=dev)).logits[0].float().cpu() for p in ps]
        del hf
        free()
        llm = engine(path, dev, dtype, kv_gb=2.0, enforce_eager=True)
        got = [g.float() for g in llm.score(ps)]
        del llm
        err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True))
        top1 = sum((a.argmax(-1) == b.argmax(-1)).float().mean().item()
                   for a, b in zip(got, want, strict=True)) / len(ps)
        out[dtype] = {"max_rel_err": err, "top1_agreement": top1, "tolerance": tol, "pass": err < tol}
    return out


def decode_rate(llm: LLM, batch: int, steps: int, vocab: int) -> tuple[float, float]:
    """Decode tokens/s and seconds per step with `batch` running requests (timed after every prefill)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts(batch, 32, vocab, seed=batch), strict=True):
        eng.add_request(rid, p, params)
    while eng.scheduler.waiting or any(not r.output_token_ids for r in eng.scheduler.running):
        eng.step()
    eng.step()
    sync(llm.engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(llm.engine.device)
    dt = time.perf_counter() - t0
    for rid in ids:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    return batch * steps / dt, dt / steps


def weight_bytes(llm: LLM) -> int:
    """Bytes a batch-1 decode step reads from weights: everything but the embedding table (one row read),
    which still counts when tied to the LM head; rotary tables excluded."""
    model = llm.engine.model
    skip = {id(model.embed_tokens.weight)} if model.lm_head is not None else set()
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in skip or name.startswith("rope."):
            continue
        total += t.numel() * t.element_size()
    return total


def copy_bandwidth(dev: torch.device) -> float:
    """Measured device copy bandwidth in bytes/s (read + write of a 1 GiB buffer)."""
    n = 2**30 if dev.type == "cuda" else 2**26
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(dev)
    return 2 * n * 10 / (time.perf_counter() - t0)


def throughput(dev: torch.device, path: Path, small: bool) -> dict:
    """Decode tok/s at batch 1/64/256 per weight mode; batch-1 fraction of the copy-bandwidth roofline."""
    vocab = (SMALL if small else BIG)["vocab_size"]
    batches, steps = ((1, 4, 8), 4) if small else ((1, 64, 256), 48)
    bw = copy_bandwidth(dev)
    out: dict = {"copy_bandwidth_gbs": bw / 1e9, "steps_timed": steps}
    for mode, quant in MODES.items():
        if quant in ("int8", "int4") and _version("bitsandbytes") is None:
            out[mode] = "unavailable (bitsandbytes not installed)"
            continue
        try:
            llm = engine(path, dev, "bfloat16", quantization=quant, max_num_seqs=max(batches), kv_gb=8.0)
        except Exception as e:
            out[mode] = f"unavailable ({type(e).__name__}: {e})"
            continue
        row = {}
        for b in batches:
            tps, step_s = decode_rate(llm, b, steps, vocab)
            row[f"batch_{b}_tok_s"] = round(tps, 1)
            if b == 1:
                kv_per_token = llm.engine.kv_block_bytes // llm.config.block_size
                step_bytes = weight_bytes(llm) + kv_per_token * (34 + steps // 2)  # mean context while timed
                row["batch_1_step_ms"] = round(step_s * 1e3, 3)
                row["batch_1_bytes_per_step"] = step_bytes
                row["batch_1_roofline_fraction"] = round(step_bytes / step_s / bw, 3)
        row["batch_max_over_batch_1"] = round(row[f"batch_{batches[-1]}_tok_s"] / row["batch_1_tok_s"], 2)
        out[mode] = row
        del llm
        free()
    return out


def launches_and_syncs(dev: torch.device, path: Path, small: bool) -> dict:
    """Kernel launches, graph launches, host syncs and device-to-host copies in one profiled decode step."""
    from torch.profiler import ProfilerActivity, profile

    vocab = (SMALL if small else BIG)["vocab_size"]
    out = {}
    for label, eager in (("cuda_graphs", False), ("eager", True)):
        llm = engine(path, dev, "bfloat16", max_num_seqs=64, kv_gb=4.0, enforce_eager=eager)
        eng = llm.engine
        for i, p in enumerate(prompts(64, 32, vocab, seed=5)):
            eng.add_request(f"p{i}", p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        for _ in range(4):
            eng.step()
        sync(dev)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            eng.step()  # ends by reading the sampled tokens: the step's own sync, nothing added here
        counts: dict[str, int] = {}
        for e in prof.events():
            counts[e.name] = counts.get(e.name, 0) + 1
        out[label] = {"kernel_launches": _count(counts, LAUNCH_CALLS),
                      "graph_launches": counts.get("cudaGraphLaunch", 0),
                      "host_syncs": _count(counts, SYNC_CALLS),
                      "d2h_copies": sum(v for k, v in counts.items() if "DtoH" in k),
                      "graphs_captured": eng.runner.graphs is not None}
        del llm, eng
        free()
    out["pass"] = out["cuda_graphs"]["host_syncs"] <= 2
    return out


def _count(counts: dict[str, int], names: tuple[str, ...]) -> int:
    return sum(counts.get(n, 0) for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    check = Check(args)
    dev, small = check.dev, args.small
    check.stage("environment", lambda: environment(dev))
    check.stage("greedy_exactness_bundled", lambda: greedy_exactness(dev, small))
    path = random_llama(small)
    check.stage("prompt_logits_random_llama", lambda: prompt_logits(dev, path, small))
    check.stage("launches_and_syncs", lambda: launches_and_syncs(dev, path, small))
    check.stage("decode_throughput", lambda: throughput(dev, path, small))
    print(f"wrote {check.out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
