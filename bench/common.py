"""Shared pieces of the benchmarks: the ~125M random Llama, the workload, the results table."""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import random
import shlex
import shutil
import subprocess
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


PACKAGES = ("engine", "kernels", "contract", "producer", "worker", "cli")


def host_cpu() -> str:
    """The host CPU's model name (/proc/cpuinfo), else what platform knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def baseline_tree(rev: str) -> str:
    """The `sluice` package of git revision `rev` as a folder to put first on PYTHONPATH (ahead of the
    editable install's finder): its tree checked out by `git archive` into a temporary folder (read-only on
    the repository; removed when this process exits), its package folders linked under sluice/ as the
    install maps them."""
    root = Path(tempfile.mkdtemp(prefix="sluice-baseline-"))
    atexit.register(shutil.rmtree, root, True)
    (root / "src").mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root / "src")], input=archive, check=True)
    package = root / "path" / "sluice"
    package.mkdir(parents=True)
    shutil.copy(root / "src" / "sluice" / "__init__.py", package)
    for folder in PACKAGES:
        (package / folder).symlink_to(root / "src" / folder)
    return str(root / "path")


def baseline_env(path: str = "") -> dict[str, str]:
    """This environment without PYTHON* variables (no checkout on the path), `path` on PYTHONPATH if given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return env | {"PYTHONPATH": path} if path else env


def without_baseline(argv: list[str]) -> list[str]:
    """argv less its `--baseline REV` (or `--baseline=REV`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--baseline":
            skip = True
        elif not arg.startswith("--baseline="):
            out.append(arg)
    return out


def run_baseline(rev: str, records: bool = True) -> None:
    """This benchmark's own command, run first on the code of git revision `rev` (printed, never recorded):
    the same script and arguments, with that revision's `sluice` package ahead on the child's path."""
    script, *args = without_baseline(sys.argv)
    cmd = [sys.executable, script, *args, *(["--no-record"] if records and "--no-record" not in args else [])]
    print(f"baseline {rev}: {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, env=baseline_env(baseline_tree(rev)), check=True)
    print(f"this checkout ({rev} above):", flush=True)


class BenchParser(argparse.ArgumentParser):
    """The benchmarks' parser: with `--baseline REV` the same command runs on REV's code first."""

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        """Parse; with --baseline REV, run this benchmark on REV's code before returning."""
        parsed = super().parse_args(args, namespace)
        if getattr(parsed, "baseline", ""):
            run_baseline(parsed.baseline, any("--no-record" in a.option_strings for a in self._actions))
        return parsed


def add_baseline(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """p with the `--baseline REV` flag (a BenchParser runs the baseline at parse time)."""
    p.add_argument("--baseline", default="", metavar="REV",
                   help="a git revision: run this same benchmark on its code first (printed, not recorded)")
    return p


def base_parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: requests, threads, --no-record and --baseline REV."""
    p = BenchParser(description=description)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--no-record", action="store_true", help="do not append to docs/benchmarks.md")
    return add_baseline(p)


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
    where = f"{stamp}, CPU: {host_cpu()}, {torch.get_num_threads()} threads"
    text = f"\n## {section}\n\n`{cmd}` ({where})\n\n{body}\n"
    print(text)
    if "--no-record" not in sys.argv:
        doc = ROOT / "docs" / "benchmarks.md"
        old = (doc.read_text() if doc.exists()
               else "# Benchmarks\n\nMeasured results; each section names the command that produced it.\n")
        doc.write_text(replace_section(old, section, text))


def replace_section(doc: str, section: str, text: str) -> str:
    """doc with its `## section` (up to the next `## ` heading) replaced by text, or text appended."""
    start = doc.find(f"\n## {section}\n")
    if start < 0:
        return doc.rstrip("\n") + "\n" + text
    end = doc.find("\n## ", start + 1)
    return doc[:start] + text.rstrip("\n") + "\n" + (doc[end:] if end >= 0 else "")
