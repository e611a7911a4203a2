"""A live `sluice serve` (uvicorn on a free port) and a real worker on the bundled model, for server tests."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from sluice.producer.server.keys import KeyStore
from tests.services import RedisServer, free_port, start_worker, stop_worker, worker_env

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sluice-tiny"
SLUICE = Path(sys.executable).parent / "sluice"
WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"sluice-server-tests-signing-key!!").decode()


@dataclass
class Stack:
    """The running server and worker and what tests need to reach them."""

    url: str
    redis_url: str
    keys: KeyStore
    tmp: Path
    metrics_url: str | None = None
    secrets: list[str] = field(default_factory=list)

    def key(self, project: str) -> str:
        secret = self.keys.create(project)[1]
        self.secrets.append(secret)
        return secret

    def openai(self, secret: str | None):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=secret or "unset", max_retries=0, timeout=60)


def start_server(
    redis_url: str, tmp: Path, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """`sluice serve` on a free port, logging to tmp/server.log; returns the process and its base URL."""
    port = free_port()
    if env is None:
        env = worker_env(
            redis_url, SLUICE_OUTPUT_URL=tmp.as_uri(), SLUICE_SHARD_SIZE="4", SLUICE_WEBHOOK_ALLOW="127.0.0.1"
        )
    cmd = [str(SLUICE), "serve", "--port", str(port), *args]
    with open(tmp / "server.log", "ab") as log:
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz", 60, process)
    return process, url


def wait_http(url: str, timeout: float, process: subprocess.Popen | None = None) -> requests.Response:
    """Poll url until it answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} answered")
        try:
            response = requests.get(url, timeout=2)
            if response.status_code == 200:
                return response
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout} s")


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory) -> Iterator[Stack]:
    """A server (upload limits 1 MB / 200 requests) and one worker on models/sluice-tiny, for a module."""
    redis_server.client().flushall()
    tmp = tmp_path_factory.mktemp("serve")
    metrics_port = free_port()
    server, url = start_server(
        redis_server.url, tmp, "--max-file-mb", "1", "--max-file-requests", "200", "--log-format", "json"
    )
    worker = start_worker(
        MODEL,
        redis_server.url,
        tmp / "worker.log",
        "--max-num-seqs",
        "8",
        "--metrics-port",
        str(metrics_port),
        "--log-format",
        "json",
        SLUICE_WEBHOOK_ALLOW="127.0.0.1",
        SLUICE_WEBHOOK_SECRET=WEBHOOK_SECRET,
    )
    try:
        keys = KeyStore(redis_server.client())
        yield Stack(url, redis_server.url, keys, tmp, f"http://127.0.0.1:{metrics_port}", [WEBHOOK_SECRET])
    finally:
        stop_worker(worker)
        stop_worker(server)


def jsonl(lines: list[dict]) -> io.BytesIO:
    """An in-memory JSONL upload."""
    data = io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())
    data.name = "input.jsonl"
    return data


def completion(i: int, max_tokens: int = 8, **body) -> dict:
    body = {"prompt": f"To be, or not {i}", "max_tokens": max_tokens, "temperature": 0, **body}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}


def wait_status(client, batch_id: str, statuses: set[str], timeout: float = 180):
    """Poll batches.retrieve until the batch reaches one of statuses."""
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if time.monotonic() > deadline:
            pytest.fail(f"batch {batch_id} still {batch.status} after {timeout} s")
        time.sleep(0.3)
