"""Decode tok/s of llama.cpp (`llama-batched-bench`) vs our engine on the same weights, shapes and threads.

python bench/llamacpp.py [--batches 1,8,32,64] [--rounds 3] [--modes bf16,int8,int4] [--prompt 128]
    [--gen 128] [--best-of]

Builds llama.cpp once per ISA tier from the llama-cpp-python sdist (its vendored source, GGML_NATIVE=OFF plus
the flags of the tier our kernels run, kernels.cpu_isa, so both sides use the same instructions; AMX off: its
AMX path crashes on our VMs) into ~/.cache/sluice-llamacpp/build-<tier>; for an AVX2 comparison on any host
run it with SLUICE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2. It converts the ~125M
benchmark model to GGUF bf16/q8_0/q4_0 with the vendored convert_hf_to_gguf.py and llama-quantize, then runs
llama.cpp and `Engine` back to back at each batch size of each mode, every round, on B sequences x 128 random
prompt tokens, 128 generated tokens. Both report decode tok/s only (B * 128 / time of the generation steps);
each cell is the median of the rounds (--best-of: their best).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
from common import base_parser, bench_model, record, table

from sluice.engine import LLM, SamplingParams
from sluice.kernels import cpp_build, cpu_isa

CACHE = Path(os.environ.get("SLUICE_LLAMACPP_CACHE", Path.home() / ".cache" / "sluice-llamacpp"))
TARGETS = ("llama-batched-bench", "llama-quantize")
CMAKE_BASE = [  # no network, no server, static binaries; ISA flags per tier (TIER_CMAKE), never GGML_NATIVE
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]
AVX2_CMAKE = ["-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
              "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
              "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX_VNNI=OFF"]
# llama.cpp built for the same ISA tier as our kernels (kernels.cpu_isa); AMX stays off (its AMX path crashes
# on our VMs), so the amx tier's llama.cpp is the avx512_bf16 build
TIER_CMAKE = {
    "avx2": AVX2_CMAKE,
    "avx512": [*AVX2_CMAKE[:5], "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=OFF",
               "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX_VNNI=OFF"],
    "avx512_bf16": [*AVX2_CMAKE[:5], "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
                    "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX_VNNI=OFF"],
}
TIER_CMAKE["amx"] = TIER_CMAKE["avx512_bf16"]


def cmake_flags(tier: str) -> list[str]:
    """llama.cpp's CMake flags for an ISA tier (the avx512 tier's VNNI only where the CPU has it)."""
    flags = [*CMAKE_BASE, *TIER_CMAKE[tier]]
    if tier == "avx512" and "avx512_vnni" not in cpu_isa.cpu_flags():
        flags = [f.replace("GGML_AVX512_VNNI=ON", "GGML_AVX512_VNNI=OFF") for f in flags]
    return flags


# (our quantization= value, llama.cpp GGUF type) per mode
MODES = {"bf16": (None, "bf16"), "int8": ("int8_weight_only", "q8_0"), "int4": ("int4_weight_only", "q4_0")}
PROMPT, GEN = 128, 128  # defaults; --prompt / --gen override them


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def source_dir() -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist, downloaded through pip once."""
    found = sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    CACHE.mkdir(parents=True, exist_ok=True)
    sh([sys.executable, "-m", "pip", "download", "llama-cpp-python", "--no-deps", "--no-binary", ":all:",
        "-d", str(CACHE)])
    with tarfile.open(sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))[-1]) as tar:
        tar.extractall(CACHE, filter="data")
    return sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


def build(tier: str | None = None) -> Path:
    """The build folder for `tier` (default: the chosen one, SLUICE_CPU_ISA capping it) holding
    bin/llama-batched-bench and bin/llama-quantize (built when missing)."""
    tier = cpu_isa.tier() if tier is None else tier
    out = CACHE / f"build-{tier}"
    if all((out / "bin" / t).is_file() for t in TARGETS):
        return out
    src = source_dir()
    sh(["cmake", "-S", str(src), "-B", str(out), *cmake_flags(tier)])
    sh(["cmake", "--build", str(out), "--target", *TARGETS, "-j", str(os.cpu_count() or 2)])
    return out


CONVERT = """
import os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1])); sys.argv = sys.argv[1:]
import convert_hf_to_gguf as c
from conversion.base import TextModel
from conversion.llama import LlamaModel
# our test byte-level BPE tokenizer: no sentencepiece model and no registered pre-tokenizer hash
LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
TextModel.get_vocab_base_pre = lambda self, tok: "gpt-2"
c.main()
"""


def gguf(model: Path, kind: str, bin_dir: Path) -> Path:
    """The benchmark model as GGUF of the given type (bf16, q8_0 straight from the converter, q4_0
    quantized)."""
    out = CACHE / f"{model.name}-{kind}.gguf"
    if out.is_file():
        return out
    src = source_dir()
    if kind == "q4_0":
        sh([str(bin_dir / "llama-quantize"), str(gguf(model, "bf16", bin_dir)), str(out), "q4_0"])
        return out
    # -P: the checkout's folder off sys.path (its kernels/ would shadow the converter's `kernels` import)
    sh([sys.executable, "-P", "-c", CONVERT, str(src / "convert_hf_to_gguf.py"), str(model),
        "--outtype", kind, "--outfile", str(out)], env={**os.environ, "PYTHONPATH": str(src / "gguf-py")})
    return out


