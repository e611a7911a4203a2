"""Small random-weight Hugging Face checkpoints built locally (no hub access) for tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

CORPUS = (
    "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
    "to be or not to be, that is the question. all that glitters is not gold. "
    "hello world, this is a tiny corpus for a tiny tokenizer used by tests. "
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation ! ? , . ; : ' \" ( ) [ ] { } - _ / "
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a fixed corpus; ids 0-3 are unk/bos/eos/pad."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CORPUS] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


ARCHS = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}


# Small settings of the architectures the generic path serves: windows and soft-caps that short prompts reach,
# few experts, non-default multipliers.
LAYERS_2X2 = ["sliding_attention", "full_attention"] * 2
GENERIC_OVERRIDES = {
    "gemma2": dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16, attn_logit_softcapping=20.0,
                   final_logit_softcapping=10.0, layer_types=LAYERS_2X2),
    "gemma3_text": dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16, layer_types=LAYERS_2X2),
    "phi3": dict(sliding_window=24),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16,
                      use_sliding_window=False, norm_topk_prob=True),
    "olmo2": dict(),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    "gpt_neox": dict(num_key_value_heads=None, rotary_pct=0.5),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=64, use_sliding_window=False),
    "starcoder2": dict(sliding_window=20),
}


def tiny_config(arch: str = "llama", vocab_size: int = 512, **overrides):
    """A small config of the given architecture (4 layers, GQA 4:2 heads)."""
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    if arch in ("qwen2", "qwen3"):
        kw["use_sliding_window"] = False
    if arch == "qwen3":
        kw["head_dim"] = 16
    if arch == "mistral":
        kw["sliding_window"] = None
    kw.update(GENERIC_OVERRIDES.get(arch, {}))
    kw.update(overrides)
    if arch not in ARCHS:  # any other model_type transformers knows, with its defaults (the generic path)
        return AutoConfig.for_model(arch, **kw)
    return ARCHS[arch](**kw)


def make_checkpoint(path: Path, arch: str = "llama", seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Save a random-weight model of `arch` plus tokenizer to `path` and return it."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(overrides.pop("vocab_size", 512))
    config = tiny_config(arch, vocab_size=len(tokenizer), **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and not torch.all(p == 1):
                continue
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size=overrides.get("max_shard_size", "50MB"))
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(path)
    return Path(path)


# Qwen2-VL: the special tokens of its chat template, and a template rendering image parts as Qwen2-VL's does.
QWEN2_VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
QWEN2_VL_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' or p['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_qwen2_vl_checkpoint(path: Path, seed: int = 0, dtype=torch.float32, vision: dict | None = None,
                             **text_overrides) -> Path:
    """A tiny random Qwen2-VL (2-layer text, 2-block vision tower), its tokenizer and a
    Qwen2VLImageProcessorPil preprocessor_config.json whose pixel bounds make an image at most 16 tokens."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_VL_SPECIALS})
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    start, end, pad = tokenizer.convert_tokens_to_ids(QWEN2_VL_SPECIALS)
    text = dict(vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    text.update(text_overrides)
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, mlp_ratio=2, in_channels=3) | (vision or {})
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                           vision_start_token_id=start, vision_end_token_id=end, video_token_id=pad + 1,
                           tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 1:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(path)
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14,
                                         merge_size=2, temporal_patch_size=2)
    processor.save_pretrained(path)
    return path
