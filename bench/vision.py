"""Images in the continuous batch: the engine vs transformers' static batched generate on a random
Qwen2-VL, and the same image in every line against distinct images (the encoder cache).

python bench/vision.py [--images 64] [--new-tokens 32] [--hf-batch 16] [--rounds 3]

A random Qwen2-VL (text: hidden 256 x 4 layers; vision: 4 blocks of width 128) whose image processor keeps
images between 224x224 and 448x448 pixels (64 to 256 tokens each); images of 224 to 640 px with mixed aspect
ratios, one caption prompt each, greedy, fp32 on CPU. Runs, in one process:
1. --rounds rounds, each: transformers' `generate` over the requests in static batches of --hf-batch
   (left-padded; the model loaded once, before; its own tokenizer and image processor, timed), then a fresh
   engine over all of them; outputs compared token for token; median requests per second of each and the
   median of the rounds' speed-ups.
2. prefill only (max_tokens=1), --rounds rounds alternating 64 distinct images, one image in all 64 lines with
   prefix caching off, and with it on (the lines of later steps reuse the image's KV blocks): median prompt
   tokens per second, the encoder cache's count of images encoded, and whether the one-image runs' first
   tokens agree.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT  # noqa: F401  (puts the repository on the path)
from PIL import Image

from sluice.engine import LLM, SamplingParams

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|user|>{PAD} describe the image\n<|assistant|>"


def checkpoint() -> Path:
    """The bench's random Qwen2-VL, built once into the temp folder."""
    from transformers import Qwen2VLImageProcessorPil

    from tests.checkpoints import make_qwen2_vl_checkpoint

    path = Path(tempfile.gettempdir()) / "sluice-bench-qwen2-vl"
    if not (path / "config.json").is_file():
        make_qwen2_vl_checkpoint(path, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [4, 6, 6]},
                                 vision=dict(depth=4, embed_dim=128, num_heads=4, hidden_size=256))
        Qwen2VLImageProcessorPil(min_pixels=224 * 224, max_pixels=448 * 448, patch_size=14, merge_size=2,
                                 temporal_patch_size=2).save_pretrained(path)
    return path


