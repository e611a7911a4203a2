"""Worker cold start: weights read straight into their parameters, no compiler stack or model-config import on
the way to ready, the tokenizer AutoTokenizer would pick, and the weights prefetched while Python starts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer

from sluice.engine import LLM, SamplingParams, weight_reserve
from sluice.engine.models import loader
from sluice.engine.models.loader import CheckpointReader, load_model
from sluice.engine.tokenizer import Tokenizer, load_tokenizer
from sluice.worker import prefetch as prefetching
from sluice.worker.metrics import warm_up
from sluice.worker.prefetch import arena_plan, local_weight_files, model_argument, prefetch, read_through
from tests.checkpoints import make_checkpoint

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
def test_tokenizer_does_what_autotokenizer_does(tmp_path, arch):
    """Ids, EOS, decoding (special tokens kept or skipped), the vocabulary and the chat template (as text and
    as ids) equal AutoTokenizer's; llama and mistral folders are read without transformers, the rest through
    it."""
    path = make_checkpoint(tmp_path / arch, arch)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    text = "to be or not to be, that is the question. don't ( ) ! ?"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ids = auto.encode(text) + [auto.eos_token_id]
    assert isinstance(ours, Tokenizer) == (arch in ("llama", "mistral"))
    assert ours.encode(text) == auto.encode(text)
    assert ours(text, add_special_tokens=False)["input_ids"] == auto(text,
                                                                     add_special_tokens=False)["input_ids"]
    assert [ours.bos_token_id, ours.eos_token_id, ours.pad_token_id] == [auto.bos_token_id, auto.eos_token_id,
                                                                        auto.pad_token_id]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    assert ours.get_vocab() == auto.get_vocab()
    for tokenize in (True, False):
        want = auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize)
        got = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize)
        assert _ids(got) == _ids(want)


def _ids(rendered):
    """apply_chat_template's answer as text or a list of ids (transformers 5 gives a BatchEncoding)."""
    return list(rendered["input_ids"]) if hasattr(rendered, "keys") else rendered


def test_a_folder_transformers_would_rewrite_goes_through_autotokenizer(tmp_path):
    """A chat template kept in tokenizer_config.json is used; add_bos_token (which makes transformers rewrite
    the post-processor) or a tokenizer class of the model's own sends the folder to AutoTokenizer."""
    path = make_checkpoint(tmp_path / "llama", "llama")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    config_file.write_text(json.dumps(config | {"chat_template": template}))
    chat = [{"role": "user", "content": "hello"}]
    ours = load_tokenizer(path)
    assert isinstance(ours, Tokenizer)
    theirs = AutoTokenizer.from_pretrained(path)
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    for extra in ({"add_bos_token": True}, {"tokenizer_class": "LlamaTokenizer"}):
        config_file.write_text(json.dumps(config | extra))
        assert not isinstance(load_tokenizer(path), Tokenizer)


def test_engine_start_imports_neither_transformers_nor_the_compiler():
    """Loading and running the bundled model (a native one) pulls in neither transformers (the tokenizer and
    config.json are read by the engine) nor torch._dynamo (meta-device init kernels used to): each costs
    a second or more of every worker start."""
    code = (
        "import sys; from sluice.engine import LLM, SamplingParams\n"
        f"llm = LLM({str(TINY)!r}, dtype='float32', device='cpu', max_model_len=64, max_num_seqs=2)\n"
        "out = llm.generate(['O Romeo'], SamplingParams(max_tokens=4, temperature=0), progress=False)\n"
        "assert len(out[0].token_ids) == 4\n"
        "assert llm.encode_chat([{'role': 'user', 'content': 'hi'}])\n"
    )
    assert modules_imported_by(code, ("torch._dynamo", "transformers")) == []


