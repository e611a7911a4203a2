"""The demo's summary: tokens/s from the worker's "ready" line to the batch's end, leaving the worker's start
(model load, kernel build or load, warm-up) out."""

from __future__ import annotations

import logging
from pathlib import Path

import redis

from sluice.engine import LLM
from sluice.producer.demo import generation_seconds, ready_seconds
from sluice.worker.metrics import Readiness, become_ready

TINY = Path(__file__).resolve().parent.parent / "models" / "sluice-tiny"


def test_the_worker_start_comes_from_its_ready_line_and_is_left_out(tmp_path, caplog, redis_url):
    """The seconds a worker logs when it becomes ready (the line the demo's worker log holds) are read back,
    and the generation time is the wall time less them and whatever preceded the worker's spawn."""
    log = tmp_path / "demo-worker.log"
    assert ready_seconds(log) is None
    log.write_text("2026-12-07 12:00:00 INFO sluice.worker: loading\n")
    assert ready_seconds(log) is None
    llm = LLM(str(TINY), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2)
    with caplog.at_level(logging.INFO, logger="sluice.worker"):
        seconds = become_ready(Readiness(), llm, redis.Redis.from_url(redis_url))
    line = next(r.getMessage() for r in caplog.records if r.name == "sluice.worker"
                and "ready" in r.getMessage())
    log.write_text(
        f"2026-12-07 12:00:00 INFO sluice.worker: {line}\n2026-12-07 12:00:01 INFO claimed a shard\n")
    assert seconds > 0 and abs(ready_seconds(log) - seconds) < 0.01
    assert generation_seconds(100.0, 2.0, 70.5) == 27.5
    assert generation_seconds(100.0, 2.0, None) == 98.0
