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
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=4.0),
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


# Encoders: (config class, special tokens [cls, sep, pad, unk], pair template) per family.
ENCODER_FAMILIES = {
    "bert": ("BertConfig", ["[CLS]", "[SEP]", "[PAD]", "[UNK]"], "$A:0 [SEP]:0 $B:1 [SEP]:1"),
    "roberta": ("RobertaConfig", ["<s>", "</s>", "<pad>", "<unk>"], "$A:0 </s>:0 </s>:0 $B:0 </s>:0"),
    "xlm-roberta": ("XLMRobertaConfig", ["<s>", "</s>", "<pad>", "<unk>"], "$A:0 </s>:0 </s>:0 $B:0 </s>:0"),
}


def build_encoder_tokenizer(family: str, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with an encoder's specials: <cls> A <sep> for one text, the family's pair
    template (BERT: token types 0 then 1) for two."""
    from tokenizers import processors

    cls, sep, pad, unk = specials = ENCODER_FAMILIES[family][1]
    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 " + ENCODER_FAMILIES[family][2],
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, cls_token=cls, sep_token=sep, pad_token=pad,
                                   unk_token=unk)


def make_encoder_checkpoint(path: Path, family: str = "bert", num_labels: int = 0, seed: int = 0,
                            **overrides) -> Path:
    """Save a random-weight encoder of `family` (bert, roberta, xlm-roberta) plus tokenizer: the bare model,
    or with num_labels a ...ForSequenceClassification; every norm weight and bias perturbed."""
    import transformers

    torch.manual_seed(seed)
    tokenizer = build_encoder_tokenizer(family)
    pad = tokenizer.pad_token_id
    roberta = family != "bert"
    kw = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=96 + (pad + 1 if roberta else 0),
              pad_token_id=pad, type_vocab_size=1 if roberta else 2, hidden_act="gelu")
    if num_labels:
        kw |= dict(num_labels=num_labels, id2label={i: f"label_{i}" for i in range(num_labels)},
                   label2id={f"label_{i}": i for i in range(num_labels)})
    config = getattr(transformers, ENCODER_FAMILIES[family][0])(**(kw | overrides))
    auto = transformers.AutoModelForSequenceClassification if num_labels else transformers.AutoModel
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def sentence_transformers_files(folder: Path, mode: str, normalize: bool = True,
                                max_seq_length: int | None = None) -> Path:
    """Write sentence-transformers' modules.json (Transformer, Pooling by `mode`, Normalize if asked),
    1_Pooling/config.json and sentence_bert_config.json into a checkpoint folder."""
    import json

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": 64, mode: True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return folder


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
