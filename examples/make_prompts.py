"""Write examples/prompts.jsonl and examples/chats.jsonl: 300 deterministic OpenAI-batch requests for the
bundled model, completions and chats in a file each (a batch's lines all name one url).

Usage: python examples/make_prompts.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPEAKERS = [
    "Ham.",
    "Hor.",
    "King.",
    "Queen.",
    "Rom.",
    "Jul.",
    "Nurse.",
    "Macb.",
    "Lady M.",
    "Lear.",
    "Oth.",
    "Iago.",
    "Des.",
    "Por.",
    "Bass.",
    "Viola.",
    "Pros.",
    "Ariel.",
    "Bru.",
    "Cas.",
]
OPENINGS = [
    "My lord, I",
    "What news from",
    "O gentle",
    "Now is the",
    "Good morrow,",
    "Speak, I pray thee,",
    "I pray you, sir,",
    "Thou art",
    "Come, let us",
    "Alas, poor",
    "Why, then",
    "Is this the",
    "Farewell;",
]
QUESTIONS = [
    "Speak, friend.",
    "What news from the court?",
    "Who goes there?",
    "How fares the king?",
    "Where is thy master?",
    "Shall we to the feast tonight?",
    "What say you of love?",
    "Why dost thou weep?",
    "Tell me of the battle.",
    "Is the queen well?",
]
PERSONAS = [
    "",
    "You are a courtier of Denmark.",
    "You are a soldier on the watch.",
    "You are a fool in motley.",
]
NUM_COMPLETIONS, NUM_CHATS = 260, 40


def sampling(i: int) -> dict:
    """Every fifth request greedy, the rest sampled with a per-request seed (reproducible, less
    repetitive)."""
    return {"temperature": 0} if i % 5 == 0 else {"temperature": 0.7, "top_p": 0.9, "seed": i}


def completion(i: int, prompt: str) -> dict:
    body = {"model": "sluice-tiny", "prompt": prompt, "max_tokens": 48, **sampling(i)}
    return {"custom_id": f"req-{i:04d}", "method": "POST", "url": "/v1/completions", "body": body}


def chat(i: int, persona: str, question: str) -> dict:
    messages = ([{"role": "system", "content": persona}] if persona else []) + [
        {"role": "user", "content": question}
    ]
    body = {
        "model": "sluice-tiny",
        "messages": messages,
        "max_tokens": 48,
        **sampling(i),
        "stop": ["\n\n"],
    }
    return {"custom_id": f"req-{i:04d}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def files() -> dict[str, list[dict]]:
    """Scene openings as completions (prompts.jsonl), short conversations through the chat template
    (chats.jsonl)."""
    rng = random.Random(7)
    prompts = [f"{s}\n{o}" for s in SPEAKERS for o in OPENINGS]
    rng.shuffle(prompts)
    completions = [completion(i + 1, p) for i, p in enumerate(prompts[:NUM_COMPLETIONS])]
    pairs = [(p, q) for p in PERSONAS for q in QUESTIONS][:NUM_CHATS]
    chats = [chat(NUM_COMPLETIONS + i + 1, p, q) for i, (p, q) in enumerate(pairs)]
    return {"prompts.jsonl": completions, "chats.jsonl": chats}


def main() -> None:
    for name, lines in files().items():
        path = Path(__file__).parent / name
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
