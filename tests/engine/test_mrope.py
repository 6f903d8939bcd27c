"""M-RoPE (Qwen2-VL's three position streams) in the layer description: the prompt's streams against
transformers' get_rope_index, the rotary rows of three streams against the language model of
transformers, and text prompts unchanged (mrope.py, spec.py, forward.py)."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.config import ConfigError
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.families import build_spec
from lmi_handler.engine.model.loader import read_config
from lmi_handler.engine.model.mrope import mrope_positions
from lmi_handler.engine.model_runner import ModelRunner
from tests.engine.helpers import greedy_generate, hf_greedy, make_meta
from tests.engine.qwen2_vl_models import IMAGE_TOKEN_ID, MERGE, VISION_END_ID, VISION_START_ID

CPU = torch.device("cpu")
TEXT_PROMPTS = [[1, 17, 300, 45, 9, 33, 2, 71], [1, 250, 4]]


def image_prompt(grids: list[tuple[int, int, int]], text: tuple[int, ...] = (5, 6)):
    """(<s> text, then each image as <vision_start> its merged tokens <vision_end> text; [(first image token,
    grid)])."""
    ids, images = [1, 11, 12], []
    for t, h, w in grids:
        ids.append(VISION_START_ID)
        images.append((len(ids), (t, h, w)))
        ids += [IMAGE_TOKEN_ID] * (t * h * w // MERGE ** 2) + [VISION_END_ID] + list(text)
    return ids, images


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def tiny(request):
    return request.getfixturevalue(f"{request.param}_checkpoint")


@pytest.fixture(scope="module", params=["torch", "cpp"])
def runner(request, qwen2_5_vl_checkpoint):
    """The tiny Qwen2.5-VL's runner on each backend (the language model's arithmetic: Qwen2-VL's is the same)."""
    return ModelRunner(qwen2_5_vl_checkpoint[0], torch.float32, CPU, block_size=4, num_blocks=64,
                       kernel_backend=request.param)


@pytest.mark.parametrize("grids", [[], [(1, 4, 6)], [(1, 6, 4), (1, 2, 2)], [(1, 8, 4), (1, 4, 10)]])
def test_prompt_streams_and_decode_delta_equal_transformers_get_rope_index(tiny, grids):
    _, hf = tiny
    ids, images = image_prompt(grids)
    ours = mrope_positions(len(ids), images, MERGE)
    input_ids = torch.tensor([ids])
    if not grids:
        assert torch.equal(ours.prompt, torch.arange(len(ids)).expand(3, -1)) and ours.delta == 0
        return
    theirs, deltas = hf.model.get_rope_index(input_ids, mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(),
                                             image_grid_thw=torch.tensor(grids))
    assert torch.equal(ours.prompt, theirs[:, 0])
    assert ours.delta == int(deltas[0, 0]) < 0
    # generated tokens: transformers' compute_3d_position_ids, cache length + rope_deltas on every stream
    assert torch.equal(ours.rows(len(ids), 3), (torch.arange(len(ids), len(ids) + 3) + ours.delta).expand(3, -1))
    assert torch.equal(ours.rows(len(ids) - 2, 4)[:, :2], theirs[:, 0, -2:])


def test_images_that_overlap_or_run_past_the_prompt_are_refused():
    with pytest.raises(ValueError, match="overlaps"):
        mrope_positions(20, [(1, (1, 4, 4)), (3, (1, 4, 4))], MERGE)
    with pytest.raises(ValueError, match="past its 4 tokens"):
        mrope_positions(4, [(1, (1, 4, 4))], MERGE)


def test_the_spec_reads_the_mrope_sections_from_the_text_config(tiny):
    path, _ = tiny
    spec = build_spec(read_config(path))
    assert spec.layers[0].rope.mrope_section == (2, 3, 3) and spec.qkv_bias and not spec.o_bias
    assert spec.cpp_misfits() == []           # the fused C++ stack takes any cos / sin rows


def test_sections_that_do_not_cover_the_rotary_dims_are_refused(tiny):
    path, _ = tiny
    cfg = read_config(path)
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 4]
    with pytest.raises(ConfigError, match="mrope_section"):
        build_spec(cfg)


def test_a_text_prompt_gives_transformers_greedy_tokens(runner, qwen2_5_vl_checkpoint):
    _, hf = qwen2_5_vl_checkpoint
    ours, _ = greedy_generate(runner, BlockAllocator(runner.num_blocks, runner.block_size), TEXT_PROMPTS, 8)
    assert ours == [hf_greedy(hf, p, 8) for p in TEXT_PROMPTS]


def _forward(runner: ModelRunner, ids: list[int], positions: torch.Tensor) -> torch.Tensor:
    """(T, vocab) float32 logits of one prompt's prefill at `positions` ((T,) or (3, T))."""
    meta = make_meta([list(range(len(ids) // 4 + 1))], [0], [len(ids)], 4)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), positions, runner.kv_caches, meta)
        return runner.model.compute_logits(hidden)


def test_three_equal_streams_give_the_one_stream_logits_bitwise(runner):
    ids = TEXT_PROMPTS[0] * 3
    one = _forward(runner, ids, torch.arange(len(ids)))
    three = _forward(runner, ids, torch.arange(len(ids)).expand(3, -1))
    assert torch.equal(one, three)


def test_an_image_prompt_s_streams_give_the_language_model_s_logits(runner, qwen2_5_vl_checkpoint):
    """Our decoder at the prompt's three streams against transformers' language model at the same position ids
    (the image tokens' embeddings are the image token's: the vision tower is not in this test)."""
    _, hf = qwen2_5_vl_checkpoint
    grids = [(1, 6, 4), (1, 4, 8)]
    ids, images = image_prompt(grids)
    streams = mrope_positions(len(ids), images, MERGE).prompt
    ours = _forward(runner, ids, streams)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([ids]), position_ids=streams[:, None, :]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, _forward(runner, ids, torch.arange(len(ids))), atol=1e-3)   # streams matter
