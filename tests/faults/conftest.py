"""Fault-suite fixtures: restartable redis-server (AOF) and moto servers, fast worker processes, result
checks.

Every fault test that uses Redis runs twice: against a plain redis-server and through a `redis+sentinel://`
URL (a primary, its replica and a sentinel on loopback), so every process in it reaches Redis through the
sentinel's view, as a Sentinel set-up runs them. The tests that kill Redis do it to a private Sentinel set's
primary and replica together (no failover possible: an outage, as for a lone server), restarted the same
way."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sluice.contract.schemas import Batch
from sluice.producer import Client
from tests.fleet.sentinels import SERVICE, SentinelSet, loopback_set, wait_for
from tests.services import RedisServer, free_port, start_worker, wait_for_port

# Fast clocks for every worker the fault suite starts: 3 s heartbeats, 1 s retry backoff, 1 s reaper passes.
FAST = {
    "SLUICE_HEARTBEAT_TTL": "3",
    "SLUICE_RETRY_BACKOFF": "[1]",
    "SLUICE_REAPER_INTERVAL": "1",
    "SLUICE_SHARD_RETRIES": "30",
    "SLUICE_FINALIZE_RETRIES": "30",
}


SETUPS = ["redis", "sentinel"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run every test that uses Redis against both set-ups."""
    for name in ("redis_url", "aof_redis"):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, SETUPS, indirect=True)


@pytest.fixture(scope="session")
def loopback_sentinels(tmp_path_factory) -> Iterator[SentinelSet]:
    """A primary, its replica and one sentinel on loopback, for the whole session."""
    servers = loopback_set(tmp_path_factory.mktemp("sentinel-set"))
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def redis_url(request, redis_server: RedisServer, monkeypatch) -> str:
    """The session's Redis (plain, or through its sentinel when parametrized so), emptied for this test, also
    exported as SLUICE_REDIS_URL."""
    if getattr(request, "param", "redis") == "sentinel":
        servers: SentinelSet = request.getfixturevalue("loopback_sentinels")
        servers.flush()
        url = servers.url
    else:
        redis_server.client().flushall()
        url = redis_server.url
    monkeypatch.setenv("SLUICE_REDIS_URL", url)
    return url


@pytest.fixture(autouse=True)
def fast_clocks(monkeypatch) -> None:
    """The producer side enqueues with the same fast retry settings the workers get."""
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)


def request(i: int, max_tokens: int = 8, prompt: str | None = None) -> dict:
    body = {"prompt": prompt or f"fault line {i}", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}


def spawn(model: Path, redis_url: str, log: Path, *args: str, **env: str) -> subprocess.Popen:
    """A worker process with the suite's fast clocks (env overrides them)."""
    return start_worker(model, redis_url, log, "--max-num-seqs", "8", *args, **{**FAST, **env})


def wait_until(predicate, timeout: float, what: str, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def assert_exactly_once(client: Client, batch: Batch, ids: list[str]) -> tuple[int, int]:
    """Every custom_id once in the output or the error file; returns (outputs, errors)."""
    ok = [r.custom_id for r in client.results(batch.id)]
    bad = [r.custom_id for r in client.results(batch.id, errors=True)]
    seen = ok + bad
    assert sorted(seen) == sorted(ids), (
        f"lost {sorted(set(ids) - set(seen))}, duplicated {sorted({i for i in seen if seen.count(i) > 1})}"
    )
    return len(ok), len(bad)


@dataclass
class RedisProcess:
    """A redis-server with an append-only file that a test can SIGKILL and start again on the same port."""

    workdir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind",
               "127.0.0.1",
               "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir)]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_for_port(self.port)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)


@dataclass
class SentinelOutage:
    """A private primary, replica and sentinel (AOF, fsync always) whose two servers a test SIGKILLs together
    and starts again on the same ports: Redis is gone for every client, and no replica is left to promote."""

    servers: SentinelSet

    @property
    def url(self) -> str:
        return self.servers.url

    def start(self) -> None:
        """Start the primary, then its replica; return once the sentinel hands out the primary again."""
        self.servers.primary.start()
        self.servers.replica.start()
        sentinel = self.servers.sentinels[0]
        wait_for(lambda: not sentinel.client().sentinel_master(SERVICE)["is_sdown"], 30,
                 "the sentinel to see the primary up")  # fmt: skip

    def kill(self) -> None:
        for node in self.servers.nodes:
            node.kill()


@pytest.fixture
def aof_redis(request, tmp_path) -> Iterator[RedisProcess | SentinelOutage]:
    """A private, persistent (AOF, fsync always) Redis for tests that kill it: a redis-server, or a Sentinel
    set reached through its sentinel when parametrized so."""
    if getattr(request, "param", "redis") == "sentinel":
        outage = SentinelOutage(loopback_set(tmp_path / "sentinel-set"))
        try:
            outage.servers.start()
            yield outage
        finally:
            outage.servers.stop()
        return
    server = RedisProcess(tmp_path / "redis")
    server.workdir.mkdir()
    server.start()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            server.kill()


@dataclass
class MotoProcess:
    """moto's S3 server in this process (its data outlives a stop), stoppable and restartable on one port."""

    port: int = field(default_factory=free_port)
    server: object = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        wait_for_port(self.port)

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def moto(s3_server, monkeypatch) -> Iterator[MotoProcess]:
    """A private moto server (sharing moto's in-process state with the session one), AWS_* env pointed at
    it."""
    server = MotoProcess()
    server.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    try:
        yield server
    finally:
        server.stop()
