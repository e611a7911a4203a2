"""The bundled pair (models/sluice-tiny, models/sluice-tiny-draft): our engine and transformers agree token
for token."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sluice.engine import LLM, SamplingParams

MODELS = Path(__file__).resolve().parent.parent / "models"
PAIR = ["sluice-tiny", "sluice-tiny-draft"]
PROMPTS = [
    "Ham.\nTo be, or not to be,",
    "Enter the KING and QUEEN.\n\nKing.\nMy lord,",
    "O Romeo, Romeo!",
    "Speak",
]
MAX_TOKENS = 24


@cache
def engine_llm(path: Path) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", seed=0)


def hf_greedy(path: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module", params=PAIR)
def bundled(request) -> Path:
    return MODELS / request.param


def test_checkpoint_files_and_sizes(bundled):
    """Ordinary HF folders in bf16, Llama architecture, one shared tokenizer; the pair stays under 60 MB."""
    for name in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ]:
        assert (bundled / name).is_file(), name
    config = json.loads((bundled / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert (bundled / "tokenizer.json").read_bytes() == (
        MODELS / "sluice-tiny" / "tokenizer.json"
    ).read_bytes()
    total = sum((MODELS / p / "model.safetensors").stat().st_size for p in PAIR)
    assert total < 60e6


def test_engine_matches_transformers_greedy(bundled):
    """float32 on CPU: the engine's greedy tokens equal transformers' for every prompt of one batch."""
    llm = engine_llm(bundled)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, progress=False)
    expected = hf_greedy(bundled, [o.prompt_token_ids for o in outs])
    assert [o.token_ids for o in outs] == expected
    assert all(o.text.strip() for o in outs)


def test_chat_template_and_bos():
    """Prompts start with <s>; the chat template renders a play-style dialogue ending in the reply's cue."""
    tok = AutoTokenizer.from_pretrained(MODELS / "sluice-tiny")
    assert tok("Speak")["input_ids"][0] == tok.bos_token_id
    messages = [{"role": "user", "content": "Who's there?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s>User.\nWho's there?\n\nAssistant.\n"
    ids = engine_llm(MODELS / "sluice-tiny").encode_chat(messages)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
