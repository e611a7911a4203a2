"""CPU decode attention over the paged KV cache: our kernel against torch's (gather the blocks, then SDPA).

python bench/attention_speed.py [--batches 8,64] [--contexts 192,1024] [--layers 12]

One query token per sequence (a decode step), the bench model's heads (12 query, 4 kv, head dim 64), each of
`--layers` layers with its own pool so that the step's keys and values stream from memory as in the engine;
blocks of 16 positions handed out in random order. A bf16 cache and an int8 one (fp16 scales per position and
kv head). Median of interleaved passes over every layer.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from common import base_parser, record, table

from sluice.kernels import cpu_attention

H, HK, D, BLOCK = 12, 4, 64, 16


def pools(batch: int, ctx: int, layers: int, int8: bool):
    """Per layer (k, v, k_scale, v_scale); the block tables [batch, blocks a sequence]."""
    width = -(-ctx // BLOCK)
    blocks = batch * width
    tables = torch.randperm(blocks).view(batch, width).contiguous()
    shape = (HK, blocks, BLOCK, D)
    out = []
    for _ in range(layers):
        if int8:
            k, v = (torch.randint(-127, 128, shape, dtype=torch.int8) for _ in range(2))
            ks, vs = (torch.rand(shape[:3]).half() * 0.02 for _ in range(2))
        else:
            k, v = (torch.randn(shape, dtype=torch.bfloat16) for _ in range(2))
            ks = vs = None
        out.append((k, v, ks, vs))
    return out, tables


def ours(q, layer, tables, ctx, out):
    k, v, ks, vs = layer
    batch = q.shape[0]
    cpu_attention.paged_attention_cpu(q, k, v, out, torch.arange(batch), torch.ones(batch, dtype=torch.long),
                                      torch.full((batch,), ctx), tables, D ** -0.5, ks, vs)


def theirs(q, layer, tables, ctx, out):
    """Each sequence's blocks gathered into [B, HK, ctx, D] (dequantized for int8), then SDPA with GQA."""
    k, v, ks, vs = layer

    def gather(c, s):
        rows = c[:, tables].flatten(2, 3)[:, :, :ctx]  # [HK, B, ctx, D]
        if s is not None:
            rows = (rows.float() * s[:, tables].flatten(2, 3)[:, :, :ctx, None].float()).to(q.dtype)
        return rows.transpose(0, 1)

    y = F.scaled_dot_product_attention(q[:, :, None], gather(k, ks), gather(v, vs), enable_gqa=True)
    out.copy_(y[:, :, 0])


def timed_passes(layers: list, tables: torch.Tensor, batch: int, ctx: int, passes: int) -> tuple[dict, dict]:
    """Each attention's outputs and its per-pass times in ms over every layer, the two interleaved per
    pass."""
    q = torch.randn(batch, H, D, dtype=torch.bfloat16)
    outs = {fn: torch.empty_like(q) for fn in (ours, theirs)}
    ms: dict = {fn: [] for fn in outs}
    for i in range(passes + 1):
        for fn, out in outs.items():
            t = time.perf_counter()
            for layer in layers:
                fn(q, layer, tables, ctx, out)
            if i:  # the first pass warms up
                ms[fn].append((time.perf_counter() - t) * 1e3)
    return outs, ms


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--batches", default="8,64")
    p.add_argument("--contexts", default="192,1024")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--passes", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for cache in ("bf16", "int8"):
        for batch in (int(b) for b in args.batches.split(",")):
            for ctx in (int(c) for c in args.contexts.split(",")):
                layers, tables = pools(batch, ctx, args.layers, cache == "int8")
                outs, ms = timed_passes(layers, tables, batch, ctx, args.passes)
                err = (outs[ours].float() - outs[theirs].float()).abs().max().item()
                mine, ref = statistics.median(ms[ours]), statistics.median(ms[theirs])
                kv = sum(t.numel() * t.element_size() for layer in layers for t in layer if t is not None)
                kv *= batch * ctx / (tables.numel() * BLOCK)
                rows.append([cache, batch, ctx, ref, mine, ref / mine, kv / mine / 1e6, err])
                print(rows[-1], flush=True)
                del layers
    headers = ["cache", "B", "context", "torch (gather + SDPA) ms", "ours ms", "ours ×", "ours KV GB/s",
               "max |diff|"]
    body = table(headers, rows) + (
        f"\n\nOne decode token per sequence over {args.layers} layers' caches (each its own pool, blocks in "
        f"random order), {H} query / {HK} kv heads of {D}; median of {args.passes} interleaved passes. KV "
        "GB/s: the keys, values and scales the step reads over our time.")
    if not args.no_record:
        record("Decode attention over the paged KV cache (CPU)", body)
    else:
        print(body)


if __name__ == "__main__":
    main()
