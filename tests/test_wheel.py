"""The wheel as a user installs it: every kernel source inside and one prebuilt object per CPU tier with its
manifest; in a fresh venv beside the newest transformers and Hugging Face's `kernels` it generates on the
prebuilt C++ kernels with no compiler at all, and where the manifest does not match it builds them from the
installed copy, outside the tree, saying so.

The wheel build compiles every kernel library for every tier: it runs once per state of the sources (kept in
tmp), and `pytest --durations` shows its cost on the first test that asks for the wheel."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import torch

from sluice.kernels import cpp_build, cpu_isa
from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "setup.py", "build_backend", "MANIFEST.in", "README.md", "sluice", "engine",
           "kernels", "contract", "producer", "worker", "cli")
# The Python the wheel's venv runs on: the one running the tests (torch's CPU wheel on this disk is for it; a
# second version would pull torch's CUDA build, several GB, from the registry).
PYTHON = Path(getattr(sys, "_base_executable", sys.executable))

TINY = ROOT / "models" / "sluice-tiny"
# the first test builds the wheel (seven compiles; on a loaded 2-core host longer than the suite's default
# limit)
pytestmark = pytest.mark.timeout(5400)
PY = f"{sys.version_info.major}{sys.version_info.minor}"
TAG = f"-cp{PY}-cp{PY}-linux_x86_64.whl"
MANIFEST = "sluice/kernels/prebuilt/manifest.json"

CHILD = """
import importlib, importlib.util, json, sys
from importlib.metadata import version
from pathlib import Path
hub_kernels = importlib.import_module("kernels")  # Hugging Face's distribution, not ours
import sluice.kernels
from sluice.kernels import cpp_build
from sluice import LLM, SamplingParams
if len(sys.argv) > 3:
    cpp_build.PREBUILT = Path(sys.argv[3])  # the wheel's objects with another manifest

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
    "bare": {name: importlib.util.find_spec(name) is not None
             for name in ("engine", "worker", "producer", "contract", "cli")},
}))
"""


def _run(*cmd: str | Path, cwd: Path | None = None, env: dict | None = None) -> str:
    return _run_both(*cmd, cwd=cwd, env=env)[0]


def _run_both(*cmd: str | Path, cwd: Path | None = None, env: dict | None = None) -> tuple[str, str]:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=2400)
    assert result.returncode == 0, f"{cmd}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout, result.stderr


@pytest.fixture(scope="session")
def wheel() -> Path:
    """The wheel `pip wheel` builds from a copy of the sources (the checkout stays free of build output), kept
    in tmp per source tree, torch and Python: it compiles every kernel library for every tier, so it is built
    once per change of the sources, never twice for the same ones."""
    cache = Path(tempfile.gettempdir()) / f"sluice-wheel-{_sources_key()}"
    found = sorted(cache.glob("sluice-*.whl"))
    if found:
        return found[0]
    work = Path(tempfile.mkdtemp(prefix=f"{cache.name}.tmp", dir=cache.parent))
    src, out = work / "src", work / "wheel"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, src / name, **({"ignore": IGNORE} if (ROOT / name).is_dir() else {}))
    # this venv's setuptools and torch build it (an isolated build would install torch first); 3.12+ venvs and
    # setuptools before 70.1 (no bdist_wheel of its own) take the isolated build
    offline = ["--no-build-isolation"] if _setuptools_builds_wheels() else []
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *offline, "-w", out, src)
    (built,) = out.glob("sluice-*.whl")
    cache.mkdir(exist_ok=True)
    os.replace(built, cache / built.name)  # whole or not at all
    shutil.rmtree(work, ignore_errors=True)
    return cache / built.name


IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


def _sources_key() -> str:
    """A hash of every file the wheel is built from (as the copy takes them), torch's version and Python's."""
    digest = hashlib.sha256(f"{torch.__version__}\0{sys.version}".encode())
    for name in SOURCES:
        path = ROOT / name
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for f in files:
            parts = f.relative_to(ROOT).parts
            if f.is_file() and not any(p in ("__pycache__", "build") or p.endswith((".pyc", ".egg-info"))
                                       for p in parts):
                digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def _setuptools_builds_wheels() -> bool:
    """Whether this venv's setuptools (70.1 on) builds a wheel by itself."""
    try:
        return tuple(int(x) for x in metadata.version("setuptools").split(".")[:2]) >= (70, 1)
    except metadata.PackageNotFoundError:
        return False


