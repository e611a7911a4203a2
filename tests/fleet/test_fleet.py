"""A fleet on separate hosts (network namespaces): the primary killed mid-batch, a worker cut off from
Redis, a worker paused past its lease. Each ends with every custom_id exactly once and a completed batch whose
files the returning zombie never changes."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from sluice.producer import BatchStatus, Client
from tests.faults.conftest import assert_exactly_once, request, wait_until
from tests.fleet.conftest import Fleet, alive
from tests.services import stop_worker

SLOW_SAVE_S = 6  # a worker that holds each finished shard this long before saving it, so it can be cut off
SLOW_LOAD_S = 2  # one that waits this long before reading a claimed shard's slice: it reads it while cut off
# the shortest partition: longer than a worker's socket timeout (5 s) after its slow load, so that its reads
# fail rather than wait for the heal
MIN_CUT_S = 10


def submit(fleet: Fleet, n: int, max_tokens: int, shard_size: int, offset: int = 0):
    client = Client(fleet.url)
    batch = client.submit_batch([request(i, max_tokens) for i in range(offset, offset + n)],
                                output=f"s3://{fleet.bucket}", shard_size=shard_size)  # fmt: skip
    return client, batch, [f"r{i}" for i in range(offset, offset + n)]


def test_primary_killed_mid_batch_fails_over_and_the_batch_completes(fleet: Fleet):
    """SIGKILL of the Redis primary while three workers run a batch: the sentinels promote the replica, every
    process follows it without a restart, the batch completes within 60 s, each custom_id once."""
    for name in ("w1", "w2", "w3"):
        fleet.start_worker(name)
    fleet.wait_ready()
    client, batch, ids = submit(fleet, 48, 48, shard_size=4)

    def under_way() -> bool:
        counts = client.get(batch.id).request_counts
        return 0 < counts.completed + counts.failed < len(ids)

    wait_until(under_way, 120, "the batch to be under way", poll=0.05)
    old = fleet.servers.current_primary().address
    killed = time.monotonic()
    new = fleet.servers.fail_over()
    failed_over = time.monotonic()
    assert new.address != old
    wait_until(lambda: client.get(batch.id).done, 60, "the batch to end within 60 s of the failover")
    took = time.monotonic() - failed_over
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed, done
    assert assert_exactly_once(client, done, ids) == (len(ids), 0)
    alive(fleet)
    promoted = failed_over - killed
    print(f"failover: replica promoted {promoted:.1f} s after the kill, batch completed {took:.1f} s later")


# where w1 is when it loses Redis: reading its shard's slice right after the claim, or saving the shard it ran
MOMENTS = {
    "load": (f"slow_load={SLOW_LOAD_S}", 0.5),  # cut once it has claimed and leased, before the slice is read
    "save": (f"slow_save={SLOW_SAVE_S}", 1.5),  # cut once it has read its slice and run it: in its slow save
}


def discarded(log: Path) -> list[str]:
    """The job ids of the worker's discard lines, in order."""
    return re.findall(r"; (\S+) discarded, taking new work", log.read_text())


def zombie_returns(fleet: Fleet, moment: str, cut, heal) -> None:
    """w1 (slow loads or saves, by moment) and w2 run a batch; cut(w1) once it holds a shard; w2 finishes the
    batch; heal(w1): the batch's files stay byte-identical, w1 logs each shard it held in one discard line and
    takes new work."""
    fault, settle = MOMENTS[moment]
    fleet.start_worker("w1", SLUICE_FAULTS=fault)
    fleet.start_worker("w2")
    fleet.wait_ready()
    fleet.workers["w2"].send_signal(signal.SIGSTOP)  # w1 claims first
    client, batch, ids = submit(fleet, 12, 8, shard_size=2)
    wait_until(lambda: fleet.holding("w1"), 60, "w1 to hold a shard", poll=0.02)
    time.sleep(settle)
    held = set(fleet.holding("w1"))  # one shard when cut in its slow load; those it ran when cut in its save
    assert held
    cut()
    cut_at = time.monotonic()
    fleet.workers["w2"].send_signal(signal.SIGCONT)
    wait_until(lambda: client.get(batch.id).done, 120, "the batch to end without w1")
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed, done
    assert assert_exactly_once(client, done, ids) == (len(ids), 0)
    before = fleet.files(batch.id)
    assert f"{batch.id}/output.jsonl" in before
    time.sleep(max(0.0, cut_at + MIN_CUT_S - time.monotonic()))
    heal()
    log = fleet.log("w1")
    # after a drop rule, the worker's next TCP retransmission can come a minute or two after the heal
    wait_until(lambda: set(discarded(log)) >= held, 240, "w1 to discard its stale shards")
    assert sorted(discarded(log)) == sorted(held), "one line per shard it held, none twice"
    alive(fleet)
    stop_worker(fleet.workers.pop("w2"))  # w1 alone now: the next batch is its
    _, second, second_ids = submit(fleet, 2, 4, shard_size=2, offset=100)
    wait_until(lambda: client.get(second.id).done, 60, "w1 to run a new batch")
    assert assert_exactly_once(client, client.get(second.id), second_ids) == (len(second_ids), 0)
    assert fleet.files(batch.id) == before, (
        "the completed batch's files are unchanged after the zombie returned"
    )
    assert client.get(batch.id).status == BatchStatus.completed
    alive(fleet)


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_worker_cut_off_from_redis_comes_back_a_fenced_zombie(fleet: Fleet, moment: str):
    """w1's host loses Redis (nft drop rule; S3 still reachable) past its heartbeat while holding a shard."""
    host = fleet.network.hosts["w1"]
    zombie_returns(fleet, moment, lambda: fleet.network.cut_off_from_redis(host),
                   lambda: fleet.network.heal(host))  # fmt: skip


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_worker_paused_past_its_lease_comes_back_a_fenced_zombie(fleet: Fleet, moment: str):
    """w1 is SIGSTOPped while holding a shard, SIGCONTed after the batch completed elsewhere."""
    zombie_returns(fleet, moment, lambda: fleet.workers["w1"].send_signal(signal.SIGSTOP),
                   lambda: fleet.workers["w1"].send_signal(signal.SIGCONT))  # fmt: skip