def modules_imported_by(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter running `code` has imported by its end."""
    code += f"import json; print(json.dumps(sorted(m for m in {list(modules)!r} if m in sys.modules)))\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_worker_start_path_imports_no_framework_it_does_not_serve_with():
    """A worker's start up to ready (`python -m sluice.worker`'s imports, the engine on the bundled model, its
    warm-up, its readiness without a metrics port) imports none of NOT_ON_THE_START_PATH (bitsandbytes: bf16;
    jinja2: no chat request yet): each was, or would be, a fixed cost of every scale-up."""
    code = (
        "import sys, typer, sluice.worker.cli\n"
        "from sluice.engine import LLM\n"
        "from sluice.worker.metrics import start_metrics, warm_up\n"
        f"llm = LLM({str(TINY)!r}, dtype='bfloat16', device='cpu')\n"
        "warm_up(llm)\n"
        "metrics = start_metrics(None, 'tiny'); metrics.instrument(llm); assert metrics.ready() > 0\n"
    )
    assert modules_imported_by(code, NOT_ON_THE_START_PATH) == []


# What a worker's start never imports: frameworks it does not serve with, webhook delivery and signing (loaded
# by the delivery thread and at a batch's end), Prometheus (only with --metrics-port) and rq's cron (croniter:
# the producer's scheduler).
NOT_ON_THE_START_PATH = (
    "transformers", "rich", "torch._dynamo", "torch._inductor", "bitsandbytes", "jinja2", "urllib3",
    "standardwebhooks", "sluice.contract.signing", "sluice.worker.webhooks", "prometheus_client", "croniter",
    "rq.cron",
)


def test_a_real_worker_start_imports_only_what_serving_needs(redis_url):
    """`python -m sluice.worker --burst` on the bundled model, run to ready and out against a real
    redis-server (empty queues, no metrics port, no webhooks), has imported none of NOT_ON_THE_START_PATH when
    it exits."""
    argv = ["--model", str(TINY), "--dtype", "bfloat16", "--device", "cpu", "--burst", "--no-webhooks",
            "--redis-url", redis_url]
    code = (
        "import json, runpy, sys\n"
        f"sys.argv = ['sluice.worker', *{argv!r}]\n"
        "try:\n    runpy.run_module('sluice.worker', run_name='__main__')\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        f"print(json.dumps(sorted(m for m in {list(NOT_ON_THE_START_PATH)!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "ready in" in out.stdout + out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("module, command", [("sluice.worker", []), ("sluice.cli.main", ["worker"])])
def test_a_real_worker_loads_into_the_arena_it_reserved_before_importing_torch(redis_url, module, command):
    """`python -m sluice.worker` and `sluice worker` map the weight arena and read the weights into it while
    they import torch (engine.weight_reserve); the load takes every tensor from there: the arena logs the
    checkpoint's MB as read ahead and taken, and nothing past them written but the rotary tables."""
    argv = [*command, "--model", str(TINY), "--dtype", "bfloat16", "--device", "cpu", "--burst",
            "--no-webhooks", "--redis-url", redis_url]
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['sluice', *{argv!r}]\n"
        f"try:\n    runpy.run_module({module!r}, run_name='__main__')\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    found = re.search(r"weight arena: (\d+) MB written, (\d+) MB of it faulted in ahead at the start, (\d+) "
                      r"MB of tensors read ahead and taken", out.stdout + out.stderr)
    assert found is not None, out.stderr[-3000:]
    written, ahead, taken = (int(g) for g in found.groups())
    stored = weight_reserve.stored_tensors(weight_reserve.safetensors_files(TINY))
    assert taken == sum(t.nbytes for t in stored.values() if t.dtype == "BF16") >> 20 == ahead
    assert 0 < ahead <= written <= ahead + 1  # past what was read ahead: only the rotary tables


