"""One decode step of the bench's Llama (batch 32), native forward vs generic path, replayed: where the
generic path's extra time goes on CPU (bf16, one thread, process CPU time).

python bench/generic_step.py [--batch 32] [--rounds 5] [--parts]

Captures the model call of one decode step of each engine (batch `--batch`, after 20 generated tokens) and
replays it, the systems alternated `--rounds` times (median): native, generic, and generic with transformers'
own forwards put back where `use_our_kernels` fused a decoder layer, an attention or a rotary slot ("generic,
transformers' forwards"). `--parts`: each system's time per step inside its decoder layers, attention, MLP and
linears (timers around module forwards: they add their own small cost to both).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path

import torch
from architectures import checkpoint, prompts

from sluice.engine import LLM, SamplingParams
from sluice.engine.models import forced_generic
from sluice.engine.models import generic as generic_module


def engine(path: Path, generic: bool, transformers_forwards: bool = False) -> LLM:
    """An engine on `path`, forced onto the generic path if asked, with transformers' forwards put back if
    asked."""
    if not generic:
        return LLM(str(path), dtype="bfloat16", device="cpu")
    with forced_generic():
        llm = LLM(str(path), dtype="bfloat16", device="cpu")
    for mod in llm.engine.model.hf.modules() if transformers_forwards else ():
        if type(mod).__name__.endswith(("DecoderLayer", "Attention")):
            generic_module.restore_forward(mod)
        slot = (vars(mod).get("_kernel_funcs") or {}).get(generic_module.ROPE_SLOT)
        if slot is not None:
            generic_module.restore_forward(slot)
    return llm


def capture(llm: LLM, batch: int, length: int, tokens: int = 20) -> tuple:
    """(model, args, kwargs) of the last model call of a `batch` x `tokens` greedy run."""
    model, calls = llm.engine.model, []
    forward = model.forward
    model.forward = lambda *a, **k: calls.append((a, k)) or forward(*a, **k)
    llm.generate(prompts(batch, length), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                 progress=False)
    del model.forward
    return model, *calls[-1]


def step_us(model, args, kwargs, n: int = 100) -> float:
    """CPU microseconds per replayed call."""
    with torch.inference_mode():
        for _ in range(5):
            model(*args, **kwargs)
        t = time.process_time()
        for _ in range(n):
            model(*args, **kwargs)
    return (time.process_time() - t) / n * 1e6


def timers(systems: dict) -> dict[str, float]:
    """Wrap the parts of every system's model with CPU timers; returns their totals (seconds), filled as they
    run."""
    acc: dict[str, float] = collections.defaultdict(float)

    def wrap(mod, name):
        forward = mod.forward

        def timed(*a, **k):
            t = time.process_time()
            out = forward(*a, **k)
            acc[name] += time.process_time() - t
            return out
        mod.forward = timed

    for label, (model, _, _) in systems.items():
        layers = model.hf.model.layers if hasattr(model, "hf") else model.layers
        for layer in layers:
            for part, mod in (("layers", layer), ("attention", layer.self_attn), ("MLP", layer.mlp),
                              ("o_proj", layer.self_attn.o_proj), ("down_proj", layer.mlp.down_proj)):
                wrap(mod, f"{label}: {part}")
        wrap(model, f"{label}: whole step")
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--parts", action="store_true",
                   help="time per part of the step instead of the alternated runs")
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "sluice-bench-archs")
    a = p.parse_args()
    torch.set_num_threads(1)
    path = checkpoint("llama", a.root)
    systems = {label: capture(engine(path, *flags), a.batch, a.prompt) for label, flags in
               (("native", (False,)), ("generic", (True,)),
                ("generic, transformers' forwards", (True, True)))}
    acc = timers(systems) if a.parts else None
    runs: dict[str, list[float]] = {label: [] for label in systems}
    for _ in range(a.rounds):
        for label, call in systems.items():
            runs[label].append(step_us(*call))
    if acc is not None:
        for name in sorted(acc):
            print(f"{name:48s} {acc[name] / (a.rounds * 105) * 1e6:7.0f} us/step")
        return
    native = statistics.median(runs["native"])
    for label, us in runs.items():
        print(f"{label:34s} {statistics.median(us):6.0f} us/step ({native / statistics.median(us):.2f}x "
              "native speed)")


if __name__ == "__main__":
    main()
