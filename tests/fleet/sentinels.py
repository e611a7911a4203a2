"""Redis primary, replica and sentinels as real processes, on loopback or each on its own host (a network
namespace)."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

SERVICE = "sluice"
DOWN_AFTER_MS = 3000  # how long a silent primary takes to be judged down (not a primary a busy host stalled)
FAILOVER_TIMEOUT_MS = 3000


@dataclass
class Host:
    """Where a process runs (a network namespace through `ip netns exec`, or this host) and its address."""

    address: str = "127.0.0.1"
    netns: str = ""

    def argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv

    def popen(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen(self.argv(argv), stdout=out, stderr=subprocess.STDOUT, env=env)


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed (apt-get install redis-server redis-sentinel)")
    return path


def wait_for(
    predicate, timeout: float, what: str, poll: float = 0.1, errors: tuple = (redis.RedisError, OSError)
) -> None:
    """Poll predicate (errors count as False) until true; RuntimeError naming what after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except errors:
            pass
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


@dataclass
class RedisNode:
    """One redis-server (append-only file, fsync every write) that can be killed."""

    host: Host
    port: int
    workdir: Path
    replicaof: RedisNode | None = None
    process: subprocess.Popen | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.host.address, self.port

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            binary("redis-server"),
            "--port",
            str(self.port),
            "--bind",
            self.host.address,
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            str(self.workdir),
        ]
        if self.replicaof is not None:
            argv += ["--replicaof", *map(str, self.replicaof.address)]
        self.process = self.host.popen(argv, self.workdir / "redis.log")
        wait_for(self.client().ping, 15, f"redis-server on {self.address}")

    def client(self) -> redis.Redis:
        return redis.Redis(*self.address, socket_timeout=2, socket_connect_timeout=2)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@dataclass
class SentinelNode:
    """One redis-sentinel watching the primary."""

    host: Host
    port: int
    workdir: Path
    process: subprocess.Popen | None = None

    def start(self, primary: RedisNode, quorum: int) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind {self.host.address}\nprotected-mode no\ndir {self.workdir}\n"
            f"sentinel monitor {SERVICE} {primary.host.address} {primary.port} {quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self.process = self.host.popen([binary("redis-sentinel"), str(conf)], self.workdir / "sentinel.log")
        wait_for(self.client().ping, 15, f"redis-sentinel on {self.host.address}:{self.port}")

    def client(self) -> redis.Redis:
        return redis.Redis(self.host.address, self.port, socket_timeout=2, socket_connect_timeout=2)

    def primary(self) -> tuple[str, int] | None:
        """The primary this sentinel names now."""
        found = self.client().sentinel_get_master_addr_by_name(SERVICE)
        if not found:
            return None
        host = found[0].decode() if isinstance(found[0], bytes) else found[0]
        return host, int(found[1])

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@dataclass
class SentinelSet:
    """A primary, its replica and sentinels (quorum: a majority of them), started together."""

    primary: RedisNode
    replica: RedisNode
    sentinels: list[SentinelNode]
    db: int = 0
    options: str = ""
    nodes: list[RedisNode] = field(init=False)

    def __post_init__(self) -> None:
        self.replica.replicaof = self.primary
        self.nodes = [self.primary, self.replica]

    @property
    def url(self) -> str:
        hosts = ",".join(f"{s.host.address}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/{self.db}" + (f"?{self.options}" if self.options else "")

    def start(self) -> None:
        self.primary.start()
        self.replica.start()
        wait_for(lambda: self.replica.client().info("replication")["master_link_status"] == "up", 15,
                 "the replica to sync")  # fmt: skip
        for sentinel in self.sentinels:
            sentinel.start(self.primary, len(self.sentinels) // 2 + 1)
        wait_for(lambda: all(s.primary() == self.primary.address for s in self.sentinels), 15,
                 "the sentinels to agree on the primary")  # fmt: skip
        if len(self.sentinels) > 1:
            wait_for(lambda: all(int(s.client().sentinel_master(SERVICE)["num-other-sentinels"]) ==
                                 len(self.sentinels) - 1 for s in self.sentinels), 30,
                     "the sentinels to find each other")  # fmt: skip
        replicas = [
            lambda s=s: int(s.client().sentinel_master(SERVICE)["num-slaves"]) >= 1 for s in self.sentinels
        ]
        wait_for(lambda: all(seen() for seen in replicas), 30, "the sentinels to see the replica")

    def current_primary(self) -> RedisNode:
        """The node the sentinels name as primary now."""
        address = self.sentinels[-1].primary()
        return next(n for n in self.nodes if n.address == address)

    def flush(self) -> None:
        """Empty the data set (on the primary; the replica follows)."""
        self.current_primary().client().flushall()

    def fail_over(self, timeout: float = 30.0) -> RedisNode:
        """SIGKILL the primary and wait until the sentinels promote the replica; returns the new primary."""
        old = self.current_primary()
        old.kill()
        alive = [s for s in self.sentinels if s.process is not None and s.process.poll() is None]
        wait_for(lambda: all(s.primary() not in (None, old.address) for s in alive), timeout,
                 "the sentinels to promote the replica")  # fmt: skip
        new = self.current_primary()
        wait_for(lambda: new.client().info("replication")["role"] == "master", timeout, "the new primary")
        return new

    def stop(self) -> None:
        for process in [*self.sentinels, *self.nodes]:
            process.kill()


def loopback_set(workdir: Path, sentinels: int = 1) -> SentinelSet:
    """A primary, a replica and sentinels on free loopback ports (not started)."""
    from tests.services import free_port

    host = Host()
    return SentinelSet(
        RedisNode(host, free_port(), workdir / "primary"),
        RedisNode(host, free_port(), workdir / "replica"),
        [SentinelNode(host, free_port(), workdir / f"sentinel{i}") for i in range(sentinels)],
    )
