"""Separate hosts as network namespaces joined by veth pairs to a bridge: Redis primary, replica and
sentinels, moto's S3 server and Sluice workers, each on its own host; this process (the producer) on the
bridge.

Addresses come from a private /24 in 10.213.0.0/16 used only by these hosts. Needs root and iproute2
(`.ci/run` runs the suite as root); a partition is an nftables drop rule inside a worker's namespace for the
Redis hosts' addresses, so the worker still reaches the S3 host. Without namespaces these tests fail, they
never skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pytest
import redis
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from sluice.contract.redis_conn import connect
from tests.faults.conftest import FAST
from tests.fleet.sentinels import Host, RedisNode, SentinelNode, SentinelSet, wait_for
from tests.services import AWS_ENV, worker_env

REDIS_PORT, SENTINEL_PORT, S3_PORT = 6379, 26379, 5000
HOSTS = {"r1": 11, "r2": 12, "r3": 13, "s3": 20, "w1": 31, "w2": 32, "w3": 33}
# fleet clocks: 3 s heartbeats, 1 s retry backoff and reaper passes; 2 s socket timeouts so a cut-off worker's
# commands fail instead of hanging
URL_OPTIONS = "socket_timeout=2"


def sh(*argv: str) -> str:
    """Run a command; its stderr in the exception when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass
class Network:
    """A bridge on this host and one namespace per test host, each with a veth pair to the bridge."""

    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000:04d}")
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"slb{self.tag}"

    @property
    def subnet(self) -> str:
        return f"10.213.{20 + os.getpid() % 200}"

    def create(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            pytest.fail(
                "tests/fleet needs root and iproute2 for its network namespaces (CI runs .ci/run as root)"
            )
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for name, n in HOSTS.items():
            self.hosts[name] = self._add_host(name, n)

    def _add_host(self, name: str, n: int) -> Host:
        netns, outside, inside = f"sl{self.tag}{name}", f"slv{self.tag}{name}", f"sli{self.tag}{name}"
        sh("ip", "netns", "add", netns)
        sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        sh("ip", "link", "set", inside, "netns", netns)
        sh("ip", "link", "set", outside, "master", self.bridge)
        sh("ip", "link", "set", outside, "up")
        inns = ("ip", "netns", "exec", netns)
        sh(*inns, "ip", "addr", "add", f"{self.subnet}.{n}/24", "dev", inside)
        sh(*inns, "ip", "link", "set", inside, "up")
        sh(*inns, "ip", "link", "set", "lo", "up")
        return Host(f"{self.subnet}.{n}", netns)

    def cut_off_from_redis(self, host: Host) -> None:
        """Drop every packet between host and the Redis hosts (primary, replica, sentinels); S3 stays
        reachable."""
        redis_hosts = ", ".join(self.hosts[n].address for n in ("r1", "r2", "r3"))
        inns = ("ip", "netns", "exec", host.netns, "nft")
        sh(*inns, "add", "table", "inet", "partition")
        for chain, hook, way in (("out", "output", "daddr"), ("in", "input", "saddr")):
            sh(
                *inns,
                "add",
                "chain",
                "inet",
                "partition",
                chain,
                f"{{ type filter hook {hook} priority 0 ; }}",
            )
            sh(*inns, "add", "rule", "inet", "partition", chain, "ip", way, f"{{ {redis_hosts} }}", "drop")

    def heal(self, host: Host) -> None:
        sh("ip", "netns", "exec", host.netns, "nft", "delete", "table", "inet", "partition")

    def destroy(self) -> None:
        """Remove the namespaces (their veths go with them) and the bridge; every step tried."""
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    net = Network()
    try:
        net.create()
        yield net
    finally:
        net.destroy()


@pytest.fixture(scope="module")
def fleet_s3(network: Network, tmp_path_factory) -> Iterator[str]:
    """moto's S3 server on its own host; its endpoint."""
    host = network.hosts["s3"]
    log = tmp_path_factory.mktemp("s3") / "moto.log"
    process = host.popen([sys.executable, "-m", "moto.server", "-H", host.address, "-p", str(S3_PORT)], log,
                         env=dict(os.environ, **AWS_ENV))  # fmt: skip
    endpoint = f"http://{host.address}:{S3_PORT}"
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint, **aws_keys())
        wait_for(lambda: s3.list_buckets() is not None, 60, "moto's S3 server", errors=(Exception,))
        yield endpoint
    finally:
        process.kill()
        process.wait(10)


