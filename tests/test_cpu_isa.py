"""The CPU ISA tiers (kernels.cpu_isa), the per-tier kernel cache (kernels.cpp_build) and `sluice doctor`."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice.cli.main import app
from sluice.kernels import cpp_build, cpu_isa, options

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})  # Zen 2
SKYLAKE = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ICELAKE = SKYLAKE | {"avx512_vnni"}
ZEN4 = ICELAKE | {"avx512_bf16"}
SAPPHIRE = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
TINY = '#include <pybind11/pybind11.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.attr("ANSWER") = 42; }\n'


@pytest.fixture
def tier_env(monkeypatch, request):
    """Set SLUICE_CPU_ISA (or unset it with None) for one test, the chosen tier read again before and
    after."""
    def set_cap(value: str | None) -> str:
        if value is None:
            monkeypatch.delenv(cpu_isa.ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_isa.ENV, value)
        cpu_isa.reset()
        return cpu_isa.tier()

    request.addfinalizer(cpu_isa.reset)
    return set_cap


@pytest.mark.parametrize(("flags", "want"), [(frozenset({"sse4_2", "avx"}), "generic"), (AVX2, "avx2"),
                                             (SKYLAKE, "avx512"), (ICELAKE, "avx512"), (ZEN4, "avx512_bf16"),
                                             (SAPPHIRE, "amx"), (AVX2 - {"fma"}, "generic"),
                                             (ZEN4 - {"avx512_vnni"}, "avx512")])
def test_the_tier_is_the_highest_whose_flags_the_cpu_has(flags, want):
    assert cpu_isa.host_tier(flags) == want


def test_a_flag_the_cpu_does_not_report_by_cpuid_is_not_used():
    assert cpu_isa.confirmed(SAPPHIRE, AVX2) == AVX2  # a masked or emulated CPU: its CPUID is believed
    assert cpu_isa.confirmed(ZEN4, SAPPHIRE) == ZEN4  # CPUID never adds what the kernel did not enable
    assert cpu_isa.confirmed(SKYLAKE, None) == SKYLAKE


EMULATED_PROBE = """
import json, torch
from sluice.kernels import cpu_isa, linear
x = torch.randn(4, 256).to(torch.bfloat16)
w = (torch.randn(96, 256) / 16).to(torch.bfloat16)
got, want = linear.linear(x, w).float(), x.float() @ w.float().T
print(json.dumps({"tier": cpu_isa.tier(), "kernels": linear.gemv_serves(4, 256) and linear.gemv_available(),
                  "err": ((got - want).abs().max() / want.abs().max()).item()}))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates an x86-64 CPU on an x86-64 host")
