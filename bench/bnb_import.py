"""What bitsandbytes' import costs a quantized start: the engine as it is (LLM.int8() on CPU imports no
bitsandbytes; where bitsandbytes serves, a plain import) against importing it first, and whether a plain import
on a background thread hides it behind the engine's imports and a raw read of the checkpoint.

python bench/bnb_import.py CHECKPOINT [--rounds 3] [--modes engine,plain,thread,thread+read]

Each mode is a fresh process, modes alternated per round: process start -> LLM(CHECKPOINT) -> one token.
engine: whatever the engine imports itself; plain: `import bitsandbytes` first (its torch.compile wrappers
import dynamo and inductor); thread: that import on a thread started right after `import torch`, joined before
LLM(...); thread+read: the same, the main thread also reading the checkpoint's files meanwhile.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = """
import glob, json, os, sys, threading, time
def started():
    ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
import torch
mode, model = sys.argv[1], sys.argv[2]
if mode == "plain":
    import bitsandbytes
thread = threading.Thread(target=lambda: __import__("bitsandbytes")) if mode.startswith("thread") else None
if thread:
    thread.start()
from sluice.engine import LLM, SamplingParams
if mode == "thread+read":
    buffer = bytearray(16 << 20)
    for path in glob.glob(model + "/*.safetensors"):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
if thread:
    thread.join()
llm = LLM(model, dtype="bfloat16", device="cpu", max_model_len=256, max_num_seqs=4)
llm.generate(["O Romeo"], SamplingParams(max_tokens=1, temperature=0), progress=False)
print(json.dumps({"ready": time.time() - started(), "dynamo": "torch._dynamo" in sys.modules,
                  "bnb": "bitsandbytes" in sys.modules}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("checkpoint")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="engine,plain,thread,thread+read")
    args = p.parse_args()
    runs: dict[str, list[float]] = {m: [] for m in args.modes.split(",")}
    for _ in range(args.rounds):
        for mode, times in runs.items():
            out = subprocess.run([sys.executable, "-c", CHILD, mode, args.checkpoint], cwd=tempfile.gettempdir(),
                                 capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            times.append(got["ready"])
            print(mode, f"{got['ready']:.2f} s", "bitsandbytes imported" if got["bnb"] else "",
                  "dynamo imported" if got["dynamo"] else "", flush=True)
    for mode, times in runs.items():
        print(f"{mode}: best {min(times):.2f} s, median {sorted(times)[len(times) // 2]:.2f} s")


if __name__ == "__main__":
    main()
