"""Decode speed with and without speculation (draft model, n-gram) at batch sizes 1, 8 and 32, one run.

python bench/speculative.py [--target DIR --draft DIR] [--batch-sizes 1,8,32] [--max-tokens 64]
Without --target: the bundled pair in models/ if present, else the ~125M benchmark model with a draft made
from its own first layers.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from common import ROOT, base_parser, bench_model, record, table, timed, workload
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams


def truncated_draft(target: Path, layers: int) -> Path:
    """A draft made of the target's embeddings, first `layers` decoder layers, final norm and head."""
    out = Path(tempfile.mkdtemp(prefix="sluice-draft-"))
    for f in target.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for f in target.glob("*.safetensors"):
        for name, t in load_file(f).items():
            parts = name.split(".")
            if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
                continue
            tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def copy_workload(tokenizer, n: int) -> list[list[int]]:
    """'Repeat the passage' prompts: the answer copies from the prompt, where n-gram lookup shines."""
    base = workload(n, seed=1, prompt_range=(48, 96), vocab=len(tokenizer))
    return [p + p[:16] for p, _ in base]


def measure(llm: LLM, prompts, max_tokens: int) -> tuple[float, float, dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), progress=False)
    before = dict(llm.stats())
    outs, dt = timed(lambda: llm.generate(prompts, params, progress=False))
    tokens = sum(len(o.token_ids) for o in outs)
    after = llm.stats()
    prop = after.get("spec_proposed", 0) - before.get("spec_proposed", 0)
    acc = after.get("spec_accepted", 0) - before.get("spec_accepted", 0)
    return tokens / dt, dt / max_tokens * 1000, {"acceptance": acc / prop if prop else float("nan")}


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bundled = ROOT / "models" / "sluice-tiny"
    if args.target:
        target, draft = Path(args.target), Path(args.draft) if args.draft else None
    elif (bundled / "config.json").is_file():
        target, draft = bundled, ROOT / "models" / "sluice-tiny-draft"
    else:
        target, draft = bench_model(), None
    draft = draft or truncated_draft(target, args.draft_layers)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    modes = {
        "none": None,
        "draft": {"method": "draft", "model": str(draft), "num_speculative_tokens": args.k,
                  "disable_by_batch_size": 10_000},
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "disable_by_batch_size": 10_000},
    }
    rows, base = [], {}
    for mode, spec in modes.items():
        llm = LLM(str(target), dtype=args.dtype, device="cpu", speculative=spec)
        for prompt_kind in ("random", "copy"):
            if prompt_kind == "copy" and mode == "draft":
                continue
            for b in sizes:
                if prompt_kind == "random":
                    prompts = [q for q, _ in workload(b, seed=2, prompt_range=(32, 128),
                                                       vocab=llm.engine.model_config.vocab_size)]
                else:
                    prompts = copy_workload(llm.tokenizer, b)
                tps, ms, info = measure(llm, prompts, args.max_tokens)
                key = (prompt_kind, b)
                if mode == "none":
                    base[key] = tps
                rows.append([mode, prompt_kind, b, tps, ms, tps / base[key], info["acceptance"]])
        del llm
    body = table(["speculation", "prompts", "batch", "output tok/s", "ms per step-token", "speed-up vs none",
                  "acceptance"], rows)
    body += (f"\n\nTarget `{target.name}`, draft `{draft}`, k={args.k}, greedy, {args.max_tokens} tokens per "
             f"request, {args.dtype} on CPU. 'copy' prompts end by repeating their own first 16 tokens.")
    record("Speculative decoding", body)


if __name__ == "__main__":
    main()
