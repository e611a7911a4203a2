"""Worker cold start: weights read straight into their parameters, no compiler stack or model-config import on
the way to ready, the tokenizer AutoTokenizer would pick, and the weights prefetched while Python starts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.models import loader
from engine.models.loader import CheckpointReader, load_model
from engine.tokenizer import load_tokenizer
from tests.checkpoints import make_checkpoint
from worker.metrics import warm_up
from worker.prefetch import model_argument, prefetch, read_through, weight_files

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "sluice-tiny"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A bf16 llama checkpoint split over several safetensors files with an index."""
    return make_checkpoint(tmp_path_factory.mktemp("sharded"), dtype=torch.bfloat16, max_shard_size="100KB")


@pytest.mark.parametrize("readers", [1, 3])
def test_reader_matches_safetensors_for_every_tensor(sharded, readers, monkeypatch):
    """Every tensor of a sharded checkpoint reads back bit for bit as safetensors' own reader gives it, also
    when each is read in parallel spans (3 readers: spans of unequal length, the last one short)."""
    monkeypatch.setattr(loader, "READERS", readers)
    monkeypatch.setattr(loader, "PARALLEL_CHUNK", 1000)
    files = sorted(sharded.glob("*.safetensors"))
    assert len(files) > 1 and (sharded / "model.safetensors.index.json").is_file()
    reader = CheckpointReader(sharded)
    seen = 0
    for f in files:
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                expected, got = h.get_tensor(name), reader.get(name)
                assert got.dtype == expected.dtype and torch.equal(got, expected), name
                seen += 1
    assert seen == len(reader.names())


def test_reader_converts_into_the_target_dtype_and_refuses_wrong_shapes(sharded):
    reader = CheckpointReader(sharded)
    name = "model.layers.0.mlp.down_proj.weight"
    out = torch.empty(reader.shape(name), dtype=torch.float32)
    reader.read_into(name, out)
    assert torch.equal(out, reader.get(name).float())
    with pytest.raises(ValueError, match="shape"):
        reader.read_into(name, torch.empty(3, 3, dtype=torch.bfloat16))


def test_fused_projections_are_the_checkpoint_rows_in_order(sharded):
    """qkv and gate/up are read part by part into one parameter: rows equal the checkpoint tensors stacked."""
    model = load_model(sharded, torch.float32, torch.device("cpu"), 64)
    reader = CheckpointReader(sharded)
    layer = model.layers[1]
    qkv = torch.cat([reader.get(f"model.layers.1.self_attn.{p}_proj.weight") for p in "qkv"]).float()
    gate_up = torch.cat([reader.get(f"model.layers.1.mlp.{p}_proj.weight") for p in ("gate", "up")]).float()
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


def test_a_missing_tensor_is_named(tmp_path, sharded):
    """A checkpoint lacking a weight fails the load with its name, never leaves uninitialised storage."""
    reader = CheckpointReader(sharded)
    missing = "model.layers.2.post_attention_layernorm.weight"
    save_file({n: reader.get(n) for n in reader.names() if n != missing}, tmp_path / "model.safetensors")
    shutil.copy(sharded / "config.json", tmp_path / "config.json")
    with pytest.raises(KeyError, match="post_attention_layernorm"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), 64)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tokenizer_is_the_one_autotokenizer_loads(tmp_path, arch):
    path = make_checkpoint(tmp_path / arch, arch)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    text = "to be or not to be, that is the question."
    chat = [{"role": "user", "content": "hello world"}]
    assert type(ours) is type(auto)
    assert ours.encode(text) == auto.encode(text) and ours.eos_token_id == auto.eos_token_id
    assert ours.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == auto.apply_chat_template(
        chat, add_generation_prompt=True
    )


def test_engine_start_imports_neither_the_compiler_nor_the_model_config():
    """Loading and running the bundled model pulls in neither torch._dynamo (meta-device init kernels used to)
    nor transformers' llama config module (AutoTokenizer used to): each costs a second of every worker start."""
    code = (
        "import sys; from engine import LLM, SamplingParams\n"
        f"llm = LLM({str(TINY)!r}, dtype='float32', device='cpu', max_model_len=64, max_num_seqs=2)\n"
        "out = llm.generate(['O Romeo'], SamplingParams(max_tokens=4, temperature=0), progress=False)\n"
        "assert len(out[0].token_ids) == 4\n"
        "print(sorted(m for m in ('torch._dynamo', 'transformers.models.llama.configuration_llama') "
        "if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_model_argument_from_command_line_or_environment(monkeypatch):
    monkeypatch.setenv("SLUICE_MODEL", "/models/settings")
    assert model_argument(["--burst"]) == "/models/settings"  # through Settings, the environment's one reader
    env = {"SLUICE_MODEL": "/models/env"}
    assert model_argument(["--dtype", "bfloat16", "--model", "/m/a"], env) == "/m/a"
    assert model_argument(["--model=/m/b", "--burst"], env) == "/m/b"
    assert model_argument(["--burst"], env) == "/models/env"
    assert model_argument(["--burst"], {}) is None


def test_prefetch_reads_the_index_files_within_budget(sharded, tmp_path):
    files = weight_files(str(sharded))
    total = sum(f.stat().st_size for f in files)
    assert files == sorted(sharded.glob("*.safetensors"))
    assert read_through(files, total + 10) == total
    assert read_through(files, 1000) == 1000
    thread = prefetch(str(sharded))
    assert thread is not None
    thread.join(30)
    assert not thread.is_alive()
    assert prefetch(str(tmp_path / "missing")) is None and prefetch("org/hub-model") is None and prefetch(None) is None


def test_warm_up_is_one_step_that_generates_a_token():
    llm = LLM(str(TINY), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2)
    assert warm_up(llm) == 1
    assert not llm.engine.has_unfinished() and llm.engine.counters["generated_tokens"] == 1


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_kv_pool_touches_no_page_at_start_and_reads_as_zeros(kv_dtype):
    """A 2 GiB KV pool commits (almost) no memory when the engine starts (torch.zeros would write all of it:
    seconds of start-up), every slot reads as zero, and the engine generates as before."""
    before = _rss()
    llm = LLM(str(TINY), dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_gb=2.0,
              kv_cache_dtype=kv_dtype)
    grown = _rss() - before
    caches = llm.engine.runner.kv_caches
    pool = sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v))
    assert pool > 1.9 * 1024**3 and grown < 256 * 1024**2, (pool, grown)
    assert all(int(t.count_nonzero()) == 0 for t in (caches[0].k, caches[-1].v))
    out = llm.generate(["O Romeo"], SamplingParams(max_tokens=4, temperature=0), progress=False)
    assert len(out[0].token_ids) == 4 and _rss() - before < 512 * 1024**2