def test_the_arena_plan_reads_the_command_line_without_torch(tmp_path):
    """The worker reserves an arena only where the load will make one (CPU, no quantization at load, no map of
    the file, huge pages on), floating weights in the --dtype's size (auto: the checkpoint's; fp16 as
    bf16)."""
    cpu = ["--model", str(TINY), "--device", "cpu"]
    plan = arena_plan([*cpu, "--dtype", "float32"], str(TINY))
    assert plan is not None and plan[:2] == (str(TINY), "F32") and plan[2] > 0 and plan[3] is True
    assert arena_plan([*cpu, "--dtype=bf16", "--weight-loading", "copy"], str(TINY))[1::2] == ("BF16", False)
    for extra in (["--quantization", "int8"], ["--no-huge-pages"], ["--weight-loading", "mmap"],
                  ["--device", "cuda"], ["--dtype", "float8"]):
        assert arena_plan([*cpu, *extra], str(TINY)) is None, extra
    assert arena_plan(cpu, str(tmp_path)) is None and arena_plan(cpu, None) is None
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert arena_plan(["--device", "cpu"], str(tmp_path))[1] == "BF16"


@pytest.mark.parametrize("entry",
                         ["import sluice.cli.main", "import runpy; runpy.run_module('sluice.worker')"])
