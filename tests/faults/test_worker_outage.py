"""A Redis outage costs one warning line in the worker's log when it starts and one when it ends, not one
per attempt (real redis-server stopped for 20 s and restarted; real worker on a tiny model)."""

from __future__ import annotations

import time

from sluice.producer import BatchStatus, Client
from tests.faults.conftest import request, spawn, wait_until
from tests.services import stop_worker


def test_one_log_line_per_redis_outage(tiny_llama, aof_redis, tmp_path):
    log = tmp_path / "worker.log"
    client = Client(aof_redis.url)
    first = client.submit_batch([request(i, 4) for i in range(3)], output=tmp_path.as_uri(), shard_size=3)
    worker = spawn(tiny_llama, aof_redis.url, log)
    try:
        wait_until(lambda: client.get(first.id).done, 600, "a first batch (the worker is up)")
        before = len(log.read_text().splitlines())
        aof_redis.kill()
        time.sleep(20)
        aof_redis.start()
        client = Client(aof_redis.url)
        second = client.submit_batch([request(i, 4) for i in range(3, 6)], output=tmp_path.as_uri(),
                                     shard_size=3)
        wait_until(lambda: client.get(second.id).done, 120, "a batch after the outage")
        assert client.get(second.id).status == BatchStatus.completed
        assert worker.poll() is None, "the worker rode the outage out"
    finally:
        stop_worker(worker)
    during = log.read_text().splitlines()[before:]
    noisy = [line for line in during if "ERROR" in line or "Traceback" in line]
    assert noisy == [], "\n".join(noisy[:20])
    down = [line for line in during if "Redis unavailable" in line or "could not connect to Redis" in line]
    back = [line for line in during if "Redis is back" in line]
    assert len(down) == 1 and len(back) == 1, "\n".join(during[:40])
