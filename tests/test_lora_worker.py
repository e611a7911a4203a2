"""LoRA adapters named by batch lines' `model`, served by a real worker process: --lora NAME=PATH and
--lora-dir folders (local and s3://), mixed with base-model lines in one shard, unknown names a per-line
error."""

from __future__ import annotations

import json

import pytest
import redis

from sluice.contract.jobs import MODELS
from sluice.engine import LLM, LoRARequest, SamplingParams
from sluice.producer import BatchStatus, Client
from tests.checkpoints import make_checkpoint
from tests.services import start_worker, stop_worker
from tests.test_lora import make_adapter

PROMPTS = ["the quick brown fox", "to be or not", "a stitch in time", "hello world", "all that glitters"]


def line(custom_id: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-worker")
    base = make_checkpoint(root / "base", "llama")
    named = make_adapter(base, root / "named", 8, 16, ["q_proj", "v_proj", "down_proj"], seed=1)
    folder = root / "adapters"
    in_dir = make_adapter(base, folder / "tenant-7", 4, 8, ["o_proj", "gate_proj", "up_proj"], seed=2)
    return base, named, folder, in_dir


def expected(base, named, in_dir) -> dict[str, str]:
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=2)
    params = SamplingParams(max_tokens=8, temperature=0)
    out = {}
    for name, lora in [("base", None), ("tuned", LoRARequest("tuned", 1, str(named))),
                       ("tenant-7", LoRARequest("tenant-7", 2, str(in_dir)))]:
        out.update({f"{name}-{i}": o.text for i, o in enumerate(llm.generate(PROMPTS, params, False, lora))})
    return out


def run_batch(redis_url, tmp_path, base, *worker_args) -> tuple[dict, dict]:
    lines = [line(f"{m}-{i}", m, p) for m in ("base", "tuned", "tenant-7") for i, p in enumerate(PROMPTS)]
    lines.append(line("unknown-0", "nobody", PROMPTS[0]))
    client = Client(redis_url)
    batch = client.submit_batch([json.dumps(x) for x in lines], output=tmp_path.as_uri(), shard_size=16)
    proc = start_worker(base, redis_url, tmp_path / "worker.log", "--burst", *worker_args)
    try:
        proc.wait(300)
    finally:
        stop_worker(proc)
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed, (tmp_path / "worker.log").read_text()[-3000:]
    texts = {r.custom_id: r.response.body["choices"][0]["text"] for r in client.results(batch.id)}
    errors = {r.custom_id: r.error for r in client.results(batch.id, errors=True)}
    return texts, errors


def test_lines_name_adapters_served_by_a_worker(adapters, redis_url, tmp_path):
    base, named, folder, in_dir = adapters
    texts, errors = run_batch(redis_url, tmp_path, base, "--lora", f"tuned={named}", "--lora-dir",
                              str(folder))
    want = expected(base, named, in_dir)
    assert texts == want
    assert texts["tuned-0"] != texts["base-0"] and texts["tenant-7-0"] != texts["base-0"]
    assert errors["unknown-0"].code == "model_not_found" and "tuned" in errors["unknown-0"].message
    announced = redis.Redis.from_url(redis_url).hgetall(MODELS)
    assert {b"base", b"tuned", b"tenant-7"} <= set(announced)  # /v1/models lists the base and its adapters


def test_adapters_from_an_s3_folder(adapters, redis_url, tmp_path, s3_server, s3_bucket):
    base, named, folder, in_dir = adapters
    s3 = s3_server.client()
    for f in in_dir.iterdir():
        s3.upload_file(str(f), s3_bucket, f"adapters/tenant-7/{f.name}")
    for f in named.iterdir():
        s3.upload_file(str(f), s3_bucket, f"one/{f.name}")
    texts, errors = run_batch(redis_url, tmp_path, base, "--lora", f"tuned=s3://{s3_bucket}/one",
                              "--lora-dir", f"s3://{s3_bucket}/adapters",
                              )
    assert texts == expected(base, named, in_dir)
    assert set(errors) == {"unknown-0"}