def test_worker_entry_points_pause_the_collector_over_their_imports(entry):
    """`sluice worker` and `python -m sluice.worker` turn the cyclic collector off before their first import
    (its full collections rescan every module object torch made: a large share of the imports' time); `start`
    turns it back on with the objects alive then frozen, once; elsewhere resume changes nothing."""
    code = (
        "import gc, sys\n"
        f"try:\n    {entry}\nexcept SystemExit:\n    pass\n"  # python -m sluice.worker --help exits
        "from sluice.worker import collector\n"
        "print(gc.isenabled(), 'torch' in sys.modules, 'sluice.worker.cli' in sys.modules)\n"
        "print(collector.resume(), gc.isenabled(), gc.get_freeze_count() > 1000, collector.resume())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, "worker", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-2:] == ["False True True", "True True True False"]
    in_tests = subprocess.run([sys.executable, "-c", "import gc; from sluice.worker import collector; "
                               "frozen = gc.get_freeze_count(); "
                               "print(collector.resume(), gc.isenabled(), gc.get_freeze_count() == frozen)"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert in_tests.stdout.split() == ["False", "True", "True"]  # (some Pythons start with objects frozen)


def test_model_argument_from_command_line_or_environment(monkeypatch):
    monkeypatch.setenv("SLUICE_MODEL", "/models/settings")
    assert model_argument(["--burst"]) == "/models/settings"  # through Settings, the environment's one reader
    env = {"SLUICE_MODEL": "/models/env"}
    assert model_argument(["--dtype", "bfloat16", "--model", "/m/a"], env) == "/m/a"
    assert model_argument(["--model=/m/b", "--burst"], env) == "/m/b"
    assert model_argument(["--burst"], env) == "/models/env"
    assert model_argument(["--burst"], {}) is None


def test_the_prefetch_leaves_the_read_to_a_reservation_that_reads_ahead():
    """The worker's page-cache prefetch reads nothing where the arena's reservation reads the same weights
    ahead (that read fills the page cache too), and reads the files where there is none."""
    argv = ["--model", str(TINY)]
    assert prefetching.prefetch_argv(argv) == sum(f.stat().st_size for f in local_weight_files(str(TINY)))
    reservation = weight_reserve.reserve(TINY, "BF16", 1 << 40)
    assert reservation is not None and reservation.slots
    assert prefetching.prefetch_argv(argv, reservation) == 0
    assert weight_reserve.discard(reservation) is True and prefetching.prefetch_argv(argv, reservation) > 0


def test_prefetch_reads_the_index_files_within_budget(sharded, tmp_path):
    files = local_weight_files(str(sharded))
    total = sum(f.stat().st_size for f in files)
    assert files == sorted(sharded.glob("*.safetensors"))
    assert read_through(files, total + 10) == total
    assert read_through(files, 1000) == 1000
    thread = prefetch(str(sharded))
    assert thread is not None
    thread.join(30)
    assert not thread.is_alive()
    assert (prefetch(str(tmp_path / "missing")) is None and prefetch("org/hub-model") is None
            and prefetch(None) is None)


def test_warm_up_runs_the_model_once_end_to_end():
    """The warm-up is one step through the whole model: a one-token prompt, one token sampled, nothing
    left."""
    llm = LLM(str(TINY), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2)
    assert warm_up(llm) == 1
    assert not llm.engine.has_unfinished() and llm.engine.counters["generated_tokens"] == 1
    assert llm.engine.counters["prompt_tokens"] == 1 and llm.engine.counters["steps"] == 1


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


def aligned_copy(src: Path, dst: Path) -> Path:
    """src as one bf16 safetensors file whose tensor data starts on a 64-byte boundary (a header padded with
    metadata), so every tensor of a size in whole cache lines is aligned, as `auto` maps them."""
    reader = CheckpointReader(src)
    tensors = {n: reader.get(n) for n in reader.names()}
    dst.mkdir()
    for f in src.iterdir():  # config, tokenizer
        if f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
    for pad in range(64):
        save_file(tensors, dst / "model.safetensors", metadata={"pad": "x" * pad})
        if next(iter(loader.read_header(dst / "model.safetensors").values())).offset % 64 == 0:
            return dst
    raise AssertionError("no padding aligned the data")


def _mapped_files(t: torch.Tensor) -> set[str]:
    """The files whose mappings hold the tensor's first byte (/proc/self/maps)."""
    ptr, hits = t.data_ptr(), set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= ptr < hi and len(rest) >= 5:
            hits.add(rest[4])
    return hits


def _logits(model) -> torch.Tensor:
    from sluice.engine.kv_cache import LayerKVCache
    from sluice.kernels import build_metadata

    c = model.config
    shape = (c.num_kv_heads, 4, 16, c.head_dim)
    caches = [LayerKVCache(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
              for _ in range(c.num_layers)]
    ids = torch.tensor([5, 9, 2, 7, 11])
    meta = build_metadata([5], [5], [[0]], torch.arange(5), 16, torch.device("cpu"))
    with torch.inference_mode():
        return model(ids, torch.arange(5), caches, meta, torch.arange(5))


@pytest.fixture(scope="module")
def aligned(sharded, tmp_path_factory) -> Path:
    return aligned_copy(sharded, tmp_path_factory.mktemp("aligned") / "model")


def test_mapped_weights_are_the_files_pages_copy_on_write(aligned):
    """weight_loading=mmap on an aligned bf16 file: every parameter stored as the model keeps it (all but qkv,
    whose parts lie apart in the file; gate/up lie back to back) is a view of the file's own pages, the
    logits are bitwise those of private copies, and writing a mapped weight leaves the file as it was."""
    file = str((aligned / "model.safetensors").resolve())
    mapped = load_model(aligned, torch.bfloat16, torch.device("cpu"), 64, weight_loading="mmap")
    copied = load_model(aligned, torch.bfloat16, torch.device("cpu"), 64, weight_loading="copy")
    on_file = {n for n, p in mapped.named_parameters() if file in _mapped_files(p)}
    assert not any(file in _mapped_files(p) for p in copied.parameters())
    expected = {n for n, _ in mapped.named_parameters() if "qkv_proj" not in n}
    assert on_file == expected and "layers.0.mlp.gate_up_proj.weight" in on_file
    assert torch.equal(_logits(mapped), _logits(copied))
    before = CheckpointReader(aligned).get("model.norm.weight")
    with torch.no_grad():
        mapped.norm.weight.add_(1)
    after = CheckpointReader(aligned).get("model.norm.weight")
    assert torch.equal(after, before) and not torch.equal(mapped.norm.weight, before)


def test_auto_copies_small_checkpoints_and_maps_large_ones(aligned, tmp_path, monkeypatch):
    """auto reads every tensor of a checkpoint below MAP_ALL_BYTES into private memory on cache lines, aligned
    in the file or not (here 8 bytes off a cache line), and maps those of one of MAP_ALL_BYTES or more; mmap
    maps them at any size; all load the same weights; other dtypes are always read."""
    shutil.copy(aligned / "config.json", tmp_path / "config.json")
    reader = CheckpointReader(aligned)
    tensors = {n: reader.get(n) for n in reader.names()}
    for pad in range(64):
        save_file(tensors, tmp_path / "model.safetensors", metadata={"pad": "x" * pad})
        if next(iter(loader.read_header(tmp_path / "model.safetensors").values())).offset % 64 == 8:
            break
    file = str((tmp_path / "model.safetensors").resolve())
    auto = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), 64, weight_loading="auto")
    auto_aligned = load_model(aligned, torch.bfloat16, torch.device("cpu"), 64, weight_loading="auto")
    mmapped = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), 64, weight_loading="mmap")
    fp32 = load_model(tmp_path, torch.float32, torch.device("cpu"), 64, weight_loading="mmap")
    assert not any(file in _mapped_files(p) for p in auto.parameters())
    assert not any(_mapped_files(p) - {"[heap]", "[anon]"} for p in auto_aligned.parameters())
    assert all(p.data_ptr() % 64 == 0 for p in auto.parameters() if p.numel() * 2 >= 64)
    assert file in _mapped_files(mmapped.layers[1].mlp.down_proj.weight)
    assert not any(file in _mapped_files(p) for p in fp32.parameters())
    monkeypatch.setattr(loader, "MAP_ALL_BYTES", (tmp_path / "model.safetensors").stat().st_size - 4096)
    large = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), 64, weight_loading="auto")
    assert file in _mapped_files(large.layers[1].mlp.down_proj.weight)
    for (name, a), b, c in zip(auto.named_parameters(), mmapped.parameters(), large.parameters(),
                               strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), name


