"""Shared pieces of the benchmarks: the ~125M random Llama, the workload, the results table."""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its kernels/ folder must not shadow the kernels distribution

BENCH_CONFIG = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                    intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048)


def bench_model(path: Path | None = None, **overrides) -> Path:
    """Save the ~125M-parameter random Llama (bf16) with a small tokenizer; returns its folder."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from tests.checkpoints import build_tokenizer

    path = Path(path or Path(tempfile.gettempdir()) / "sluice-bench-125m")
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**BENCH_CONFIG, **overrides}, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                      initializer_range=0.05)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    GenerationConfig(bos_token_id=1, pad_token_id=0).save_pretrained(path)
    return path


def workload(n: int = 128, seed: int = 0, prompt_range=(32, 512), out_range=(16, 256), vocab: int = 32000):
    """n (prompt token ids, max_tokens) pairs drawn uniformly with a fixed seed."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        reqs.append(([rng.randrange(4, vocab) for _ in range(plen)], rng.randint(*out_range)))
    return reqs


def timed(fn):
    """(result, seconds) of fn()."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--no-record", action="store_true", help="do not append to docs/benchmarks.md")
    return p


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r) + " |")
    return "\n".join(lines)


def record(section: str, body: str) -> None:
    """Print a section, with the command that produced it, and put it in docs/benchmarks.md in place of the
    section of the same title (one current section per benchmark), or at the end when there is none."""
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"\n## {section}\n\n`{cmd}` ({stamp}, {torch.get_num_threads()} threads)\n\n{body}\n"
    print(text)
    if "--no-record" not in sys.argv:
        doc = ROOT / "docs" / "benchmarks.md"
        old = doc.read_text() if doc.exists() else "# Benchmarks\n\nMeasured results; each section names the command that produced it.\n"
        doc.write_text(replace_section(old, section, text))


def replace_section(doc: str, section: str, text: str) -> str:
    """doc with its `## section` (up to the next `## ` heading) replaced by text, or text appended."""
    start = doc.find(f"\n## {section}\n")
    if start < 0:
        return doc.rstrip("\n") + "\n" + text
    end = doc.find("\n## ", start + 1)
    return doc[:start] + text.rstrip("\n") + "\n" + (doc[end:] if end >= 0 else "")