def images(n: int, seed: int = 0) -> list[Image.Image]:
    """n smooth random images of 224 to 640 px per side."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w, h = rng.randint(224, 640), rng.randint(224, 640)
        small = torch.randint(0, 256, (1, 3, 8, 8), generator=g).float()
        big = torch.nn.functional.interpolate(small, size=(h, w), mode="bilinear").clamp(0, 255)
        out.append(Image.fromarray(big[0].permute(1, 2, 0).to(torch.uint8).numpy()))
    return out


def hf_model(path: Path, dtype: str = "float32"):
    """transformers' Qwen2-VL, its image processor and tokenizer, loaded once outside the timed runs."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model, AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def hf_prompt_ids(text: list[int], image_id: int, grids: torch.Tensor, merge: int) -> list[list[int]]:
    """The tokenized prompt once per image, its placeholder expanded to t*h*w / merge**2 image tokens."""
    slot = text.index(image_id)
    return [text[:slot] + [image_id] * (int(g.prod()) // merge**2) + text[slot + 1:] for g in grids]


def hf_generate(hf, imgs: list[Image.Image], new_tokens: int, batch: int) -> list[list[int]]:
    """transformers' greedy generate in static, left-padded batches (its own tokenizing and image
    preprocessing included): each request's new tokens."""
    model, proc, tokenizer = hf
    image_id = model.config.image_token_id
    text = tokenizer.encode(PROMPT)
    outs = []
    for i in range(0, len(imgs), batch):
        pixels = proc(images=imgs[i:i + batch], return_tensors="pt")
        ids = hf_prompt_ids(text, image_id, pixels["image_grid_thw"], proc.merge_size)
        width = max(map(len, ids))
        input_ids = torch.tensor([[3] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            gen = model.generate(
                input_ids=input_ids, attention_mask=mask, pixel_values=pixels["pixel_values"],
                image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(input_ids == image_id).int(),
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=3)
        outs += gen[:, width:].tolist()
    return outs


def prefill_rate(path: Path, imgs: list[Image.Image],
                 prefix_caching: bool) -> tuple[float, int, list[list[int]]]:
    """(prompt tokens per second, images encoded, first tokens) of prefilling one request per image."""
    llm = LLM(str(path), dtype="float32", device="cpu", enable_prefix_caching=prefix_caching)
    reqs = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in imgs]
    start = time.perf_counter()
    outs = llm.generate(reqs, SamplingParams(max_tokens=1, temperature=0), progress=False)
    seconds = time.perf_counter() - start
    tokens = [o.token_ids for o in outs]
    return sum(len(o.prompt_token_ids) for o in outs) / seconds, llm.stats()["images_encoded"], tokens


def prefill_table(path: Path, imgs: list[Image.Image], rounds: int) -> None:
    """Print the prefill rows: medians over rounds that alternate the three runs."""
    same = [imgs[0]] * len(imgs)
    runs = {"distinct": (imgs, False), "off": (same, False), "on": (same, True)}
    rates: dict[str, list[float]] = {k: [] for k in runs}
    encoded, firsts = {}, {}
    for _ in range(rounds):
        for key, (images, caching) in runs.items():
            rate, encoded[key], firsts[key] = prefill_rate(path, images, caching)
            rates[key].append(rate)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\n| prefill (max_tokens=1), median of {rounds} | prompt tokens/s | images encoded | vs distinct |"
          "\n|---|---|---|---|")
    n = len(imgs)
    print(f"| {n} distinct images | {med['distinct']:.0f} | {encoded['distinct']} | 1.00x |")
    for key, label in (("off", "prefix caching off"), ("on", "prefix caching on")):
        print(f"| one image in {n} lines, {label} | {med[key]:.0f} | {encoded[key]} | "
              f"{med[key] / med['distinct']:.2f}x |")
    print(f"one-image first tokens equal with and without prefix caching: {firsts['off'] == firsts['on']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both sides' dtype (bfloat16: greedy outputs may part where the two round apart)")
    args = p.parse_args()
    torch.manual_seed(0)
    path = checkpoint()
    imgs = images(args.images)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    reqs = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in imgs]
    hf, times, equal = hf_model(path, args.dtype), {"hf": [], "ours": []}, []
    for _ in range(args.rounds):  # alternated; a fresh engine each round (its caches start empty)
        llm = LLM(str(path), dtype=args.dtype, device="cpu")
        t = time.perf_counter()
        ref = hf_generate(hf, imgs, args.new_tokens, args.hf_batch)
        times["hf"].append(time.perf_counter() - t)
        t = time.perf_counter()
        outs = llm.generate(reqs, params, progress=False)
        times["ours"].append(time.perf_counter() - t)
        equal.append(sum(o.token_ids == r for o, r in zip(outs, ref, strict=True)))
        parted = [next(i for i, (a, b) in enumerate(zip(o.token_ids, r, strict=True)) if a != b)
                  for o, r in zip(outs, ref, strict=True) if o.token_ids != r]
    hf_s, ours_s = statistics.median(times["hf"]), statistics.median(times["ours"])
    ratio = statistics.median(h / o for h, o in zip(times["hf"], times["ours"], strict=True))
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    print(f"| system, median of {args.rounds} | seconds | requests/s | outputs equal |\n|---|---|---|---|")
    print(f"| transformers generate, static batches of {args.hf_batch} | {hf_s:.1f} | "
          f"{len(imgs) / hf_s:.2f} | - |")
    print(f"| sluice engine | {ours_s:.1f} | {len(imgs) / ours_s:.2f} | {min(equal)}/{len(imgs)} |")
    print(f"speed-up (median of the rounds' own) {ratio:.2f}x; prompt tokens {tokens}; "
          f"{args.dtype}; last round's unequal outputs part at new token {sorted(parted)}")
    prefill_table(path, imgs, args.rounds)


if __name__ == "__main__":
    main()