def aws_keys() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@pytest.fixture
def sentinel_set(network: Network, tmp_path) -> Iterator[SentinelSet]:
    """Primary on r1, replica on r2, a sentinel on each of r1, r2, r3 (quorum 2), fresh for each test."""
    h = network.hosts
    servers = SentinelSet(
        RedisNode(h["r1"], REDIS_PORT, tmp_path / "r1"),
        RedisNode(h["r2"], REDIS_PORT, tmp_path / "r2"),
        [SentinelNode(h[n], SENTINEL_PORT, tmp_path / f"sentinel-{n}") for n in ("r1", "r2", "r3")],
        options=URL_OPTIONS,
    )
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@dataclass
class Fleet:
    """Workers on their hosts, with the producer's view of Redis and S3."""

    network: Network
    servers: SentinelSet
    s3_endpoint: str
    model: Path
    logs: Path
    bucket: str
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.servers.url

    def connection(self) -> redis.Redis:
        return connect(self.url)

    def start_worker(self, name: str, **env: str) -> subprocess.Popen:
        """`sluice worker --name NAME` on host NAME, with the fleet's fast clocks (env overrides them)."""
        argv = [sys.executable, "-m", "sluice.worker", "--model", str(self.model), "--dtype", "float32",
                "--device", "cpu", "--max-num-seqs", "8", "--name", name]  # fmt: skip
        environment = worker_env(self.url, **FAST, **AWS_ENV, AWS_ENDPOINT_URL=self.s3_endpoint, **env)
        process = self.network.hosts[name].popen(argv, self.log(name), env=environment)
        self.workers[name] = process
        return process

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every worker has registered with rq."""
        from rq import Worker

        def ready() -> bool:
            for name, process in self.workers.items():
                assert process.poll() is None, f"worker {name} exited: {self.log(name).read_text()[-3000:]}"
            names = {w.name for w in Worker.all(connection=self.connection())}
            return set(self.workers) <= names

        wait_for(ready, timeout, "the workers to start")

    def holding(self, name: str) -> list[str]:
        """The shard jobs worker name holds now (by rq's started registry and the jobs' executions)."""
        connection = self.connection()
        registry = StartedJobRegistry("default", connection=connection, serializer=JSONSerializer)
        held = []
        for job_id in registry.get_job_ids():
            try:
                job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
            except Exception:
                continue
            if any(e.worker_name == name for e in job.get_executions()) and "-shard-" in job_id:
                held.append(job_id)
        return held

    def files(self, batch_id: str) -> dict[str, bytes]:
        """Every object under the batch's output prefix, with its bytes."""
        s3 = boto3.client("s3", endpoint_url=self.s3_endpoint, **aws_keys())
        listed = s3.list_objects_v2(Bucket=self.bucket, Prefix=f"{batch_id}/").get("Contents", [])
        return {o["Key"]: s3.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read() for o in listed}

    def stop(self) -> None:
        for process in self.workers.values():
            if process.poll() is None:
                process.kill()
                process.wait(30)


@pytest.fixture
def fleet(network, sentinel_set, fleet_s3, tiny_llama, tmp_path, monkeypatch) -> Iterator[Fleet]:
    """Redis set, S3 and (once started by the test) workers; this process's SLUICE_*/AWS_* point at them."""
    bucket = f"fleet-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=fleet_s3, **aws_keys()).create_bucket(Bucket=bucket)
    for name, value in {
        **FAST,
        **AWS_ENV,
        "AWS_ENDPOINT_URL": fleet_s3,
        "SLUICE_REDIS_URL": sentinel_set.url,
    }.items():
        monkeypatch.setenv(name, value)
    logs = tmp_path / "logs"
    logs.mkdir()
    fleet = Fleet(network, sentinel_set, fleet_s3, tiny_llama, logs, bucket)
    try:
        yield fleet
    finally:
        fleet.stop()


def alive(fleet: Fleet) -> None:
    """Every worker is still the process the test started (none exited, none restarted)."""
    for name, process in fleet.workers.items():
        assert process.poll() is None, f"worker {name} exited: {fleet.log(name).read_text()[-3000:]}"