def test_a_quantizing_load_maps_nothing_and_bad_modes_are_refused(aligned):
    llm = LLM(str(aligned), dtype="bfloat16", device="cpu", max_model_len=64, max_num_seqs=2,
              quantization="int8_weight_only")
    file = str((aligned / "model.safetensors").resolve())
    assert not any(file in _mapped_files(t) for t in llm.engine.model.state_dict().values())
    with pytest.raises(ValueError, match="weight_loading"):
        LLM(str(aligned), device="cpu", weight_loading="lazy")


def test_an_int8_start_imports_neither_bitsandbytes_nor_the_compiler():
    """An int8 (LLM.int8()) model on CPU loads and generates without importing bitsandbytes (whose import
    wraps its default ops in torch.compile, pulling in torch._dynamo and inductor: seconds of every quantized
    start) or torch._dynamo, and torch.compile stays torch's own."""
    code = (
        "import sys, torch; real = torch.compile\n"
        "from sluice.engine import LLM, SamplingParams\n"
        f"llm = LLM({str(TINY)!r}, dtype='bfloat16', device='cpu', max_model_len=64, max_num_seqs=2, "
        "quantization='int8')\n"
        "print('bitsandbytes' in sys.modules, 'torch._dynamo' in sys.modules)\n"
        "out = llm.generate(['O Romeo'], SamplingParams(max_tokens=4, temperature=0), progress=False)\n"
        "assert len(out[0].token_ids) == 4 and torch.compile is real\n"
        "print('bitsandbytes' in sys.modules, 'torch._dynamo' in sys.modules, 'torch._inductor' in "
        "sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == ["False False", "False False False"]


def test_process_start_time_is_when_the_process_started():
    """The time-to-ready gauge's origin lies between the parent's clock just before it started a child and
    just after the child answered (btime-based stamps put it ~1 s early on this VM: whole seconds,
    drifting)."""
    code = "from sluice.worker.metrics import process_start_time; print(repr(process_start_time()))"
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    after = time.time()
    assert out.returncode == 0, out.stderr
    started = float(out.stdout)
    assert before - 0.05 <= started <= after, (before, started, after)
