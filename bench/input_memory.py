"""Peak RSS growth of validating, or submitting, a generated JSONL input (default 50 MiB).

python bench/input_memory.py validate|submit [--mib 50]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_input(path: Path, mib: int) -> int:
    """A JSONL file of about mib MiB of completion requests; returns the line count."""
    n = 0
    with path.open("w") as f:
        while f.tell() < mib * 2**20:
            body = {"prompt": "word " * 40, "max_tokens": 16, "temperature": 0.7}
            f.write(
                json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/completions", "body": body})
            )
            f.write("\n")
            n += 1
    return n


def local_redis() -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [shutil.which("redis-server"), "--port", str(port), "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return f"redis://127.0.0.1:{port}/0", process


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("step", choices=["validate", "submit"])
    parser.add_argument("--mib", type=int, default=50)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    path = tmp / "in.jsonl"
    write_input(path, args.mib)
    os.environ["SLUICE_OUTPUT_ROOTS"] = tmp.as_uri()
    os.environ.setdefault("SLUICE_MAX_LINES", "10000000")  # the sizes here pass the 50,000-line default
    from sluice.contract.settings import Settings
    from sluice.producer.client import Client
    from sluice.producer.validation import input_lines, validate_lines

    before = peak_mib()
    if args.step == "validate":
        count = len(validate_lines(input_lines(str(path), Settings()), Settings()).requests)
    else:
        url, process = local_redis()
        count = Client(url).submit_batch(str(path), output=tmp.as_uri()).request_counts.total
        process.kill()
    size = path.stat().st_size / 2**20
    print(f"{args.step}: {size:.0f} MiB input, {count} requests, peak RSS +{peak_mib() - before:.0f} MiB")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
