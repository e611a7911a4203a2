"""torch.compile of the decoder layers' MLP (inductor, dynamic shapes) against the eager engine, decode tok/s.

The MLP (gate_up, silu * up, down) is the part of a layer inductor can take whole: norms, rope, KV store and
attention are our C++ kernels, opaque to dynamo, so compiling a full layer only breaks the graph around each
of them. Same model, same process, interleaved rounds; eager is the reference path.

python bench/torch_compile.py [--batches 1,64] [--rounds 2]
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F
from common import base_parser, bench_model, record, table
from llamacpp import load, sluice


def mlp_torch(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, self.gate_up_proj.weight).chunk(2, -1)
    return F.linear(F.silu(gate) * up, self.down_proj.weight)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    llm = load(bench_model(), "bf16", batches)
    mlps = [layer.mlp for layer in llm.engine.runner.model.layers]
    eager = [m.forward for m in mlps]
    compiled = torch.compile(mlp_torch, dynamic=True)

    def use(fns) -> None:
        for m, fn in zip(mlps, fns, strict=True):
            m.forward = fn

    use([types.MethodType(compiled, m) for m in mlps])
    start = time.perf_counter()
    for b in batches:  # compiles (and warms) every shape class
        sluice(llm, b, seed=-2)
    compile_s = time.perf_counter() - start
    best = {(mode, b): 0.0 for mode in ("eager", "compiled") for b in batches}
    for r in range(args.rounds):
        for mode, fns in (("eager", eager), ("compiled", [types.MethodType(compiled, m) for m in mlps])):
            use(fns)
            for b in batches:
                best[mode, b] = max(best[mode, b], sluice(llm, b, seed=r))
        print(r, {k: round(v, 1) for k, v in best.items()}, flush=True)
    rows = [[b, best["eager", b], best["compiled", b], best["compiled", b] / best["eager", b]]
            for b in batches]
    body = table(["B", "eager tok/s", "compiled MLP tok/s", "compiled / eager"], rows)
    body += (f"\n\nDecode tok/s, bf16, B x 128 random prompt tokens, 128 generated, best of {args.rounds} "
             f"interleaved rounds. First calls of the compiled MLP (compilation) took {compile_s:.0f} s. "
             "Eager runs our bf16 GEMV at decode row counts and one fused silu * up pass; inductor's code "
             "replaces them with its own matmul calls and an elementwise kernel.")
    record("torch.compile of the MLP vs eager (decode tok/s)", body)


if __name__ == "__main__":
    main()
