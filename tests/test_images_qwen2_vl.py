"""Qwen2-VL natively: preprocessing, M-RoPE positions, vision tower and greedy output against transformers."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration

from sluice.engine import LLM, RequestRejected, SamplingParams
from tests.checkpoints import make_qwen2_vl_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


def prompt(text: str, n_images: int) -> str:
    return f"<|user|>{text} " + " and ".join([PAD] * n_images) + " the fox\n<|assistant|>"


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return make_qwen2_vl_checkpoint(tmp_path_factory.mktemp("qwen2-vl"))


@pytest.fixture(scope="module")
def hf_model(qwen2_vl):
    return Qwen2VLForConditionalGeneration.from_pretrained(qwen2_vl, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(qwen2_vl):
    return LLM(str(qwen2_vl), dtype="float32", device="cpu")


def hf_inputs(qwen2_vl, hf_model, ids: list[int], images: list[Image.Image]) -> dict:
    ii = torch.tensor([ids])
    out = {"input_ids": ii, "attention_mask": torch.ones_like(ii)}
    if images:
        pixels = AutoImageProcessor.from_pretrained(qwen2_vl)(images=images, return_tensors="pt")
        out |= {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
                "mm_token_type_ids": (ii == hf_model.config.image_token_id).int()}
    return out


def hf_greedy(qwen2_vl, hf_model, llm, requests: list[dict], max_new_tokens: int = 12) -> list[list[int]]:
    outs = []
    for req in requests:
        images = req.get("multi_modal_data", {}).get("image", [])
        ids, _ = llm.engine.intake._multimodal(req)
        with torch.no_grad():
            inputs = hf_inputs(qwen2_vl, hf_model, ids, images)
            gen = hf_model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def mixed_requests() -> list[dict]:
    """One image, two images, text only, a large and a small image, the first image again."""
    a, b, c = noise_image(112, 112, 1), noise_image(60, 90, 2), noise_image(200, 70, 3)
    return [
        {"prompt": prompt("describe", 1), "multi_modal_data": {"image": a}},
        {"prompt": prompt("compare", 2), "multi_modal_data": {"image": [b, c]}},
        {"prompt": "<|user|>the quick brown fox jumps over\n<|assistant|>"},
        {"prompt": prompt("caption", 1), "multi_modal_data": {"image": [c]}},
        {"prompt": prompt("to be or not", 3), "multi_modal_data": {"image": [c, a, b]}},
        {"prompt": prompt("describe", 1), "multi_modal_data": {"image": b}},
    ]


@pytest.fixture(scope="module")
def reference(qwen2_vl, hf_model, llm):
    reqs = mixed_requests()
    return reqs, hf_greedy(qwen2_vl, hf_model, llm, reqs)


def test_pixels_and_placeholders_follow_the_checkpoints_processor(qwen2_vl, llm):
    images = [noise_image(112, 112, 1), noise_image(60, 90, 2)]
    ids, mm = llm.engine.intake._multimodal({"prompt": prompt("compare", 2),
                                             "multi_modal_data": {"image": images}})
    ref = AutoImageProcessor.from_pretrained(qwen2_vl)(images=images, return_tensors="pt")
    assert torch.equal(torch.cat([i.pixel_values for i in mm.items]), ref["pixel_values"])
    assert [list(i.grid_thw) for i in mm.items] == ref["image_grid_thw"].tolist()
    pad = llm.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    lengths = [int(t * h * w) // 4 for t, h, w in ref["image_grid_thw"].tolist()]
    assert ids.count(pad) == sum(lengths) == mm.num_image_tokens
    for item, n in zip(mm.items, lengths, strict=True):
        assert ids[item.offset - 1] == llm.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        assert ids[item.offset:item.offset + n] == [pad] * n and ids[item.offset + n] != pad


def test_mrope_positions_and_vision_tower_match_transformers(qwen2_vl, hf_model, llm):
    images = [noise_image(112, 84, 4), noise_image(70, 140, 5)]
    ids, mm = llm.engine.intake._multimodal({"prompt": prompt("compare", 2),
                                             "multi_modal_data": {"image": images}})
    inputs = hf_inputs(qwen2_vl, hf_model, ids, images)
    positions, delta = hf_model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                     inputs["image_grid_thw"])
    assert torch.equal(positions[:, 0], mm.mrope_positions) and int(delta) == mm.mrope_delta
    with torch.no_grad():
        ref = hf_model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        pixels = torch.cat([i.pixel_values for i in mm.items])
        ours = llm.engine.model.visual(pixels, [i.grid_thw for i in mm.items])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_greedy_matches_transformers_with_images_mixed_with_text(reference, llm):
    reqs, ref = reference
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert len({tuple(r) for r in ref}) > 2  # the images steer the output
    assert outs[0].prompt_token_ids.count(llm.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 16


def test_greedy_matches_with_prefill_chunked_inside_images(qwen2_vl, reference):
    reqs, ref = reference
    llm = LLM(str(qwen2_vl), dtype="float32", device="cpu", max_num_batched_tokens=8,
              enable_prefix_caching=False)
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["images_encoded"] == 3  # each distinct image once, its tokens over several steps


def test_greedy_matches_under_preemption(qwen2_vl, reference):
    reqs, ref = reference
    llm = LLM(str(qwen2_vl), dtype="float32", device="cpu", block_size=16)
    blocks = 8
    llm = LLM(str(qwen2_vl), dtype="float32", device="cpu", block_size=16,
              kv_cache_memory_gb=blocks * llm.engine.kv_block_bytes / 1024**3)
    assert llm.engine.num_blocks == blocks
    outs = llm.generate(reqs, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["num_preemptions"] > 0


def test_one_image_in_many_prompts_is_encoded_once_and_images_salt_the_prefix_cache(qwen2_vl, hf_model):
    llm = LLM(str(qwen2_vl), dtype="float32", device="cpu", block_size=4)
    same = noise_image(112, 112, 7)
    reqs = [{"prompt": prompt("describe", 1), "multi_modal_data": {"image": same}} for _ in range(5)]
    outs = llm.generate(reqs, GREEDY, progress=False)
    stats = llm.stats()
    assert stats["images_encoded"] == 1 and stats["encoder_cache_hits"] >= 1
    assert len(llm.engine.intake.mm_processor._patches) == 1  # and preprocessed once
    assert len({tuple(o.token_ids) for o in outs}) == 1
    other = {"prompt": prompt("describe", 1), "multi_modal_data": {"image": noise_image(112, 112, 8)}}
    ref = hf_greedy(qwen2_vl, hf_model, llm, [other])
    hits = llm.engine.block_manager.hits
    assert llm.generate([other], GREEDY, progress=False)[0].token_ids == ref[0]
    assert llm.engine.block_manager.hits == hits  # equal text, another image: no block shared
    llm.generate([reqs[0]], GREEDY, progress=False)
    assert llm.engine.block_manager.hits > hits  # the same image and text: its blocks are found


def test_prompts_that_finish_at_prefill_leave_their_image_blocks_cached(qwen2_vl, hf_model):
    """One token per line (the prefill bench's shape): lines of later steps reuse the first line's blocks."""
    llm = LLM(str(qwen2_vl), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=64)
    req = {"prompt": prompt("describe", 1), "multi_modal_data": {"image": noise_image(112, 112, 11)}}
    one = SamplingParams(max_tokens=1, temperature=0)
    outs = llm.generate([req] * 6, one, progress=False)
    ref = hf_greedy(qwen2_vl, hf_model, llm, [req], max_new_tokens=1)[0]
    assert [o.token_ids for o in outs] == [ref] * 6
    n = len(outs[0].prompt_token_ids)
    assert n < 64 < 2 * n  # one line per step until the cache serves them
    cached = (n - 1) // 4 * 4
    assert llm.engine.block_manager.hits >= 4 * cached  # lines of later steps found the image's blocks
    assert llm.stats()["computed_tokens"] <= 6 * n - 4 * cached


def test_bad_image_requests_are_rejected_by_name_and_the_rest_still_run(llm, tiny_llama):
    image = noise_image(64, 64, 9)
    with pytest.raises(RequestRejected, match="1 image placeholder.*2 image"):
        llm.engine.add_request("a", {"prompt": prompt("x", 1), "multi_modal_data": {"image": [image, image]}})
    with pytest.raises(RequestRejected, match="over the limit of 16"):
        llm.engine.add_request("b", {"prompt": prompt("x", 17), "multi_modal_data": {"image": [image] * 17}})
    with pytest.raises(RequestRejected, match="must be a PIL.Image"):
        llm.engine.add_request("c", {"prompt": prompt("x", 1), "multi_modal_data": {"image": "cat.png"}})
    with pytest.raises(RequestRejected, match="takes 'image' only"):
        llm.engine.add_request("d", {"prompt": prompt("x", 1), "multi_modal_data": {"video": [image]}})
    text_only = LLM(str(tiny_llama), dtype="float32", device="cpu")
    with pytest.raises(RequestRejected, match="takes no images"):
        text_only.engine.add_request("e", {"prompt": "hi", "multi_modal_data": {"image": image}})
    out = llm.generate([{"prompt": prompt("describe", 1), "multi_modal_data": {"image": image}}], GREEDY,
                       progress=False)
    assert out[0].finish_reason in ("stop", "length") and not llm.engine.has_unfinished()


def test_chat_with_image_parts_is_generate_with_multi_modal_data(llm):
    from sluice.contract.images import ImageError, ImageSettings, load_image
    from sluice.engine.multimodal.image_decode import ImageError as EngineImageError
    from tests.test_images import data_url, encoded

    image = noise_image(98, 70, 10)
    text = {"type": "text", "text": "describe "}
    url_part = {"type": "image_url", "image_url": {"url": data_url(encoded(image))}}
    by_url = [{"role": "user", "content": [text, url_part]}]
    by_pil = [{"role": "user", "content": [text, {"type": "image_pil", "image_pil": image}]}]
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": [text, {"type": "image"}]}],
                                                 add_generation_prompt=True, tokenize=False)
    assert PAD in rendered
    direct = {"prompt": rendered, "multi_modal_data": {"image": [image]}}
    outs = llm.chat([by_url, by_pil], GREEDY, progress=False) + llm.generate(direct, GREEDY, progress=False)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[0].prompt_token_ids == outs[2].prompt_token_ids
    bad = [{"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": "s3://b/k.png"}}]}]
    outside = r"messages\[0\]\.content\[1\]: .*outside the image input roots"
    with pytest.raises(EngineImageError, match=outside):
        llm.chat(bad, GREEDY, progress=False)
    with pytest.raises(ImageError, match=outside):
        llm.chat(bad, GREEDY, progress=False, image_loader=lambda url: load_image(url, ImageSettings()).image)


def test_intake_leaves_the_patches_to_the_step_that_encodes_the_image(llm, qwen2_vl, hf_model, monkeypatch):
    from sluice.engine.multimodal.image_patches import ImagePatcher

    calls, real = [], ImagePatcher.resize_and_cut
    monkeypatch.setattr(ImagePatcher, "resize_and_cut", lambda self, *args: calls.append(args[1:3])
                        or real(self, *args))
    req = {"prompt": prompt("describe", 1), "multi_modal_data": {"image": noise_image(150, 50, 12)}}
    llm.engine.add_request("lazy-patches", req, GREEDY)
    assert calls == []  # the prompt's image tokens follow from the image's size alone
    outs = []
    while llm.engine.has_unfinished():
        outs += llm.engine.step()
    assert len(calls) == 1  # once, when the step encodes the image
    assert [o.token_ids for o in outs] == hf_greedy(qwen2_vl, hf_model, llm, [req])


def test_step_positions_follow_each_requests_own(llm):
    from types import SimpleNamespace

    from sluice.engine.multimodal.inputs import step_positions

    images = [noise_image(112, 84, 13), noise_image(56, 140, 14)]
    req = {"prompt": prompt("compare", 2), "multi_modal_data": {"image": images}}
    _, mm = llm.engine.intake._multimodal(req)
    n = mm.mrope_positions.shape[1]
    assert mm.mrope_delta != 0
    reqs = [SimpleNamespace(num_computed_tokens=5, mm_inputs=mm),  # a chunk inside the prompt
            SimpleNamespace(num_computed_tokens=7),  # text only
            SimpleNamespace(num_computed_tokens=n - 3, mm_inputs=mm),  # the prompt's end and past it
            SimpleNamespace(num_computed_tokens=n + 4, mm_inputs=mm)]  # decode
    counts = [20, 3, 6, 1]
    expected = torch.cat([mm.positions(5, 25), torch.arange(7, 10).expand(3, -1), mm.positions(n - 3, n + 3),
                          torch.full((3, 1), n + 4 + mm.mrope_delta)], 1)
    assert torch.equal(step_positions(reqs, counts), expected)
    assert torch.equal(step_positions(reqs[1:2] + reqs[3:], [3, 1]), expected[0, [20, 21, 22, 29]])  # 1D


def test_an_image_the_processor_prepares_encodes_with_others_in_one_step(llm, qwen2_vl, hf_model):
    keyed = noise_image(70, 98, 15)
    keyed.info["transparency"] = keyed.getpixel((0, 0))  # a PNG colour key: transformers' own processor
    reqs = [{"prompt": prompt("compare", 2), "multi_modal_data": {"image": [keyed, noise_image(84, 56, 16)]}}]
    assert [o.token_ids for o in llm.generate(reqs, GREEDY, progress=False)] == hf_greedy(qwen2_vl, hf_model,
                                                                                          llm, reqs)


def test_a_bf16_vision_tower_is_as_near_the_fp32_one_as_transformers_bf16_tower(qwen2_vl, hf_model, llm):
    """In bf16 the tower's attention runs the varlen kernel (fp32 sums, bf16 in and out): its output is as
    close to the fp32 tower's as transformers' own bf16 tower is (within 1.5x of its error)."""
    import copy

    images = [noise_image(112, 84, 6), noise_image(70, 140, 7)]
    ids, mm = llm.engine.intake._multimodal({"prompt": prompt("compare", 2),
                                             "multi_modal_data": {"image": images}})
    inputs = hf_inputs(qwen2_vl, hf_model, ids, images)
    pixels, grids = torch.cat([i.pixel_values for i in mm.items]), [i.grid_thw for i in mm.items]
    with torch.no_grad():
        ref = llm.engine.model.visual(pixels, grids)
        ours = copy.deepcopy(llm.engine.model.visual).to(torch.bfloat16)(pixels, grids)
        theirs = copy.deepcopy(hf_model.model.visual).to(torch.bfloat16)(
            inputs["pixel_values"].bfloat16(), grid_thw=inputs["image_grid_thw"]).pooler_output
    assert ours.dtype is torch.bfloat16
    ours_err, their_err = ((x.float() - ref).abs().max() for x in (ours, theirs))
    assert 0 < ours_err <= 1.5 * their_err + 1e-3