def test_an_avx2_only_cpu_gets_the_avx2_tier_and_runs_its_kernels(tmp_path):
    """Under QEMU's Haswell (AVX2, no AVX-512) on whatever host this is: the tier comes from what the CPU
    reports, and the C++ kernels built for it run; an instruction above AVX2 would kill the process
    (SIGILL)."""
    qemu = shutil.which("qemu-x86_64")
    assert qemu, "qemu-x86_64 not found: apt-get install qemu-user (.ci/run installs it)"
    env = {k: v for k, v in os.environ.items() if k != cpu_isa.ENV}
    done = subprocess.run([qemu, "-cpu", "Haswell", sys.executable, "-c", EMULATED_PROBE], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["tier"] == "avx2" and seen["kernels"] is True
    assert seen["err"] < 2e-2


def test_sluice_cpu_isa_caps_the_tier_and_never_raises_it(tier_env):
    host = cpu_isa.host_tier()
    assert cpu_isa.cap("amx", "avx2") == "avx2" and cpu_isa.cap("avx2", "amx") == "avx2"
    assert cpu_isa.cap("avx512_bf16", None) == "avx512_bf16" and cpu_isa.cap("generic", "avx2") == "generic"
    with pytest.raises(ValueError, match="SLUICE_CPU_ISA"):
        cpu_isa.cap("amx", "avx9")
    assert tier_env(None) == host
    for name in cpu_isa.TIERS:
        assert tier_env(name) == cpu_isa.cap(host, name)
        assert cpu_isa.runnable_tiers() == ([] if host == "generic" else
                                            list(cpu_isa.TIERS[: cpu_isa.TIERS.index(cpu_isa.tier()) + 1]))
    if host != "generic":
        assert tier_env("avx2") == "avx2" and not cpu_isa.at_least("avx512")


def test_each_tier_compiles_with_its_own_explicit_flags():
    """Never -march=native; the avx2 tier names no AVX-512 flag; VNNI joins the avx512 tier only where
    present."""
    for name in cpu_isa.TIERS:
        flags = cpp_build.BASE_CFLAGS + cpu_isa.compile_flags(name, SAPPHIRE)
        assert not any(f.startswith(("-march", "-mtune=native")) for f in flags)
    assert not any("avx512" in f or "amx" in f for f in cpu_isa.compile_flags("avx2", SAPPHIRE))
    assert "-mavx512vnni" not in cpu_isa.compile_flags("avx512", SKYLAKE)
    assert "-mavx512vnni" in cpu_isa.compile_flags("avx512", ICELAKE)
    assert "-mavx512bf16" in cpu_isa.compile_flags("avx512_bf16", ZEN4)
    assert "-mavx512bf16" not in cpu_isa.compile_flags("avx512", ZEN4)
    assert cpu_isa.compile_flags("generic") == []


def test_the_cache_key_differs_per_tier_and_lives_in_the_user_cache(tmp_path, monkeypatch):
    """One object per tier, except amx, which takes the avx512_bf16 object while no source has AMX code."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    options.reset()
    paths = {t: cpp_build.library_path("sluice_rms_norm_cpu", "rms_norm.cpp", t) for t in cpu_isa.TIERS}
    assert len(set(paths.values())) == len(cpu_isa.TIERS) - 1 and paths["amx"] == paths["avx512_bf16"]
    assert all(p.is_relative_to(tmp_path / "sluice" / "kernels") for p in paths.values())
    assert all(f"_{t}_" in paths[t].name for t in ("avx2", "avx512", "avx512_bf16"))
    monkeypatch.setenv("CXX", "a-compiler-that-is-not-there")
    options.reset()
    assert cpp_build.library_path("sluice_rms_norm_cpu", "rms_norm.cpp", "avx2") != paths["avx2"]
    (tmp_path / "amx.cpp").write_text("// uses __AMX_TILE__ intrinsics\n")
    monkeypatch.setattr(cpp_build, "CSRC", tmp_path)
    assert cpp_build.object_tier("amx", "amx.cpp") == "amx"


def test_build_name_follows_the_local_files_a_source_includes(tmp_path, monkeypatch):
    """Editing a file that a source includes, at any depth, renames (so rebuilds) the source's extension."""
    (tmp_path / "a.cpp").write_text('#include "b.cpp"\n#include <vector>\n')
    (tmp_path / "b.cpp").write_text('#include "c.h"\n')
    (tmp_path / "c.h").write_text("int x;\n")
    monkeypatch.setattr(cpp_build, "CSRC", tmp_path)
    before = cpp_build.build_name("a", "a.cpp", "avx2")
    (tmp_path / "c.h").write_text("int y;\n")
    assert cpp_build.build_name("a", "a.cpp", "avx2") != before


BUILD_SCRIPT = """
import sys
from pathlib import Path
from sluice.kernels import cpp_build
cpp_build.CSRC = Path(sys.argv[1])
real = cpp_build._build
cpp_build._build = lambda *a: print("BUILT", flush=True) or real(*a)
ext = cpp_build.load("sluice_tiny", "tiny.cpp", "avx2")
print("ANSWER", ext.ANSWER, flush=True)
"""


def test_workers_starting_together_build_once_and_all_load(tmp_path):
    """Three processes load one uncached extension at once: one compiles (in a temporary folder, published by
    a rename), the others wait on the lock and load its library; a stale half-build is cleared first."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cpp").write_text(TINY)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    stale = tmp_path / "cache" / "sluice" / "kernels"
    stale.mkdir(parents=True)
    code = ("import sys; from pathlib import Path; from sluice.kernels import cpp_build; cpp_build.CSRC = "
            f"Path({str(src)!r}); print(cpp_build.build_name('sluice_tiny', 'tiny.cpp', 'avx2'))")
    versioned = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                               check=True).stdout.split()[-1]
    (stale / f"{versioned}.tmpkilled").mkdir()  # what a SIGKILLed build leaves
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, str(src)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert all("ANSWER 42" in o[0] for o in outs)
    assert sum(o[0].count("BUILT") for o in outs) == 1
    assert sorted(p.name for p in stale.iterdir()) == [versioned, f"{versioned}.lock"]
    record = json.loads((stale / versioned / "build.json").read_text())
    assert record["tier"] == "avx2" and "-mavx2" in record["flags"] and record["compiler_version"]


def test_a_cached_library_loads_without_the_compiler(tmp_path, monkeypatch):
    """Once built, a library is imported directly: no compile, no compiler run, no ninja."""
    (tmp_path / "tiny.cpp").write_text(TINY)
    monkeypatch.setattr(cpp_build, "CSRC", tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    options.reset()
    assert cpp_build.load("sluice_tiny2", "tiny.cpp", "avx2").ANSWER == 42
    versioned = cpp_build.build_name("sluice_tiny2", "tiny.cpp", "avx2")
    del sys.modules[versioned]
    cpp_build._built.pop(("sluice_tiny2", "avx2"))
    monkeypatch.setattr(cpp_build, "_build", None)  # any build attempt raises
    monkeypatch.setattr(subprocess, "run", None)  # so does running the compiler
    assert cpp_build.load("sluice_tiny2", "tiny.cpp", "avx2").ANSWER == 42


def test_doctor_prints_the_tier_flags_kernels_and_versions(tier_env):
    runner = CliRunner()
    text = runner.invoke(app, ["doctor"]).output
    host = cpu_isa.host_tier()
    assert f"host_tier: {host}\n" in text and f"tier: {cpu_isa.tier()}\n" in text
    assert "torch: " in text and "transformers: " in text and "device: cpu" in text
    assert all(f"kernel {name}:" in text for name in cpp_build.EXTENSIONS.values())
    tier_env("avx2")
    info = json.loads(runner.invoke(app, ["doctor", "--json"]).output)
    assert info["tier"] == cpu_isa.cap(host, "avx2") and info["tier_cap"] == "avx2"
    assert (set(info["cpu_flags"]) <= cpu_isa.cpu_flags()
            and info["kernel_cache"] == str(cpp_build.cache_root()))
    assert all(f"_{cpp_build.object_tier(info['tier'], k['source'])}_" in Path(k["path"]).name
               for k in info["kernels"])


def test_doctor_build_compiles_every_kernel_for_the_tier(tier_env):
    """`sluice doctor --build` leaves every kernel built for the chosen tier (here the avx2 one)."""
    tier_env("avx2")
    result = CliRunner().invoke(app, ["doctor", "--build", "--json"])
    assert result.exit_code == 0, result.output[-2000:]
    kernels = json.loads(result.output)["kernels"]
    assert len(kernels) == len(cpp_build.EXTENSIONS) and all(k["built"] for k in kernels)
    assert all(Path(k["path"]).exists() for k in kernels)


def test_doctor_says_which_path_a_model_takes_and_why(tmp_path):
    """A native architecture is native, another known one generic, a refused one refused, each with its
    reason."""
    from tests.checkpoints import make_checkpoint

    runner = CliRunner()

    def path_of(folder):
        info = json.loads(runner.invoke(app, ["doctor", "--json", "--model", str(folder)]).output)
        return info["model_path"], info["model_reason"]

    native = path_of(make_checkpoint(tmp_path / "llama", "llama"))
    generic = path_of(make_checkpoint(tmp_path / "gemma2", "gemma2"))
    missing = path_of(tmp_path / "nothing")
    assert native[0] == "native" and "llama" in native[1].lower()
    assert generic[0] == "generic" and "gemma2" in generic[1].lower()
    assert missing[0] == "refused" and "config.json" in missing[1]
