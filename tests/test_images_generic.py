"""Vision-language families on the generic path (LLaVA with CLIP and SigLIP towers, Idefics3 with image
splitting): pixels, placeholder expansion, and greedy output against transformers' generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, GenerationConfig

from sluice.engine import LLM, RequestRejected, SamplingParams
from tests.checkpoints import build_tokenizer

GREEDY = SamplingParams(max_tokens=10, temperature=0)
IMAGE = "<image>"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOWERS = {
    "clip": dict(model_type="clip_vision_model", projection_dim=32),
    "siglip": dict(model_type="siglip_vision_model"),
}


def make_llava_checkpoint(path: Path, tower: str = "clip", strategy: str = "default", seed: int = 0) -> Path:
    """A tiny random LLaVA (2-layer Llama, 2-layer CLIP or SigLIP tower on 56x56 images, 14-pixel
    patches), its tokenizer with an <image> placeholder, and the tower's Pil image processor config."""
    from transformers import (
        CLIPImageProcessorPil,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipImageProcessorPil,
    )

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE]})
    tokenizer.chat_template = TEMPLATE
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=56, patch_size=14) | TOWERS[tower]
    image_id = tokenizer.convert_tokens_to_ids(IMAGE)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=image_id,
                         vision_feature_layer=-2, vision_feature_select_strategy=strategy,
                         projector_hidden_act="gelu", tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(path)
    if tower == "clip":
        processor = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    else:
        processor = SiglipImageProcessorPil(size={"height": 56, "width": 56})
    processor.save_pretrained(path)
    return Path(path)


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


def prompt(text: str, n_images: int) -> str:
    return f"<|user|>{text} " + " and ".join([IMAGE] * n_images) + " the fox\n<|assistant|>"


def mixed_requests() -> list[dict]:
    """One image, two images, text only, the first image again with other text."""
    a, b, c = noise_image(80, 80, 1), noise_image(60, 90, 2), noise_image(120, 50, 3)
    return [
        {"prompt": prompt("describe", 1), "multi_modal_data": {"image": a}},
        {"prompt": prompt("compare", 2), "multi_modal_data": {"image": [b, c]}},
        {"prompt": "<|user|>the quick brown fox jumps over\n<|assistant|>"},
        {"prompt": prompt("to be or not", 2), "multi_modal_data": {"image": [c, a]}},
    ]


