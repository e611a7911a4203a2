"""Train the bundled pair: a BPE tokenizer, the sluice-tiny target and its distilled sluice-tiny-draft.

Usage: python models/train.py [--out models]   (about 20 minutes on 2 CPU cores; fixed seeds)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from corpus import encode_stream, load_texts, split
from evaluate import heldout_loss
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SEED = 1234
VOCAB_SIZE = 8192
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}.\n{{ m['content'] | trim }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant.\n{% endif %}"
)


@dataclass(slots=True)
class TrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    distill_weight: float = 0.0


TARGET = TrainConfig(steps=240, batch_size=8, seq_len=256, lr=3e-3, warmup=20)
DRAFT = TrainConfig(steps=100, batch_size=8, seq_len=256, lr=2e-3, warmup=10, distill_weight=0.8)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def build_tokenizer(train_texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE (ids 0-3 unk/bos/eos/pad); encoding prepends <s>, like Llama."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = TARGET.seq_len
    return fast


def sample_batch(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator, bos: int) -> torch.Tensor:
    """batch_size random windows of seq_len tokens, each starting with <s>."""
    starts = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=gen)
    body = torch.stack([stream[s : s + cfg.seq_len - 1] for s in starts.tolist()])
    return torch.cat([torch.full((cfg.batch_size, 1), bos), body], dim=1)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def llama_config(tokenizer: PreTrainedTokenizerFast, layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=TARGET.seq_len,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def draft_from_target(target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A one-layer draft initialised from the target's embeddings, first layer and final norm."""
    draft = LlamaForCausalLM(llama_config(tokenizer, layers=1))
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.tie_weights()
    return draft


def loss_fn(model: LlamaForCausalLM, batch: torch.Tensor, cfg: TrainConfig, teacher=None) -> torch.Tensor:
    """Next-token cross entropy, mixed with KL to the teacher's distribution when distilling."""
    logits = model(input_ids=batch).logits[:, :-1].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    if teacher is None:
        return ce
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(input_ids=batch).logits[:, :-1].float(), dim=-1)
    kl = F.kl_div(F.log_softmax(logits, dim=-1), t_logp, log_target=True, reduction="none").sum(-1).mean()
    return cfg.distill_weight * kl + (1 - cfg.distill_weight) * ce


def train(model, stream, cfg: TrainConfig, bos: int, name: str, teacher=None) -> list[dict]:
    """AdamW with bf16 autocast for cfg.steps; returns the loss log."""
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    log, start = [], time.time()
    model.train()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, sample_batch(stream, cfg, gen, bos), cfg, teacher)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == cfg.steps - 1:
            log.append(
                {"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - start, 1)}
            )
            print(f"[{name}] {log[-1]}", flush=True)
    model.eval()
    return log


def save(model: LlamaForCausalLM, tokenizer, out: Path, meta: dict) -> None:
    """An ordinary HF checkpoint in bf16: config, safetensors, tokenizer, generation config, training log."""
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    ).save_pretrained(out)
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    model.float()


def train_target(tokenizer, train_ids, heldout_ids, out: Path, meta: dict) -> LlamaForCausalLM:
    """Stage 1: the six-layer target from scratch on the corpus."""
    seed_everything(SEED)
    target = LlamaForCausalLM(llama_config(tokenizer, layers=6))
    start = time.time()
    log = train(target, train_ids, TARGET, tokenizer.bos_token_id, "target")
    seconds = round(time.time() - start, 1)
    loss = heldout_loss(target, heldout_ids, TARGET.seq_len, tokenizer.bos_token_id, max_windows=64)
    print(f"target held-out loss {loss:.4f} ppl {math.exp(loss):.2f}", flush=True)
    save(target, tokenizer, out, {**meta, "config": asdict(TARGET), "log": log, "train_seconds": seconds})
    return target


def train_draft(target, tokenizer, train_ids, heldout_ids, out: Path, meta: dict) -> None:
    """Stage 2: the one-layer draft, initialised from the target and distilled from it."""
    seed_everything(SEED + 1)
    draft = draft_from_target(target, tokenizer)
    target.to(torch.bfloat16).requires_grad_(False)
    start = time.time()
    log = train(draft, train_ids, DRAFT, tokenizer.bos_token_id, "draft", teacher=target)
    seconds = round(time.time() - start, 1)
    loss = heldout_loss(draft, heldout_ids, DRAFT.seq_len, tokenizer.bos_token_id, max_windows=64)
    print(f"draft held-out loss {loss:.4f} ppl {math.exp(loss):.2f}", flush=True)
    save(draft, tokenizer, out, {**meta, "config": asdict(DRAFT), "log": log, "train_seconds": seconds})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument(
        "--stage",
        choices=["all", "target", "draft"],
        default="all",
        help="draft: reuse OUT/sluice-tiny (tokenizer and target) and train only the draft",
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    seed_everything(SEED)
    t0 = time.time()
    train_texts, heldout_texts = split(load_texts())
    if args.stage == "draft":
        tokenizer = AutoTokenizer.from_pretrained(args.out / "sluice-tiny")
    else:
        tokenizer = build_tokenizer(train_texts)
    train_ids, heldout_ids = encode_stream(tokenizer, train_texts), encode_stream(tokenizer, heldout_texts)
    print(f"tokens: train {len(train_ids)}, held-out {len(heldout_ids)}", flush=True)
    meta = {"seed": SEED, "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids)}
    if args.stage == "draft":
        target = LlamaForCausalLM.from_pretrained(args.out / "sluice-tiny", dtype=torch.float32)
    else:
        target = train_target(tokenizer, train_ids, heldout_ids, args.out / "sluice-tiny", meta)
    if args.stage != "target":
        train_draft(target, tokenizer, train_ids, heldout_ids, args.out / "sluice-tiny-draft", meta)
    print(f"total wall time {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