def llamacpp(bin_dir: Path, model: Path, batches: list[int], threads: int) -> dict[int, tuple[float, float]]:
    """llama-batched-bench's (decode tok/s (S_TG), prefill tok/s (S_PP)) per batch size."""
    ctx = max(batches) * (PROMPT + GEN) + 64
    res = subprocess.run(
        [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", str(ctx), "-b", "2048", "-ub", "512",
         "-npp", str(PROMPT), "-ntg", str(GEN), "-npl", ",".join(map(str, batches)), "-t", str(threads),
         "-tb", str(threads), "--output-format", "jsonl"],
        check=True, capture_output=True, text=True)
    rows = [json.loads(line[line.index('{"'):]) for line in res.stdout.splitlines() if '{"' in line]
    got = {r["pl"]: (r["speed_tg"], r["speed_pp"]) for r in rows}
    # its log lines may share a line with the JSON: say so rather than drop a row
    if set(got) != set(batches):
        raise RuntimeError(f"llama-batched-bench gave rows {sorted(got)} for {batches}: {res.stdout[-2000:]}")
    return got


def sluice(llm: LLM, batch: int, seed: int) -> tuple[float, float]:
    """Our (decode tok/s, prefill tok/s): B random 128-token prompts, the prefill steps timed, then 128 timed
    generation steps."""
    rng = random.Random(seed)
    engine = llm.engine
    params = SamplingParams(max_tokens=GEN + 1, temperature=0, ignore_eos=True)
    reqs = []
    for i in range(batch):
        rid = f"b{batch}-{seed}-{i}"
        engine.add_request(rid, [rng.randrange(4, 32000) for _ in range(PROMPT)], params)
        reqs.append(engine.requests[rid])
    t0 = time.perf_counter()
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    dt = time.perf_counter() - t
    return sum(len(r.output_token_ids) - 1 for r in reqs) / dt, batch * PROMPT / (t - t0)


def load(model: Path, mode: str, batches: list[int], **engine_args) -> LLM:
    llm = LLM(str(model), dtype="bfloat16", device="cpu", quantization=MODES[mode][0],
              max_num_seqs=max(batches), max_model_len=PROMPT + GEN + 16, enable_prefix_caching=False,
              **engine_args)
    sluice(llm, 2, seed=-1)  # warm-up: kernels built, allocator primed
    arena = getattr(llm.engine.model, "weight_arena", None)
    if arena is not None:
        arena.settled.wait()  # the weights in huge pages, as in a worker's steady state
    return llm


def _set_shape(prompt: int, gen: int) -> None:
    global PROMPT, GEN
    PROMPT, GEN = prompt, gen


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="bf16,int8,int4")
    p.add_argument("--prompt", type=int, default=PROMPT)
    p.add_argument("--gen", type=int, default=GEN)
    p.add_argument("--best-of", action="store_true", help="report each cell's best round, not the median")
    args = p.parse_args()
    _set_shape(args.prompt, args.gen)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    model = bench_model()
    bin_dir = build() / "bin"
    ggufs = {m: gguf(model, MODES[m][1], bin_dir) for m in modes}
    llms = {m: load(model, m, batches) for m in modes}
    seen: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for m in modes:
            # llama.cpp and ours back to back at each shape: the host's load moves by the minute
            for b in batches:
                for pl, tps in llamacpp(bin_dir, ggufs[m], [b], args.threads).items():
                    seen.setdefault(("llama", m, pl), []).append(tps)
                seen.setdefault(("sluice", m, b), []).append(sluice(llms[m], b, seed=r))
            print(r, m, {k: v[-1] for k, v in seen.items() if k[1] == m}, flush=True)
    best = summarize(seen, best_of=args.best_of)
    fallback = "" if cpp_build.enabled() else ", C++ kernels off"
    record(f"llama.cpp vs Sluice on CPU, {cpu_isa.tier()} tier{fallback} (decode and prefill tok/s)",
           report(best, modes, batches, args))


def summarize(seen: dict[tuple, list[tuple[float, float]]], best_of: bool = False
              ) -> dict[tuple, tuple[float, float]]:
    """Each key's (decode, prefill) speeds over the rounds: their medians, or with `best_of` their maxima."""
    pick = max if best_of else statistics.median
    return {key: (pick(d for d, _ in runs), pick(p for _, p in runs)) for key, runs in seen.items()}


def report(best, modes, batches, args) -> str:
    headers = ["B"]
    for m in modes:
        headers += [f"llama.cpp {MODES[m][1]}", f"Sluice {m}", "×"]
    if "bf16" in modes:
        headers += [f"Sluice {m} / Sluice bf16" for m in modes if m != "bf16"]
    rows = []
    for b in batches:
        for phase, label in ((0, b), (1, f"prefill {b}")):
            row: list = [label]
            for m in modes:
                ll, ours = best[("llama", m, b)][phase], best[("sluice", m, b)][phase]
                row += [ll, ours, ours / ll]
            if "bf16" in modes:
                bf16 = best[("sluice", "bf16", b)][phase]
                row += [best[("sluice", m, b)][phase] / bf16 for m in modes if m != "bf16"]
            rows.append(row)
    pick = "best" if args.best_of else "median"
    note = (f"\n\nRows `B`: decode tok/s (B x {GEN} generated tokens / generation time); rows "
            f"`prefill B`: prefill tok/s (B x {PROMPT} random prompt tokens / time to every sequence's first "
            f"token; llama.cpp's S_PP), {args.threads} threads, {pick} of {args.rounds} rounds (llama.cpp "
            "and ours back to back at each B), random ~125M Llama (hidden 768, 12 layers, 12/4 heads, inter "
            "2048, vocab 32000) from the same safetensors. llama.cpp: `llama-batched-bench` from the "
            "llama-cpp-python sdist's vendored source, built for the "
            f"{cpu_isa.tier()} tier as our kernels are (GGML_NATIVE=OFF, AMX off; torch's CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}). Sluice modes: "
            + ", ".join(f"{m} = quantization={MODES[m][0]!r}" for m in modes) + ".")
    return table(headers, rows) + note


if __name__ == "__main__":
    main()
