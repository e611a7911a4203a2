"""Embeddings batch throughput: the engine (LLM.embed, one continuous batch) vs a sentence-transformers-style loop
(transformers AutoModel, inputs sorted by length as sentence-transformers' encode does, padded batches of --batch,
the same pooling) and a naive `model(**batch)` loop (the same, in input order), all in one run.

python bench/embeddings.py [--num-requests 256] [--batch 32] [--rounds 2] [--min-len 16] [--max-len 256]
Rounds alternate the two; the model is the ~125M random Llama of bench/common.py (bf16), pooled by mean (its
checkpoint has no sentence-transformers config); both sides get the same token ids."""

from __future__ import annotations

import time

import torch
from common import base_parser, bench_model, record, table, workload

from sluice.engine import LLM


def hf_loop(model, inputs: list[list[int]], batch: int, sort: bool = True) -> list[torch.Tensor]:
    """sentence-transformers' encode: sort by length (`sort`), pad each batch, model(**batch), masked mean,
    normalize."""
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i])) if sort else list(range(len(inputs)))
    out: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    with torch.inference_mode():
        for lo in range(0, len(order), batch):
            chunk = [inputs[i] for i in order[lo:lo + batch]]
            width = max(map(len, chunk))
            ids = torch.tensor([x + [0] * (width - len(x)) for x in chunk])
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in chunk])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            for i, vec in zip(order[lo:lo + batch], torch.nn.functional.normalize(pooled, dim=-1), strict=True):
                out[i] = vec
    return out


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModel

    path = bench_model()
    inputs = [ids for ids, _ in workload(args.num_requests, prompt_range=(args.min_len, args.max_len))]
    tokens = sum(map(len, inputs))
    hf = AutoModel.from_pretrained(path, dtype=torch.bfloat16).eval()
    llm = LLM(str(path), dtype="bfloat16", device="cpu", enable_prefix_caching=False)
    llm.embed(inputs[:4], progress=False)  # warm-up: kernels built, first-step set-up done
    hf_loop(hf, inputs[:4], args.batch)
    seconds = {"hf": 0.0, "naive": 0.0, "engine": 0.0}
    for _ in range(args.rounds):
        t = time.perf_counter()
        ours = [torch.tensor(o.embedding) for o in llm.embed(inputs, progress=False)]
        seconds["engine"] += time.perf_counter() - t
        t = time.perf_counter()
        theirs = hf_loop(hf, inputs, args.batch)
        seconds["hf"] += time.perf_counter() - t
        t = time.perf_counter()
        hf_loop(hf, inputs, args.batch, sort=False)
        seconds["naive"] += time.perf_counter() - t
    cos = min(float(torch.dot(a, b)) for a, b in zip(ours, theirs, strict=True))
    rate = {k: args.rounds * tokens / v for k, v in seconds.items()}
    names = {"hf": f"transformers AutoModel, sorted, padded batches of {args.batch} (sentence-transformers)",
             "naive": f"transformers AutoModel, input order, padded batches of {args.batch} (naive loop)",
             "engine": "sluice LLM.embed (one continuous batch)"}
    rows = [[names[k], args.num_requests, tokens, rate[k], args.rounds * args.num_requests / seconds[k],
             rate[k] / rate["hf"]] for k in seconds]
    body = table(["path", "inputs", "tokens", "tokens/s", "inputs/s", "vs sentence-transformers-style"], rows)
    body += f"\n\nLowest cosine between the two sides' embeddings: {cos:.5f} (bf16 both)."
    record(f"Embeddings: batch throughput vs a sentence-transformers-style loop ({args.min_len}-{args.max_len} "
           f"tokens, CPU, bf16)", body)


if __name__ == "__main__":
    main()
