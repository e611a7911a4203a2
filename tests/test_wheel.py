"""The wheel as a user installs it: every kernel source inside, and beside the newest transformers and Hugging
Face's `kernels` in a fresh venv it generates on the C++ path, built from the installed copy, outside the tree."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "sluice", "engine", "kernels", "contract", "producer", "worker", "cli")
# The Python the wheel's venv runs on: the one running the tests (torch's CPU wheel on this disk is for it; a
# second version would pull torch's CUDA build, several GB, from the registry).
PYTHON = Path(getattr(sys, "_base_executable", sys.executable))

CHILD = """
import importlib, importlib.util, json, sys
from importlib.metadata import version
from pathlib import Path
hub_kernels = importlib.import_module("kernels")  # Hugging Face's distribution, not ours
import sluice.kernels
from sluice.kernels import cpp_build
from sluice import LLM, SamplingParams

ext = cpp_build.part("paged_attention")
assert ext is not None, "the C++ attention kernel did not build from the installed sources"
calls = []
attend = ext.paged_attention_cpu
ext.paged_attention_cpu = lambda *a: (calls.append(1), attend(*a))[1]
llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2)
out = llm.generate([sys.argv[2]], SamplingParams(max_tokens=8, temperature=0), progress=False)
print(json.dumps({
    "tokens": out[0].token_ids, "attention_calls": len(calls), "extension": ext.__file__,
    "sluice": str(Path(sluice.kernels.__file__).parent), "hub_kernels": hub_kernels.__file__,
    "hub_kernels_version": version("kernels"), "transformers": version("transformers"),
    "bare": {name: importlib.util.find_spec(name) is not None for name in ("engine", "worker", "producer", "contract", "cli")},
}))
"""


def _run(*cmd: str | Path, cwd: Path | None = None, env: dict | None = None) -> str:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, f"{cmd}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from a copy of the sources (the checkout stays free of build output)."""
    src, out = tmp_path_factory.mktemp("wheel-src"), tmp_path_factory.mktemp("wheel")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, src / name, **({"ignore": ignore} if (ROOT / name).is_dir() else {}))
    offline = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []  # 3.12+ venvs lack it
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *offline, "-w", out, src)
    (built,) = out.glob("sluice-*.whl")
    return built


def _venv_base() -> Path:
    """A venv with the wheel's dependencies, the newest transformers and `kernels`, cached in tmp per pyproject."""
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + str(PYTHON).encode()).hexdigest()[:12]
    venv = Path(tempfile.gettempdir()) / f"sluice-wheel-venv-{key}"
    if not (venv / ".ready").is_file():
        shutil.rmtree(venv, ignore_errors=True)
        _run(PYTHON, "-m", "venv", venv)
        pip = venv / "bin" / "pip"
        _run(pip, "install", "-q", f"torch=={torch.__version__.split('+')[0]}")
        deps = _dependencies()
        _run(pip, "install", "-q", "--upgrade", *deps, "transformers", "kernels")
        (venv / ".ready").touch()
    return venv


def _dependencies() -> list[str]:
    import tomllib

    return [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
            if not d.startswith(("torch", "transformers"))]


@pytest.fixture(scope="session")
def installed(wheel) -> Path:
    """The cached venv with this session's wheel installed over whatever an earlier one left."""
    venv = _venv_base()
    _run(venv / "bin" / "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel)
    return venv


def test_the_wheel_carries_every_kernel_source_and_header(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    csrc = sorted(p.name for p in (ROOT / "kernels" / "csrc").iterdir() if p.is_file())
    assert any(name.endswith(".h") for name in csrc) and any(name.endswith(".cpp") for name in csrc)
    assert [n for n in csrc if f"sluice/kernels/csrc/{n}" not in names] == []
    assert not any(n.split("/")[0] in ("engine", "kernels", "worker", "producer", "contract", "cli") for n in names)


@pytest.mark.timeout(3000)  # a fresh venv and C++ builds from the installed copy, on the first run
def test_installed_wheel_generates_on_the_cpp_kernels_beside_current_transformers(installed, tmp_path):
    """From a folder outside the checkout: the hub's `kernels` is importable as itself, our bare names are not,
    the attention kernel builds from the venv's copy of csrc/ and carries every attention call, and the greedy
    tokens are the ones this checkout's engine gives."""
    model = make_checkpoint(tmp_path / "tiny-llama", "llama")
    prompt = "to be or not to be"
    cache = installed / "kernel-cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TORCH_EXTENSIONS"))}
    env |= {"TORCH_EXTENSIONS_DIR": str(cache / "torch"), "XDG_CACHE_HOME": str(cache), "HF_HUB_OFFLINE": "1"}
    work = tmp_path / "elsewhere"
    work.mkdir()
    got = json.loads(_run(installed / "bin" / "python", "-c", CHILD, model, prompt, cwd=work, env=env).splitlines()[-1])
    site = str(installed)
    assert got["sluice"].startswith(site) and not got["sluice"].startswith(str(ROOT))
    assert got["hub_kernels"].startswith(site) and got["hub_kernels_version"]
    assert int(got["transformers"].split(".")[0]) >= 5
    assert got["bare"] == dict.fromkeys(("engine", "worker", "producer", "contract", "cli"), False)
    assert not got["extension"].startswith(str(ROOT)) and got["attention_calls"] > 0
    from sluice.engine import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2)
    ours = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), progress=False)
    assert got["tokens"] == ours[0].token_ids and len(got["tokens"]) == 8
