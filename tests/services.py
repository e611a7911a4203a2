"""Real services for tests: a redis-server process and moto's standalone S3 server, each on a free loopback
port."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


@dataclass
class RedisServer:
    """A running redis-server: its URL and process."""

    url: str
    port: int
    process: subprocess.Popen

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """A real redis-server (no persistence) for the whole session."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    port, workdir = free_port(), tmp_path_factory.mktemp("redis")
    cmd = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port)
        yield RedisServer(f"redis://127.0.0.1:{port}/0", port, process)
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def redis_url(redis_server: RedisServer, monkeypatch) -> str:
    """The session's Redis, emptied for this test, also exported as SLUICE_REDIS_URL."""
    redis_server.client().flushall()
    monkeypatch.setenv("SLUICE_REDIS_URL", redis_server.url)
    return redis_server.url


@dataclass
class S3Server:
    """A running moto S3 server: its endpoint."""

    endpoint: str

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's standalone server over HTTP on loopback; AWS_* env vars point boto3 (and subprocesses) at it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    wait_for_port(port)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in [*AWS_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(AWS_ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        yield S3Server(endpoint)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the moto server."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


def worker_env(redis_url: str, **extra: str) -> dict[str, str]:
    """Environment for a worker subprocess: this one's, plus Redis and fast heartbeats."""
    env = dict(os.environ, SLUICE_REDIS_URL=redis_url, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def start_worker(
    model: Path,
    redis_url: str,
    log: Path,
    *args: str,
    dtype: str = "float32",
    device: str = "cpu",
    **env: str,
) -> subprocess.Popen:
    """A `python -m worker` process (by default float32 on cpu, for tiny test models), logging to log."""
    cmd = [sys.executable, "-m", "sluice.worker", "--model", str(model), "--dtype", dtype, "--device", device,
           *args]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=worker_env(redis_url, **env), stdout=out, stderr=subprocess.STDOUT)


def stop_worker(process: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM a worker and wait for it (SIGKILL if it will not go); return its exit code."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
