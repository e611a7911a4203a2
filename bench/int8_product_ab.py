"""The int8 x int8 -> int32 product of the dynamic int8 path, two builds of csrc/ in one process, alternated.

python bench/int8_product_ab.py --old-csrc DIR [--rows 1,2,8,32,64] [--rounds 31] [--passes 2] [--threads N]

Loads this checkout's csrc/quant_linear.cpp and another csrc/ folder's (DIR, e.g. a `git archive` of an older
commit) as two extensions and times `int8_mm` over the bench model's 48 decoder linears (int8 weights, 75 MB,
read from memory each pass) at each row count, the two builds alternating every `--passes` passes (the order
flipped every round), so both see the same host; the median block is the measure (a shared host's stalls land
in a few blocks). A build whose `int8_mm` takes a per-row `comp` (the kernels
before the product without it) gets `int8_vnni_comp(w)` computed once, as its linears kept it. Prints the
median ms of a pass for each and old / new; both must give the same exact sums (checked first).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from sluice.kernels import cpp_build

LINEARS = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12  # qkv, o, gate_up, down of 12 layers


def builds(old_csrc: Path):
    """(old, new) extensions of quant_linear.cpp."""
    new = cpp_build.build("sluice_quant_linear_cpu", "quant_linear.cpp")
    here = cpp_build.CSRC
    cpp_build.CSRC = old_csrc
    try:
        old = cpp_build.build("sluice_quant_linear_cpu", "quant_linear.cpp")
    finally:
        cpp_build.CSRC = here
    return old, new


def product(ext, weights: list[torch.Tensor]):
    """A pass over every linear for x rows (a dict by in_features), as the build's linears call it."""
    if hasattr(ext, "int8_vnni_comp"):
        comps = [ext.int8_vnni_comp(w) for w in weights]
        return lambda xs: [ext.int8_mm(xs[w.shape[1]], w, c) for w, c in zip(weights, comps, strict=True)]
    return lambda xs: [ext.int8_mm(xs[w.shape[1]], w) for w in weights]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-csrc", type=Path, required=True)
    p.add_argument("--rows", default="1,2,8,32,64")
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--passes", type=int, default=2, help="passes per timed block")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    old, new = builds(args.old_csrc)
    torch.manual_seed(0)
    weights = [torch.randint(-128, 128, s, dtype=torch.int8) for s in LINEARS]
    runs = {"old": product(old, weights), "new": product(new, weights)}
    print("| rows | old ms | new ms | old / new |\n|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randint(-128, 128, (m, k), dtype=torch.int8) for k in (768, 2048)}
        for a, b in zip(runs["old"](xs), runs["new"](xs), strict=True):
            assert torch.equal(a, b), "the builds disagree"
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                t = time.perf_counter()
                for _ in range(args.passes):
                    runs[name](xs)
                times[name].append((time.perf_counter() - t) / args.passes * 1e3)
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"| {m} | {o:.2f} | {n:.2f} | {o / n:.3f} |", flush=True)


if __name__ == "__main__":
    main()
