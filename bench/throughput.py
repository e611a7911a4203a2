"""Output tokens/s of our engine vs HF generate() (sequential, static batched) and HF generate_batch, one run.

python bench/throughput.py [--num-requests 128] [--hf-batch-size 32] [--sequential-requests 8]
python bench/throughput.py --mixed   # 64 requests, prompts U(32,384), max_tokens U(16,192), vs HF static only
"""

from __future__ import annotations

import time

import torch
from common import base_parser, bench_model, record, table, workload
from transformers import AutoModelForCausalLM, GenerationConfig

from sluice.engine import LLM, SamplingParams

FULL = ((32, 512), (16, 256))  # (prompt range, max_tokens range)
MIXED = ((32, 384), (16, 192))


def run_engine(path, reqs):
    llm = LLM(str(path), dtype="bfloat16", device="cpu")
    llm.generate([p for p, _ in reqs[:2]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                 progress=False)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
    peak = {"util": [], "blocks": 0}
    engine = llm.engine
    for i, (p, sp) in enumerate(zip([p for p, _ in reqs], params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    outs = []
    t = time.perf_counter()
    while engine.has_unfinished():
        outs += engine.step()
        s = engine.stats()
        if s["num_running"]:
            peak["util"].append(s["kv_utilization"])
            peak["blocks"] = max(peak["blocks"], s["kv_blocks_used"])
    dt = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    util = sum(peak["util"]) / len(peak["util"])
    return tokens, dt, {"kv_util_mean": util, "kv_util_min": min(peak["util"]), "peak_blocks": peak["blocks"],
                        "steps": engine.counters["steps"], "outs": {o.request_id: o.token_ids for o in outs}}


def gen_config(max_new: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                            eos_token_id=None, pad_token_id=0)


def run_hf_sequential(model, reqs):
    tokens, t = 0, time.perf_counter()
    for p, m in reqs:
        out = model.generate(torch.tensor([p]), generation_config=gen_config(m))
        tokens += out.shape[1] - len(p)
    return tokens, time.perf_counter() - t


def run_hf_static(model, reqs, batch_size):
    """Left-padded static batches in arrival order; each batch runs to its longest max_tokens."""
    tokens, t = 0, time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, (p, _) in enumerate(chunk):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        model.generate(ids, attention_mask=mask, generation_config=gen_config(max(m for _, m in chunk)))
        tokens += sum(m for _, m in chunk)
    return tokens, time.perf_counter() - t


def run_hf_generate_batch(model, reqs):
    """transformers' continuous batching, each request with its own max_new_tokens."""
    t = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen_config(max(m for _, m in reqs)),
                                                   block=True, timeout=5) as manager:
        ids = [manager.add_request(p, max_new_tokens=m) for p, m in reqs]
        done = {}
        while len(done) < len(ids):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                done[res.request_id] = len(res.generated_tokens)
    return sum(done.values()), time.perf_counter() - t


def parse_args():
    """The benchmark's command line (--mixed fixes the request count and skips the slow HF baselines)."""
    p = base_parser(__doc__)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--sequential-requests", type=int, default=8,
                   help="HF one-at-a-time is slow: measure its rate on this many requests")
    p.add_argument("--skip-generate-batch", action="store_true")
    p.add_argument("--mixed", action="store_true",
                   help="the mixed workload: 64 requests, prompts 32-384, 16-192 new tokens, vs HF static "
                        "batching")
    p.add_argument("--generate-batch-requests", type=int, default=None,
                   help="run HF generate_batch on the first N requests only (it is slow on CPU)")
    args = p.parse_args()
    if args.mixed:
        args.num_requests, args.skip_generate_batch, args.sequential_requests = 64, True, 0
    return args


def hf_rows(path, reqs: list, args) -> list[list]:
    """Rows of the Hugging Face baselines on `reqs`: static batching, generate_batch, one request at a
    time."""
    rows = []
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        model.generate(torch.tensor([reqs[0][0][:8]]), generation_config=gen_config(2))
        t2, d2 = run_hf_static(model, reqs, args.hf_batch_size)
        rows.append([f"HF generate() static batch {args.hf_batch_size}, left padding", len(reqs), t2, d2,
                     t2 / d2])
        print(rows[-1], flush=True)
        if not args.skip_generate_batch:
            n_cb = min(args.generate_batch_requests or len(reqs), len(reqs))
            t3, d3 = run_hf_generate_batch(model, reqs[:n_cb])
            rows.append(["HF generate_batch (continuous batching)", n_cb, t3, d3, t3 / d3])
            print(rows[-1], flush=True)
        n_seq = min(args.sequential_requests, len(reqs))
        if n_seq:
            t1, d1 = run_hf_sequential(model, reqs[:n_seq])
            rows.append(["HF generate() one request at a time", n_seq, t1, d1, t1 / d1])
    return rows


def main() -> None:
    """Time the engine, then the HF baselines, on one workload and record the table."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    path = bench_model()
    shape = MIXED if args.mixed else FULL
    reqs = workload(args.num_requests, prompt_range=shape[0], out_range=shape[1])
    tokens, dt, info = run_engine(path, reqs)
    rows = [["sluice engine", len(reqs), tokens, dt, tokens / dt]]
    print(rows[-1], flush=True)
    rows += hf_rows(path, reqs, args)
    ours = tokens / dt
    body = table(["system", "requests", "output tokens", "seconds", "output tok/s", "sluice ×"],
                 [r + [ours / r[-1]] for r in rows])
    body += ("\n\nWorkload: random Llama ~125M (hidden 768, 12 layers, 12/4 heads, inter 2048, vocab "
             f"32000), bf16, {len(reqs)} requests, prompt U{shape[0]}, max_tokens U{shape[1]}, ignore_eos, "
             f"greedy, seed 0. Engine: {info['steps']} steps, KV utilization (tokens held / slots allocated "
             f"to running requests) mean {info['kv_util_mean']:.3f}, min {info['kv_util_min']:.3f}; peak "
             f"{info['peak_blocks']} blocks.")
    record("Mixed workload (engine vs HF static batching)" if args.mixed
           else "Throughput (engine vs Hugging Face)", body)


if __name__ == "__main__":
    main()