def hf_greedy(path: Path, llm: LLM, requests: list[dict], max_new_tokens: int = 10) -> list[list[int]]:
    """transformers' greedy continuation of each request, its ids as our intake expanded them."""
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    images_of = AutoImageProcessor.from_pretrained(path)
    outs = []
    for req in requests:
        images = req.get("multi_modal_data", {}).get("image", [])
        images = images if isinstance(images, list) else [images]
        ids, _ = llm.engine.intake._multimodal(req)
        ii = torch.tensor([ids])
        inputs = {"input_ids": ii, "attention_mask": torch.ones_like(ii)}
        if images:
            inputs["pixel_values"] = images_of(images=images, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            gen = hf.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava-clip"))


@pytest.fixture(scope="module")
def llm(llava):
    return LLM(str(llava), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def reference(llava, llm):
    reqs = mixed_requests()
    return reqs, hf_greedy(llava, llm, reqs)


def test_llava_pixels_and_placeholders_follow_the_checkpoints_processor(llava, llm):
    images = [noise_image(80, 80, 1), noise_image(60, 90, 2)]
    ids, mm = llm.engine.intake._multimodal({"prompt": prompt("compare", 2),
                                             "multi_modal_data": {"image": images}})
    ref = AutoImageProcessor.from_pretrained(llava)(images=images, return_tensors="pt")
    assert type(AutoImageProcessor.from_pretrained(llava)).__name__ == "CLIPImageProcessorPil"
    assert torch.equal(torch.cat([i.pixel_values for i in mm.items]), ref["pixel_values"])
    image_id = llm.tokenizer.convert_tokens_to_ids(IMAGE)
    assert ids.count(image_id) == 2 * 16  # (56 / 14)^2 patches each, the class token dropped ("default")
    for item in mm.items:
        assert ids[item.offset:item.offset + item.length] == [image_id] * 16
        assert ids[item.offset + 16] != image_id
    assert llm.engine.model_config.architecture == "LlavaForConditionalGeneration"
    assert llm.engine.model_config.path == "generic"


def test_llava_vision_tower_matches_transformers(llava, llm):
    images = [noise_image(80, 80, 4), noise_image(70, 140, 5)]
    _, mm = llm.engine.intake._multimodal({"prompt": prompt("compare", 2),
                                           "multi_modal_data": {"image": images}})
    hf = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval()
    pixels = AutoImageProcessor.from_pretrained(llava)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = torch.cat(hf.get_image_features(pixel_values=pixels, return_dict=True).pooler_output)
        ours = llm.engine.model._encode(mm.items)
    torch.testing.assert_close(torch.cat([ours[i.content_hash] for i in mm.items]), ref)


def test_llava_greedy_matches_transformers_with_images_mixed_with_text(reference, llm):
    reqs, ref = reference
    encoded = llm.stats()["images_encoded"]
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert len({tuple(r) for r in ref}) > 2  # the images steer the output
    assert llm.stats()["images_encoded"] - encoded == 3  # image a twice, encoded once


def test_llava_greedy_matches_with_prefill_chunked_inside_images(llava, reference):
    reqs, ref = reference
    llm = LLM(str(llava), dtype="float32", device="cpu", max_num_batched_tokens=7,
              enable_prefix_caching=False)
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["images_encoded"] == 3  # each distinct image once, its tokens over several steps


def test_llava_greedy_matches_under_preemption(llava, reference):
    reqs, ref = reference
    llm = LLM(str(llava), dtype="float32", device="cpu", block_size=16)
    blocks = 6
    llm = LLM(str(llava), dtype="float32", device="cpu", block_size=16,
              kv_cache_memory_gb=blocks * llm.engine.kv_block_bytes / 1024**3)
    assert llm.engine.num_blocks == blocks
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("strategy", ["full", "default"])
def test_llava_with_siglip_tower_matches_transformers(tmp_path, strategy):
    path = make_llava_checkpoint(tmp_path, tower="siglip", strategy=strategy, seed=1)
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=9)
    reqs = mixed_requests()[:2]
    ids, _ = llm.engine.intake._multimodal(reqs[0])
    image_id = llm.tokenizer.convert_tokens_to_ids(IMAGE)
    assert ids.count(image_id) == 16 - (strategy == "default")  # no class token: "default" drops a patch
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == hf_greedy(path, llm, reqs)


def test_llava_images_salt_the_prefix_cache_and_are_encoded_once(llava, llm):
    same = noise_image(80, 80, 7)
    llm = LLM(str(llava), dtype="float32", device="cpu", block_size=4)
    reqs = [{"prompt": prompt("describe", 1), "multi_modal_data": {"image": same}} for _ in range(4)]
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert llm.stats()["images_encoded"] == 1 and llm.stats()["encoder_cache_hits"] >= 1
    assert len({tuple(o.token_ids) for o in outs}) == 1
    other = {"prompt": prompt("describe", 1), "multi_modal_data": {"image": noise_image(80, 80, 8)}}
    hits = llm.engine.block_manager.hits
    assert llm.generate([other], GREEDY, progress=False)[0].token_ids == hf_greedy(llava, llm, [other])[0]
    assert llm.engine.block_manager.hits == hits  # equal text, another image: no block shared
    llm.generate([reqs[0]], GREEDY, progress=False)
    assert llm.engine.block_manager.hits > hits


def test_llava_chat_and_bad_image_requests(llm, tiny_llama):
    image = noise_image(64, 64, 9)
    text = {"type": "text", "text": "describe "}
    chat = llm.chat([{"role": "user", "content": [text, {"type": "image_pil", "image_pil": image}]}], GREEDY,
                    progress=False)
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": [text, {"type": "image"}]}],
                                                 add_generation_prompt=True, tokenize=False)
    assert rendered.count(IMAGE) == 1
    direct = llm.generate({"prompt": rendered, "multi_modal_data": {"image": image}}, GREEDY, progress=False)
    assert chat[0].token_ids == direct[0].token_ids and chat[0].prompt_token_ids == direct[0].prompt_token_ids
    with pytest.raises(RequestRejected, match="1 image placeholder.*2 image"):
        llm.engine.add_request("a", {"prompt": prompt("x", 1), "multi_modal_data": {"image": [image, image]}})
    with pytest.raises(RequestRejected, match="must be a PIL.Image"):
        llm.engine.add_request("b", {"prompt": prompt("x", 1), "multi_modal_data": {"image": "cat.png"}})
    text_only = LLM(str(tiny_llama), dtype="float32", device="cpu")
    with pytest.raises(RequestRejected, match="takes no images"):
        text_only.engine.add_request("c", {"prompt": "hi", "multi_modal_data": {"image": image}})
    assert not llm.engine.has_unfinished()


