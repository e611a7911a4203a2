"""Qwen2.5-VL natively: preprocessing, M-RoPE positions, its windowed vision tower and greedy output against
transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

from sluice.engine import LLM, SamplingParams
from sluice.engine.models.qwen2_5_vl import Qwen25VisionTransformer, window_order
from tests.checkpoints import QWEN2_VL_SPECIALS, QWEN2_VL_TEMPLATE, build_tokenizer
from tests.test_images_qwen2_vl import hf_greedy, hf_inputs, noise_image, prompt

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def make_qwen2_5_vl_checkpoint(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL (2-layer text, 4-block vision tower: blocks 1 and 3 full attention, 0 and 2 in
    windows of 2x2 merged patches) whose image processor makes an image 4 to 25 tokens (5x5 merged patches:
    windows cut short at the edges)."""
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2VLImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_VL_SPECIALS})
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    start, end, pad = tokenizer.convert_tokens_to_ids(QWEN2_VL_SPECIALS)
    text = dict(vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1, 3])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                              vision_start_token_id=start, vision_end_token_id=end, video_token_id=pad + 1,
                              tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=140 * 140, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    return make_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen2.5-vl"))


@pytest.fixture(scope="module")
def hf_model(qwen2_5_vl):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(qwen2_5_vl):
    return LLM(str(qwen2_5_vl), dtype="float32", device="cpu")


def mixed_requests() -> list[dict]:
    """One image, two images, text only, a wide image, three images, a small image."""
    a, b, c = noise_image(140, 140, 1), noise_image(60, 90, 2), noise_image(200, 70, 3)
    return [
        {"prompt": prompt("describe", 1), "multi_modal_data": {"image": a}},
        {"prompt": prompt("compare", 2), "multi_modal_data": {"image": [b, c]}},
        {"prompt": "<|user|>the quick brown fox jumps over\n<|assistant|>"},
        {"prompt": prompt("caption", 1), "multi_modal_data": {"image": [c]}},
        {"prompt": prompt("to be or not", 3), "multi_modal_data": {"image": [c, a, b]}},
        {"prompt": prompt("describe", 1), "multi_modal_data": {"image": b}},
    ]


@pytest.fixture(scope="module")
def reference(qwen2_5_vl, hf_model, llm):
    reqs = mixed_requests()
    return reqs, hf_greedy(qwen2_5_vl, hf_model, llm, reqs)


def test_the_engine_builds_qwen2_5_vls_own_vision_tower(llm):
    visual = llm.engine.model.visual
    assert isinstance(visual, Qwen25VisionTransformer)
    assert visual.window == 2 and visual.full_attention == {1, 3}


def test_window_order_matches_transformers():
    from transformers.vision_utils import get_vision_window_index

    grids = [(1, 10, 10), (1, 4, 6), (2, 8, 8), (1, 12, 6)]
    order, lengths = window_order(grids, merge=2, window=2)
    ref_order, ref_cu = get_vision_window_index(torch.tensor(grids), 2, 56, 14)
    assert torch.equal(order, ref_order)
    assert lengths == torch.diff(ref_cu).tolist()
    assert len(set(lengths)) > 1  # windows cut short at the edges


def test_pixels_and_placeholders_follow_the_checkpoints_processor(qwen2_5_vl, llm):
    images = [noise_image(140, 140, 1), noise_image(60, 90, 2)]
    ids, mm = llm.engine.intake._multimodal({"prompt": prompt("compare", 2),
                                             "multi_modal_data": {"image": images}})
    ref = AutoImageProcessor.from_pretrained(qwen2_5_vl)(images=images, return_tensors="pt")
    assert type(AutoImageProcessor.from_pretrained(qwen2_5_vl)).__name__.startswith("Qwen2VLImageProcessor")
    assert torch.equal(torch.cat([i.pixel_values for i in mm.items]), ref["pixel_values"])
    assert [list(i.grid_thw) for i in mm.items] == ref["image_grid_thw"].tolist() == [[1, 10, 10], [1, 6, 4]]
    pad = llm.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(pad) == 25 + 6 == mm.num_image_tokens


def test_mrope_positions_and_vision_tower_match_transformers(qwen2_5_vl, hf_model, llm):
    images = [noise_image(140, 84, 4), noise_image(70, 140, 5), noise_image(112, 112, 6)]
    ids, mm = llm.engine.intake._multimodal({"prompt": prompt("compare", 3),
                                             "multi_modal_data": {"image": images}})
    inputs = hf_inputs(qwen2_5_vl, hf_model, ids, images)
    positions, delta = hf_model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                     inputs["image_grid_thw"])
    assert torch.equal(positions[:, 0], mm.mrope_positions) and int(delta) == mm.mrope_delta
    with torch.no_grad():
        ref = hf_model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        pixels = torch.cat([i.pixel_values for i in mm.items])
        ours = llm.engine.model.visual(pixels, [i.grid_thw for i in mm.items])
        one = llm.engine.model.visual(mm.items[0].pixel_values, [mm.items[0].grid_thw])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, ref[:len(one)], rtol=1e-5, atol=1e-5)  # an image's windows are its own


def test_greedy_matches_transformers_with_images_mixed_with_text(reference, llm):
    reqs, ref = reference
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert len({tuple(r) for r in ref}) > 2  # the images steer the output
    assert outs[0].prompt_token_ids.count(llm.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 25


def test_greedy_matches_with_prefill_chunked_inside_images(qwen2_5_vl, reference):
    reqs, ref = reference
    llm = LLM(str(qwen2_5_vl), dtype="float32", device="cpu", max_num_batched_tokens=8,
              enable_prefix_caching=False)
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["images_encoded"] == 3  # each distinct image once, its tokens over several steps


def test_greedy_matches_under_preemption(qwen2_5_vl, reference):
    reqs, ref = reference
    llm = LLM(str(qwen2_5_vl), dtype="float32", device="cpu", block_size=16)
    blocks = 8
    llm = LLM(str(qwen2_5_vl), dtype="float32", device="cpu", block_size=16,
              kv_cache_memory_gb=blocks * llm.engine.kv_block_bytes / 1024**3)
    assert llm.engine.num_blocks == blocks
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["num_preemptions"] > 0