def _venv_base() -> Path:
    """A venv with the wheel's dependencies, the newest transformers and `kernels`, cached in tmp per
    pyproject."""
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
    assert not any(n.split("/")[0] in ("engine", "kernels", "worker", "producer", "contract", "cli")
                   for n in names)


def test_the_wheel_carries_one_prebuilt_object_per_tier_and_a_manifest(wheel):
    """A platform wheel for this Python; per library and tier an object built with the tier's explicit flags
    (amx served by avx512_bf16 where the library has no AMX code), and a manifest naming the torch, Python ABI
    and sources they were built from."""
    assert wheel.name.endswith(TAG), wheel.name
    archive = zipfile.ZipFile(wheel)
    manifest = json.loads(archive.read(MANIFEST))
    assert manifest["torch"] == torch.__version__ and manifest["python_abi"] == cpp_build.python_abi()
    objects = {(e["name"], e["tier"]): e for e in manifest["objects"]}
    assert len(objects) == len(manifest["objects"]) == len(cpp_build.prebuilt_objects())
    digests = set()
    for source, name in cpp_build.EXTENSIONS.items():
        for tier in cpu_isa.TIERS:
            entry = objects[name, cpp_build.object_tier(tier, source)]
            assert entry["source_hash"] == cpp_build.source_hash(source)
            assert entry["flags"] == cpp_build.prebuilt_flags(entry["tier"])
            assert (set(cpu_isa.TIER_FLAGS[entry["tier"]]) <= set(entry["flags"])
                    and "-march=native" not in entry["flags"])
            blob = archive.read(f"sluice/kernels/prebuilt/{entry['file']}")
            assert blob[:4] == b"\x7fELF" and entry["file"].startswith(f"{entry['tier']}/")
            digests.add(hashlib.sha256(blob).hexdigest())
    assert len(digests) == len(objects)  # each tier its own code
    assert ("sluice_moe_cpu", "amx") in objects and "-mamx-tile" in objects["sluice_moe_cpu", "amx"]["flags"]


def _env(cache: Path, **extra: str) -> dict[str, str]:
    """The environment of a process in the wheel's venv: nothing of this checkout's, `cache` as the kernel
    cache."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TORCH_EXTENSIONS"))}
    return env | {"TORCH_EXTENSIONS_DIR": str(cache / "torch"), "XDG_CACHE_HOME": str(cache),
                  "HF_HUB_OFFLINE": "1", **extra}


PREBUILT_CHILD = """
import json, sys
from sluice import LLM, SamplingParams
from sluice.kernels import cpp_build, cpu_isa
llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2)
out = llm.generate([sys.argv[2]], SamplingParams(max_tokens=8, temperature=0), progress=False)
core = cpp_build.load(cpp_build.EXTENSIONS[cpp_build.CORE], cpp_build.CORE)
print(json.dumps({"tokens": out[0].token_ids, "compiler": cpp_build.compiler(), "core": core.__file__,
                  "prebuilt": str(cpp_build.PREBUILT), "tier": cpu_isa.tier(),
                  "compiler_imported": "torch.utils.cpp_extension" in sys.modules}))
