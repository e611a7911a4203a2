"""Decode speed with and without speculation (draft model in bf16 and int8, n-gram) at batch sizes 1, 8, 32.

python bench/speculative.py [--target DIR --draft DIR] [--batch-sizes 1,8,32] [--max-tokens 64] [--rounds 3]

Every configuration is loaded once and the rounds interleave them, so a slow moment of the shared machine hits
all of them alike; each cell keeps its fastest round. Without --target: the bundled pair in models/ with the
demo's Shakespeare prompts, else the ~125M benchmark model with a draft made from its own first layers.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from common import ROOT, base_parser, bench_model, record, table, timed, workload
from safetensors.torch import load_file, save_file

from sluice.engine import LLM, SamplingParams
from sluice.engine.config import DEFAULT_DISABLE_BY_BATCH_SIZE

ALWAYS = 10_000  # disable_by_batch_size that keeps speculation on at every batch size


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


def text_prompts(tokenizer, vocab: int) -> list[list[int]]:
    """The demo's completion prompts (in-distribution for the bundled pair), else random token ids."""
    lines = (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()
    bodies = [json.loads(line)["body"] for line in lines]
    texts = [b["prompt"] for b in bodies if "prompt" in b]
    if len(tokenizer.get_vocab()) == vocab and texts:
        return [tokenizer.encode(t) for t in texts]
    return [p for p, _ in workload(64, seed=2, prompt_range=(8, 32), vocab=vocab)]


def copy_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """'Repeat the passage' prompts: a passage of several prompts, then its first 16 tokens again."""
    out = []
    for i in range(0, len(prompts) - 6, 6):
        passage = [t for p in prompts[i:i + 6] for t in p]
        out.append(passage + passage[:16])
    return out


def batch_of(prompts: list[list[int]], b: int, offset: int) -> list[list[int]]:
    return [prompts[(offset + i) % len(prompts)] for i in range(b)]


def run_cell(llm: LLM, prompts: list[list[int]], b: int,
             params: list[SamplingParams]) -> tuple[float, int, dict]:
    """Seconds and output tokens of decoding `prompts` b at a time (batch 1: four prompts one after
    another)."""
    groups = [batch_of(prompts, 1, i) for i in range(4)] if b == 1 else [batch_of(prompts, b, 0)]
    before = dict(llm.stats())
    seconds, tokens = 0.0, 0
    for group in groups:
        outs, dt = timed(lambda g=group: llm.generate(g, params[: len(g)], progress=False))
        seconds, tokens = seconds + dt, tokens + sum(len(o.token_ids) for o in outs)
    after = llm.stats()
    spec = {k: after.get(k, 0) - before.get(k, 0) for k in ("spec_proposed", "spec_accepted")}
    return seconds, tokens, spec


def sampling(kind: str, max_tokens: int, n: int) -> list[SamplingParams]:
    if kind == "sampled":
        return [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
                for i in range(n)]
    return [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)] * n


def parse_args():
    """The benchmark's command line."""
    p = base_parser(__doc__)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    return p.parse_args()


def target_and_draft(args) -> tuple[Path, Path]:
    """--target/--draft, else the bundled pair, else the benchmark model; a truncated draft where none is
    given."""
    bundled = ROOT / "models" / "sluice-tiny"
    if args.target:
        target, draft = Path(args.target), Path(args.draft) if args.draft else None
    elif (bundled / "config.json").is_file():
        target, draft = bundled, ROOT / "models" / "sluice-tiny-draft"
    else:
        target, draft = bench_model(), None
    return target, draft or truncated_draft(target, args.draft_layers)


