"""kernels.options: the environment below the contract layer read in one place, once, and overridden by the
engine's config (the worker's Settings passed down)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from sluice.contract.settings import Settings
from sluice.engine import LLM, SamplingParams
from sluice.kernels import cpp_build, cpu_isa, device_path, options
from sluice.kernels.options import KernelOptions

ROOT = Path(__file__).resolve().parent.parent


def test_options_parse_the_environment():
    env = {"SLUICE_CPU_KERNEL": "0", "SLUICE_CPU_ISA": " AVX2 ", "SLUICE_DEVICE_PATH": "1",
           "XDG_CACHE_HOME": "/c", "CXX": "clang++", "ONEDNN_MAX_CPU_ISA": "avx2",
           "SLUICE_PACKED_WEIGHTS": "0"}
    assert KernelOptions.from_env(env) == KernelOptions(False, "avx2", True, "/c", "clang++", "AVX2", False)
    assert KernelOptions.from_env({}) == KernelOptions()
    assert KernelOptions.from_env({"SLUICE_DEVICE_PATH": "0"}).device_path is False
    assert KernelOptions.from_env({"SLUICE_DEVICE_PATH": "yes"}).device_path is None


def test_no_engine_or_kernel_module_reads_the_environment_but_options():
    """os.environ / os.getenv appear in kernels/options.py only, across engine/ and kernels/."""
    readers = []
    for path in sorted([*ROOT.glob("engine/**/*.py"), *ROOT.glob("kernels/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(str(path.relative_to(ROOT)))
    assert sorted(set(readers)) == ["kernels/options.py"]


def test_the_engine_config_overrides_the_environment_and_the_kernels_follow(tiny_llama, monkeypatch):
    """LLM(cpu_kernel=False, device_path=True) turns the C++ kernels off and the flat layout on for its
    engine's work, whatever the environment says; what the kernels derived (the enabled flag, the tier)
    follows the options in effect; outside the engine the environment's defaults still hold."""
    monkeypatch.delenv("SLUICE_CPU_KERNEL", raising=False)
    monkeypatch.delenv("SLUICE_DEVICE_PATH", raising=False)
    options.reset()
    try:
        assert cpp_build.enabled() and not device_path.flat_layout(torch.device("cpu"))
        llm = LLM(tiny_llama, dtype="float32", device="cpu", cpu_kernel=False, device_path=True)
        with options.active(llm.engine.kernel_options):
            assert not cpp_build.enabled() and options.current().device_path is True
        assert llm.engine.runner.plan.flat and not llm.engine.runner.plan.fused_attention
        assert cpp_build.enabled() and options.current().device_path is None  # the defaults: the engine's own
        with options.active(options.current().merged(cpu_isa="avx2")):
            assert cpu_isa.tier() in ("avx2", cpu_isa.GENERIC)
    finally:
        options.reset()
    assert cpp_build.enabled()


def test_a_step_runs_with_its_engines_options(tiny_llama, monkeypatch):
    """Each engine's steps run under its own options: two engines in one process, the C++ kernels on for one
    and off for the other, each step's kernels asked under the options of the engine that steps."""
    on = LLM(tiny_llama, dtype="float32", device="cpu", cpu_kernel=True)
    off = LLM(tiny_llama, dtype="float32", device="cpu", cpu_kernel=False)
    asked: list[bool] = []
    enabled = cpp_build.enabled
    monkeypatch.setattr(cpp_build, "enabled", lambda: asked.append(options.current().cpu_kernel) or enabled())
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for llm, want in ((on, True), (off, False), (on, True)):
        asked.clear()
        llm.generate([[1, 2, 3]], params, progress=False)
        assert asked and set(asked) == {want}
    assert options.current().cpu_kernel == options.defaults().cpu_kernel  # nothing left behind after a step


@pytest.mark.parametrize(("name", "field", "value", "want"), [("SLUICE_CPU_KERNEL", "cpu_kernel", "0", False),
                                                              ("SLUICE_CPU_ISA", "cpu_isa", "avx2", "avx2"),
                                                              ("SLUICE_DEVICE_PATH", "device_path", "1",
                                                               True),
                                                              ("SLUICE_PACKED_WEIGHTS", "packed_weights", "0",
                                                               False)])
def test_settings_carry_the_kernel_options(monkeypatch, name, field, value, want):
    """The worker's Settings read the same variables, for it to pass into EngineConfig explicitly."""
    monkeypatch.setenv(name, value)
    assert getattr(Settings(), field) == want
