"""README's server quick start, run as written (its bash block, then its Python block) on free ports: Redis, a
worker on the bundled model on CPU, the server, a key, and the `openai` package's round trip."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.server_stack import wait_http
from tests.services import free_port

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### Quick start on one machine"


def quickstart_blocks() -> tuple[str, str]:
    """The bash and Python blocks of README's server quick start."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n### ", len(SECTION))]
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return bash, python


def stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + 30
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_readme_server_quick_start(tmp_path):
    bash, python = quickstart_blocks()
    redis_port, http_port = free_port(), free_port()
    bash = bash.replace("6379", str(redis_port)).replace("/tmp/sluice-", f"{tmp_path}/sluice-")
    bash = bash.replace("--port 8000", f"--port {http_port}")
    python = python.replace("127.0.0.1:8000", f"127.0.0.1:{http_port}")
    assert "sluice worker --model models/sluice-tiny --device cpu" in bash and "openai" in python
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(XDG_DATA_HOME=str(tmp_path / "data"), OMP_NUM_THREADS="1")  # keep the test out of ~/.local
    script = f"set -e\n{bash}\necho \"$SLUICE_KEY\" > {tmp_path}/key\njobs -p > {tmp_path}/pids\n"
    setup = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()] if (tmp_path / "pids").exists() else []
    try:
        assert setup.returncode == 0, setup.stderr
        assert len(pids) == 3, pids
        key = (tmp_path / "key").read_text().strip()
        assert key.startswith("sk-sluice-")
        wait_http(f"http://127.0.0.1:{http_port}/healthz", 60)
        run = subprocess.run([sys.executable, "-c", python], cwd=ROOT, env={**env, "SLUICE_KEY": key},
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stderr + (tmp_path / "sluice-worker.log").read_text()[-3000:]
        status, *outputs = run.stdout.strip().splitlines()
        assert status.startswith("completed") and "completed=2" in status, run.stdout
        assert sorted(json.loads(line)["custom_id"] for line in outputs) == ["a", "b"]
        results = tmp_path / "data" / "sluice" / "results"
        assert list(results.glob("batch_*/output.jsonl")), "the default output"
    finally:
        stop(pids)