def speculation_modes(draft: Path, k: int) -> dict[str, dict | None]:
    """Each configuration compared, by its row label: its `speculative` argument."""
    drafted = {"method": "draft", "model": str(draft), "num_speculative_tokens": k}
    return {
        "none": None,
        "draft bf16": drafted | {"disable_by_batch_size": ALWAYS},
        "draft int8_weight_only": drafted | {"quantization": "int8_weight_only",
                                             "disable_by_batch_size": ALWAYS},
        "draft int8_weight_only, default threshold": drafted | {"quantization": "int8_weight_only"},
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": ALWAYS},
    }


def fastest_rounds(llms: dict[str, LLM], workloads: dict[str, list[list[int]]], cells: list[tuple],
                   rounds: int, max_tokens: int) -> dict[tuple, tuple]:
    """Each (mode, workload, sampling, batch)'s fastest of `rounds` interleaved rounds (no draft on
    'copy')."""
    best: dict[tuple, tuple] = {}
    for _ in range(rounds):
        for cell in cells:
            w, kind, b = cell
            for mode, llm in llms.items():
                if mode.startswith("draft") and w == "copy":
                    continue
                got = run_cell(llm, workloads[w], b, sampling(kind, max_tokens, b))
                key = (mode, *cell)
                if key not in best or got[0] < best[key][0]:
                    best[key] = got
    return best


def result_rows(modes: list[str], cells: list[tuple], best: dict[tuple, tuple]) -> list[list]:
    """One table row per measured (mode, cell): speed, latency per token, speed-up over none, acceptance."""
    rows = []
    for mode in modes:
        for cell in cells:
            if (mode, *cell) not in best:
                continue
            seconds, tokens, spec = best[(mode, *cell)]
            base_seconds, base_tokens, _ = best[("none", *cell)]
            steps = tokens / cell[2]  # tokens per sequence
            prop = spec["spec_proposed"]
            rows.append([mode, cell[0], cell[1], cell[2], tokens / seconds, seconds / steps * 1000,
                         (tokens / seconds) / (base_tokens / base_seconds),
                         spec["spec_accepted"] / prop if prop else float("nan")])
    return rows


def report(rows: list[list], target: Path, draft: Path, args) -> str:
    """The recorded table and the paragraph saying how it was measured."""
    body = table(["speculation", "prompts", "sampling", "batch", "output tok/s",
                  "ms per token (each sequence)", "speed-up vs none", "acceptance"], rows)
    return body + (f"\n\nTarget `{target.name}`, draft `{draft.name}`, k={args.k}, {args.max_tokens} tokens "
                   f"per request (ignore_eos), {args.dtype} on CPU, best of {args.rounds} interleaved "
                   "rounds. 'text': the demo's completion prompts; 'copy': six of them joined, then the "
                   "passage's first 16 tokens again; 'sampled': temperature 0.8, a seed per request. Batch 1 "
                   "decodes four prompts one after another. 'default threshold' is the int8 draft as "
                   f"configured out of the box (disable_by_batch_size={DEFAULT_DISABLE_BY_BATCH_SIZE}): "
                   "above it a step runs without speculation. The other rows speculate at every batch size.")


def main() -> None:
    """Load every configuration once, time the interleaved rounds, record the table."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    target, draft = target_and_draft(args)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    modes = speculation_modes(draft, args.k)
    llms = {mode: LLM(str(target), dtype=args.dtype, device="cpu", speculative=spec)
            for mode, spec in modes.items()}
    tok = llms["none"].tokenizer
    text = text_prompts(tok, llms["none"].engine.model_config.vocab_size)
    workloads = {"text": text, "copy": copy_prompts(text)}
    cells = [(w, kind, b) for w in workloads for kind in ("greedy", "sampled") for b in sizes
             if kind == "greedy" or (w == "text" and b == 1)]
    for llm in llms.values():
        llm.generate(text[:2], SamplingParams(max_tokens=8, temperature=0), progress=False)
    best = fastest_rounds(llms, workloads, cells, args.rounds, args.max_tokens)
    record("Speculative decoding", report(result_rows(list(modes), cells, best), target, draft, args))


if __name__ == "__main__":
    main()
