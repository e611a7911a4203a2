"""Held-out perplexity of the bundled pair and the draft's greedy acceptance rate at k=4 (transformers only).

Usage: python models/evaluate.py [--target models/sluice-tiny] [--draft models/sluice-tiny-draft]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from corpus import encode_stream, load_texts, split
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).parent


@torch.no_grad()
def heldout_loss(
    model, stream: torch.Tensor, seq_len: int, bos: int, max_windows: int | None = None
) -> float:
    """Mean next-token loss over consecutive held-out windows of seq_len tokens, each starting with <s>."""
    step = seq_len - 1
    count = (len(stream) - 1) // step if max_windows is None else min(max_windows, (len(stream) - 1) // step)
    windows = stream[: count * step].view(count, step)
    batches = torch.cat([torch.full((count, 1), bos), windows], dim=1).split(8)
    total = 0.0
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=model.dtype == torch.bfloat16):
            total += model(input_ids=batch, labels=batch).loss.float().item() * len(batch)
    return total / count


@torch.no_grad()
def greedy_argmax(model, ids: list[int], last: int = 1) -> list[int]:
    """The model's greedy next token after each of the last `last` prefixes of ids."""
    return model(input_ids=torch.tensor([ids]), logits_to_keep=last).logits[0].argmax(-1).tolist()


@torch.no_grad()
def speculate(target, draft, prompt: list[int], k: int, new_tokens: int) -> tuple[int, int]:
    """Greedy speculative decoding of one prompt; returns (accepted, proposed) draft tokens."""
    ids, accepted, proposed = list(prompt), 0, 0
    while len(ids) - len(prompt) < new_tokens:
        guess = list(ids)
        for _ in range(k):
            guess.append(greedy_argmax(draft, guess)[-1])
        verdict = greedy_argmax(target, guess, last=k + 1)
        n = next((i for i in range(k) if guess[len(ids) + i] != verdict[i]), k)
        ids += guess[len(ids) : len(ids) + n] + [verdict[n]]
        accepted, proposed = accepted + n, proposed + k
    return accepted, proposed


def heldout_prompts(stream: torch.Tensor, bos: int, count: int, length: int) -> list[list[int]]:
    """count prompts of length tokens (after <s>) spread evenly over the held-out stream."""
    stride = (len(stream) - length) // count
    return [[bos, *stream[i * stride : i * stride + length].tolist()] for i in range(count)]


def acceptance(target, draft, prompts: list[list[int]], k: int = 4, new_tokens: int = 32) -> dict:
    """Acceptance rate = accepted / proposed draft tokens over all prompts; also mean accepted per step."""
    accepted = proposed = 0
    for i, prompt in enumerate(prompts):
        a, p = speculate(target, draft, prompt, k, new_tokens)
        accepted, proposed = accepted + a, proposed + p
        if (i + 1) % 25 == 0:
            print(f"acceptance after {i + 1} prompts: {accepted / proposed:.3f}", flush=True)
    return {
        "k": k,
        "prompts": len(prompts),
        "accepted": accepted,
        "proposed": proposed,
        "acceptance_rate": round(accepted / proposed, 4),
        "mean_accepted_per_step": round(k * accepted / proposed, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", type=Path, default=HERE / "sluice-tiny")
    parser.add_argument("--draft", type=Path, default=HERE / "sluice-tiny-draft")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--out", type=Path, default=HERE / "eval.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    stream = encode_stream(tokenizer, split(load_texts())[1])
    bos, seq_len = tokenizer.bos_token_id, tokenizer.model_max_length
    load = dict(dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(args.target, **load).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, **load).eval()
    report = {"heldout_tokens": len(stream), "seq_len": seq_len}
    for name, model in [("target", target), ("draft", draft)]:
        loss = heldout_loss(model, stream, seq_len, bos)
        report[name] = {
            "params": sum(p.numel() for p in model.parameters()),
            "heldout_loss": round(loss, 4),
            "heldout_ppl": round(math.exp(loss), 2),
        }
        print(name, report[name], flush=True)
    report["acceptance"] = acceptance(target, draft, heldout_prompts(stream, bos, args.prompts, 32))
    report["eval_seconds"] = round(time.time() - start, 1)
    print(json.dumps(report, indent=1))
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