"""


def test_installed_wheel_generates_on_its_prebuilt_kernels_with_no_compiler(installed, tmp_path):
    """With CXX naming no compiler and an empty kernel cache, the first generate on the bundled model loads
    the wheel's object for this CPU's tier, compiles nothing (no compiler, no torch cpp_extension, nothing
    cached), `sluice doctor` says "prebuilt (wheel)" for every library, and the tokens are this checkout's."""
    cache = tmp_path / "cache"
    env = _env(cache, CXX=str(tmp_path / "no-such-compiler"))
    work = tmp_path / "elsewhere"
    work.mkdir()
    prompt = "O Romeo, Romeo"
    out = _run(installed / "bin" / "python", "-c", PREBUILT_CHILD, TINY, prompt, cwd=work, env=env)
    got = json.loads(out.splitlines()[-1])
    assert got["compiler"] is None and not got["compiler_imported"]
    tier = cpp_build.object_tier(got["tier"], cpp_build.CORE)
    assert (got["core"].startswith(str(Path(got["prebuilt"]) / tier))
            and got["prebuilt"].startswith(str(installed)))
    assert not any(cache.rglob("*.so"))
    doctor = json.loads(_run(installed / "bin" / "sluice", "doctor", "--json", cwd=work, env=env))
    assert doctor["compiler"] is None and doctor["tier"] == got["tier"]
    assert [k["origin"] for k in doctor["kernels"]] == ["prebuilt (wheel)"] * len(cpp_build.EXTENSIONS)
    assert all(k["path"].startswith(got["prebuilt"]) for k in doctor["kernels"])
    from sluice.engine import LLM, SamplingParams

    llm = LLM(str(TINY), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2)
    ours = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), progress=False)
    assert got["tokens"] == ours[0].token_ids and len(got["tokens"]) == 8


def test_installed_wheel_with_a_mismatched_manifest_builds_visibly_beside_current_transformers(
    installed, tmp_path):
    """From a folder outside the checkout, the wheel's objects with another torch in their manifest: the hub's
    `kernels` is importable as itself, our bare names are not, the attention kernel builds from the venv's
    copy of csrc/ into the kernel cache with a line saying so (tier, where, about how long, why), carries
    every attention call, and the greedy tokens are the ones this checkout's engine gives."""
    model = make_checkpoint(tmp_path / "tiny-llama", "llama")
    prompt = "to be or not to be"
    site = next(installed.glob("lib/python*/site-packages"))
    mismatched = tmp_path / "prebuilt"
    shutil.copytree(site / "sluice" / "kernels" / "prebuilt", mismatched)
    manifest = json.loads((mismatched / "manifest.json").read_text())
    (mismatched / "manifest.json").write_text(json.dumps(manifest | {"torch": "2.0.0+cpu"}))
    cache = tmp_path / "kernel-cache"
    work = tmp_path / "elsewhere"
    work.mkdir()
    out, err = _run_both(installed / "bin" / "python", "-c", CHILD, model, prompt, mismatched, cwd=work,
                         env=_env(cache))
    got = json.loads(out.splitlines()[-1])
    tier = cpp_build.object_tier(cpu_isa.tier(), cpp_build.CORE)
    root = cache / "sluice" / "kernels"
    assert (f"compiling the C++ CPU kernels sluice_cpu_kernels_{tier}_" in err
            and f"for the {tier} tier" in err)
    assert f"into {root}" in err and "about a minute" in err and "torch 2.0.0+cpu" in err
    assert got["extension"].startswith(str(root)), got["extension"]
    assert got["sluice"].startswith(str(installed)) and not got["sluice"].startswith(str(ROOT))
    assert got["hub_kernels"].startswith(str(installed)) and got["hub_kernels_version"]
    assert int(got["transformers"].split(".")[0]) >= 5
    assert got["bare"] == dict.fromkeys(("engine", "worker", "producer", "contract", "cli"), False)
    assert got["attention_calls"] > 0
    from sluice.engine import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2)
    ours = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), progress=False)
    assert got["tokens"] == ours[0].token_ids and len(got["tokens"]) == 8
