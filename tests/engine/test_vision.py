"""engine/model/vision/ and the engine's image plumbing on a tiny random Idefics3 (SmolVLM): greedy tokens and
log probs equal transformers' generate() with the same processor, a row's tokens the same alone and batched, the
prefix cache keyed on the picture, chunked prefill through images."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmi_handler.engine.model.loader import read_config
from lmi_handler.engine.model.vision import family_of
from lmi_handler.engine.sequence import SamplingParams
from tests.engine.helpers import make_engine
from tests.engine.vision_models import picture

pytestmark = pytest.mark.slow
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def vlm(tiny_vlm):
    """(checkpoint dir, HF model, processor, an engine of 16-token steps: images span chunks)."""
    path, model, processor = tiny_vlm
    return path, model, processor, make_engine(path, processor.tokenizer, max_num_batched_tokens=16)


def _prompt(vlm, images, text="What is this?"):
    path, _, processor, _ = vlm
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    rendered = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
    return family_of(read_config(path)).prepare(processor, rendered, images, False), rendered


def _ours(engine, prompts: dict, max_new_tokens=NEW_TOKENS):
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    results = engine.generate([(rid, list(mm.token_ids), replace(params, multimodal=mm if mm.images else None))
                               for rid, mm in prompts.items()])
    return {rid: [(t.id, t.log_prob) for out in outs for t in out.new_tokens] for rid, outs in results.items()}


def _assert_ours_equal_generate(engine, model, inputs, mm) -> list[int]:
    """Our greedy tokens for `mm` equal transformers' generate() on the processor's `inputs`, and each chosen
    token's log-prob is within 1e-4 of generate()'s; returns the tokens."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    expected = out.sequences[0, len(mm.token_ids):].tolist()
    expected_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, expected)]
    ours = _ours(engine, {"r": mm})["r"]
    assert [t for t, _ in ours] == expected
    assert [lp for _, lp in ours] == pytest.approx(expected_lp, abs=1e-4)
    return expected


@pytest.mark.parametrize("sizes", [[(50, 30)], [(50, 30), (20, 64)], [(64, 64), (30, 30)]], ids=str)
def test_greedy_tokens_and_log_probs_equal_transformers_generate_with_one_and_two_images(vlm, sizes):
    _, model, processor, engine = vlm
    images = [picture(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    mm, text = _prompt(vlm, images)
    inputs = processor(text=[text], images=[images], add_special_tokens=False, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == list(mm.token_ids)
    _assert_ours_equal_generate(engine, model, inputs, mm)


def test_llava_greedy_tokens_and_log_probs_equal_transformers_generate_with_two_images(tiny_llava):
    path, model, processor = tiny_llava
    engine = make_engine(path, processor.tokenizer, max_num_batched_tokens=16)
    vlm = (path, model, processor, engine)
    images = [picture(50, 30, seed=1), picture(20, 64, seed=2)]
    mm, text = _prompt(vlm, images)
    inputs = processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == list(mm.token_ids) and [i.num_tokens for i in mm.images] == [16, 16]
    expected = _assert_ours_equal_generate(engine, model, inputs, mm)
    other, _ = _prompt(vlm, [picture(50, 30, seed=8), picture(20, 64, seed=9)])
    assert [t for t, _ in _ours(engine, {"o": other})["o"]] != expected     # the pictures matter


def test_the_image_changes_the_answer_so_the_tests_above_check_it(vlm):
    one, _ = _prompt(vlm, [picture(50, 30, seed=0)])
    other, _ = _prompt(vlm, [picture(50, 30, seed=9)])
    out = _ours(vlm[3], {"a": one, "b": other})
    assert [t for t, _ in out["a"]] != [t for t, _ in out["b"]]


def test_an_image_rows_tokens_are_bitwise_the_same_alone_and_batched_with_image_and_text_requests(vlm):
    engine = vlm[3]
    target, _ = _prompt(vlm, [picture(50, 30, seed=3)])
    other, _ = _prompt(vlm, [picture(20, 64, seed=4), picture(40, 40, seed=5)], text="Compare")
    text_only, _ = _prompt(vlm, [], text="Hello world, hello there.")
    config = engine.scheduler.config
    engine.scheduler.config = replace(config, enable_prefix_caching=False)     # no hit on the first run's blocks
    try:
        alone = _ours(engine, {"t": target})["t"]
        batched = _ours(engine, {"o": other, "t": target, "x": text_only})["t"]
    finally:
        engine.scheduler.config = config
    assert batched == alone           # ids and log probs, bitwise


def test_a_prefix_cache_hit_on_a_repeated_image_gives_the_missed_tokens_and_another_image_misses(vlm):
    engine = vlm[3]
    mm, _ = _prompt(vlm, [picture(64, 48, seed=6)], text="Describe it.")
    assert engine.scheduler.config.enable_prefix_caching
    first = _ours(engine, {"a": mm})["a"]
    seq_hit = engine.add_request("b", list(mm.token_ids), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                                        multimodal=mm))
    second = []
    while engine.has_unfinished:
        second += [(t.id, t.log_prob) for out in engine.step() for t in out.new_tokens]
    assert seq_hit.num_cached_tokens > mm.images[0].end          # past the image: its rows came from the cache
    assert second == first
    other, _ = _prompt(vlm, [picture(64, 48, seed=7)], text="Describe it.")
    assert list(other.token_ids) == list(mm.token_ids)             # the same tokens, another picture
    seq_miss = engine.add_request("c", list(other.token_ids), SamplingParams(max_new_tokens=1, multimodal=other))
    while engine.has_unfinished:
        engine.step()
    assert seq_miss.num_cached_tokens <= mm.images[0].start       # only the text before the image is shared