IDEFICS3_MARKERS = ["<fake_token_around_image>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]


def make_idefics3_checkpoint(path: Path, seed: int = 0) -> Path:
    """A tiny random Idefics3 (2-layer Llama, 2-layer vision tower on 56x56 tiles, 4 image tokens a tile after
    the pixel shuffle), its tokenizer with Idefics3's image markers, and an image processor that splits an
    image into up to 2 x 2 tiles plus the global view."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE, *IDEFICS3_MARKERS]})
    tokenizer.chat_template = TEMPLATE
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=56, patch_size=14)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
        model.model.connector.modality_projection.proj.weight.mul_(8)  # images that steer the output
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(path)
    Idefics3ImageProcessorPil(size={"longest_edge": 112}, max_image_size={"longest_edge": 56},
                              do_image_splitting=True).save_pretrained(path)
    return Path(path)


def idefics3_greedy(path: Path, llm: LLM, requests: list[dict], max_new_tokens: int = 10) -> list[list[int]]:
    """transformers' greedy continuation of each request, its ids as our intake expanded them."""
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    images_of = AutoImageProcessor.from_pretrained(path)
    outs = []
    for req in requests:
        images = req.get("multi_modal_data", {}).get("image", [])
        images = images if isinstance(images, list) else [images]
        ids, _ = llm.engine.intake._multimodal(req)
        ii = torch.tensor([ids])
        inputs = {"input_ids": ii, "attention_mask": torch.ones_like(ii)}
        if images:
            pixels = images_of(images=[images], return_tensors="pt")
            inputs |= {k: pixels[k] for k in ("pixel_values", "pixel_attention_mask")}
        with torch.no_grad():
            gen = hf.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return make_idefics3_checkpoint(tmp_path_factory.mktemp("idefics3"), seed=1)


@pytest.fixture(scope="module")
def idefics3_reference(idefics3):
    llm = LLM(str(idefics3), dtype="float32", device="cpu")
    reqs = mixed_requests()
    return llm, reqs, idefics3_greedy(idefics3, llm, reqs)


def test_idefics3_tiles_and_expansion_follow_the_checkpoints_processors(idefics3, idefics3_reference):
    from transformers import Idefics3Processor

    llm = idefics3_reference[0]
    images = [noise_image(120, 50, 3), noise_image(40, 40, 4)]  # 1 x 2 tiles + global, 2 x 2 + global
    req = {"prompt": prompt("compare", 2), "multi_modal_data": {"image": images}}
    ids, mm = llm.engine.intake._multimodal(req)
    ref = AutoImageProcessor.from_pretrained(idefics3)(images=[images], return_tensors="pt")
    assert torch.equal(torch.cat([i.pixel_values for i in mm.items]), ref["pixel_values"][0])
    masks = torch.cat([i.extra["pixel_attention_mask"] for i in mm.items])
    assert torch.equal(masks, ref["pixel_attention_mask"][0])
    assert [i.pixel_values.shape[0] for i in mm.items] == [3, 5]
    processor = Idefics3Processor(AutoImageProcessor.from_pretrained(idefics3), llm.tokenizer,
                                  image_seq_len=4)
    assert ids == processor(text=[req["prompt"]], images=[images], add_special_tokens=False)["input_ids"][0]
    assert [i.num_embeddings for i in mm.items] == [12, 20]


def test_idefics3_greedy_matches_transformers_with_images_mixed_with_text(idefics3_reference):
    llm, reqs, ref = idefics3_reference
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert len({tuple(r) for r in ref}) > 2


def test_idefics3_greedy_matches_with_chunks_inside_tiles_and_preemption(idefics3, idefics3_reference):
    _, reqs, ref = idefics3_reference
    chunked = LLM(str(idefics3), dtype="float32", device="cpu", max_num_batched_tokens=13,
                  enable_prefix_caching=False)
    assert [o.token_ids for o in chunked.generate(reqs, GREEDY, progress=False)] == ref
    assert chunked.stats()["images_encoded"] == 3
    llm = LLM(str(idefics3), dtype="float32", device="cpu", block_size=16)
    blocks = 8
    llm = LLM(str(idefics3), dtype="float32", device="cpu", block_size=16,
              kv_cache_memory_gb=blocks * llm.engine.kv_block_bytes / 1024**3)
    assert [o.token_ids for o in llm.generate(reqs, GREEDY, progress=False)] == ref
    assert llm.stats()["num_preemptions"] > 0
