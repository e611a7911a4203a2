"""The prebuilt kernel objects (kernels.cpp_build): compiled per tier with explicit flags into a folder with a
manifest, loaded with no compiler where the manifest matches the running torch, Python and sources, and built
here with a visible line where it does not. A one-line extension stands in for the kernels (seconds to build);
tests/test_wheel.py does the same with the real ones inside a wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sluice.kernels import cpp_build, cpu_isa

ROOT = Path(__file__).resolve().parent.parent
TINY = '#include <pybind11/pybind11.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.attr("ANSWER") = 42; }\n'
CHILD = """
import json, sys
from pathlib import Path
from sluice.kernels import cpp_build
cpp_build.CSRC, cpp_build.PREBUILT = Path(sys.argv[1]), Path(sys.argv[2])
ext = cpp_build.load("sluice_tiny", "tiny.cpp", "avx2")
print(json.dumps({"answer": ext.ANSWER, "file": ext.__file__, "compiler": cpp_build.compiler(),
                  "compiler_imported": "torch.utils.cpp_extension" in sys.modules}))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """A csrc/ folder with the one-line extension and its objects compiled for every tier (once per
    module)."""
    root = tmp_path_factory.mktemp("tiny")
    (root / "csrc").mkdir()
    (root / "csrc" / "tiny.cpp").write_text(TINY)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpp_build, "CSRC", root / "csrc")
        patch.setattr(cpp_build, "EXTENSIONS", {"tiny.cpp": "sluice_tiny"})
        cpp_build.compile_prebuilt(root / "prebuilt")
    return root


@pytest.fixture
def prebuilt(compiled, tmp_path, monkeypatch) -> tuple[Path, Path, dict]:
    """This test's copy of the csrc/ folder and of the compiled objects with their manifest."""
    for name in ("csrc", "prebuilt"):
        shutil.copytree(compiled / name, tmp_path / name)
    monkeypatch.setattr(cpp_build, "CSRC", tmp_path / "csrc")
    monkeypatch.setattr(cpp_build, "EXTENSIONS", {"tiny.cpp": "sluice_tiny"})
    folder = tmp_path / "prebuilt"
    return tmp_path / "csrc", folder, json.loads((folder / "manifest.json").read_text())


def _load(csrc: Path, folder: Path, cache: Path, **env: str) -> tuple[dict, str]:
    """Load the extension for the avx2 tier in a fresh process with `cache` as its kernel cache."""
    environ = {k: v for k, v in os.environ.items() if k not in ("CXX", "SLUICE_CPU_ISA")}
    environ |= {"XDG_CACHE_HOME": str(cache), "PYTHONSAFEPATH": "1", **env}
    result = subprocess.run([sys.executable, "-c", CHILD, csrc, folder], capture_output=True, text=True,
                            timeout=600, cwd=ROOT, env=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1]), result.stderr


def test_every_tier_gets_an_object_with_its_explicit_flags_and_a_manifest(prebuilt):
    """One object per tier (amx served by avx512_bf16: the source has no AMX code), each compiled with the
    tier's own flags, and a manifest of the torch, Python ABI and source hash."""
    _, folder, manifest = prebuilt
    assert [e["tier"] for e in manifest["objects"]] == ["avx2", "avx512", "avx512_bf16"]
    assert manifest["torch"] == torch.__version__ and manifest["python_abi"] == cpp_build.python_abi()
    for entry in manifest["objects"]:
        assert (folder / entry["file"]).is_file()
        assert entry["source_hash"] == cpp_build.source_hash("tiny.cpp")
        flags = cpu_isa.compile_flags(entry["tier"], frozenset({"avx512_vnni"}))
        assert entry["flags"] == cpp_build.BASE_CFLAGS + flags
    assert ("-mavx512bf16" in manifest["objects"][2]["flags"]
            and "-mavx512f" not in manifest["objects"][0]["flags"])


def test_a_matching_object_loads_with_no_compiler_and_compiles_nothing(prebuilt, tmp_path):
    csrc, folder, manifest = prebuilt
    got, err = _load(csrc, folder, tmp_path / "cache", CXX=str(tmp_path / "no-such-compiler"))
    assert got["answer"] == 42 and got["compiler"] is None and not got["compiler_imported"]
    assert got["file"] == str(folder / manifest["objects"][0]["file"])
    assert not (tmp_path / "cache").exists() and "compiling" not in err


@pytest.mark.parametrize("change", ["torch", "source", "flags"])
def test_a_mismatched_object_is_not_loaded_and_the_build_says_so(prebuilt, tmp_path, change):
    """Another torch in the manifest, an edited source, or other flags for the tier: the library builds into
    the cache, with a line naming it, the tier, the cache folder, about how long, and why the wheel's did not
    serve."""
    csrc, folder, manifest = prebuilt
    if change == "torch":
        manifest["torch"] = "2.0.0+cpu"
    elif change == "flags":
        manifest["objects"][0]["flags"] = manifest["objects"][0]["flags"][:-1]
    else:
        (csrc / "tiny.cpp").write_text(TINY + "// edited\n")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    cache = tmp_path / "cache"
    got, err = _load(csrc, folder, cache)
    root = cache / "sluice" / "kernels"
    assert got["answer"] == 42 and got["file"].startswith(str(root))
    why = {"torch": "for torch 2.0.0+cpu", "source": "sources differ", "flags": "avx2 flags differ"}[change]
    line = next(x for x in err.splitlines() if "compiling the C++ CPU kernels" in x)
    assert "sluice_tiny_avx2_" in line and "for the avx2 tier" in line and f"into {root}" in line
    assert "about a minute" in line and why in line
    assert "sluice: built sluice_tiny_avx2_" in err
