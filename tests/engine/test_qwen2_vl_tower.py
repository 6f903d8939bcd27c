"""Qwen2-VL / Qwen2.5-VL's vision tower and processor against transformers' (engine/model/vision/qwen2_vl.py): the
tower's merged tokens equal transformers' vision model in float32 for one image and for two of different sizes."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.model.loader import read_config
from lmi_handler.engine.model.vision.qwen2_vl import QWEN2_VL, QwenVLProcessor, window_order
from tests.engine.qwen2_vl_models import IMAGE_TOKEN_ID, MERGE, draw_image

CPU = torch.device("cpu")
IMAGES = [draw_image(40, 24, 1), draw_image(30, 44, 2)]     # grids of 10 x 6 and 12 x 8 patches (30 x 44 -> 32 x 48)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def tiny(request):
    path, hf = request.getfixturevalue(f"{request.param}_checkpoint")
    encoder = QWEN2_VL.load_encoder(path, read_config(path), torch.float32, CPU)
    return path, hf, encoder, QwenVLProcessor.load(path)


def _prompt(processor, images):
    text = "Look: " + " then ".join(QWEN2_VL.image_placeholder(processor) for _ in images) + " ok"
    return QWEN2_VL.prepare(processor, text, images, add_special_tokens=True)


def test_the_processor_expands_each_image_to_its_merged_tokens_between_the_vision_tokens(tiny):
    _, _, _, processor = tiny
    prompt = _prompt(processor, IMAGES)
    grids = [image.pixel_inputs["image_grid_thw"][0].tolist() for image in prompt.images]
    assert grids == [[1, 6, 10], [1, 12, 8]]
    for image, (t, h, w) in zip(prompt.images, grids):
        assert image.num_tokens == t * h * w // MERGE ** 2
        assert image.pixel_inputs["pixel_values"].shape == (t * h * w, 3 * 2 * 4 * 4)
        assert all(prompt.token_ids[p] == IMAGE_TOKEN_ID for p in image.positions())
    assert sum(t == IMAGE_TOKEN_ID for t in prompt.token_ids) == sum(i.num_tokens for i in prompt.images)
    with pytest.raises(ValueError, match="2 images but 1"):
        processor("one " + processor.image_token, IMAGES)


def test_the_checkpoint_s_chat_template_writes_one_placeholder_per_image_part(tiny):
    from jinja2 import Template

    _, _, _, processor = tiny
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    text = Template(processor.chat_template).render(messages=messages, add_generation_prompt=True)
    assert text.count(QWEN2_VL.image_placeholder(processor)) == 2
    assert len(QWEN2_VL.prepare(processor, text, IMAGES, add_special_tokens=False).images) == 2


@pytest.mark.parametrize("count", [1, 2])
def test_the_tower_gives_transformers_vision_model_s_tokens(tiny, count):
    """Each image encoded alone (as the engine does) against transformers' visual over the prompt's images at once
    (its attention never crosses an image)."""
    _, hf, encoder, processor = tiny
    prompt = _prompt(processor, IMAGES[:count])
    ours = torch.cat([encoder.encode(image) for image in prompt.images])
    pixels = torch.cat([image.pixel_inputs["pixel_values"] for image in prompt.images])
    grids = torch.cat([image.pixel_inputs["image_grid_thw"] for image in prompt.images])
    with torch.no_grad():
        theirs = hf.model.visual(pixels, grid_thw=grids).pooler_output
    assert ours.shape == (sum(image.num_tokens for image in prompt.images), 64)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_qwen2_5_windows_cut_the_merged_grid_from_its_top_left_as_transformers_does():
    from transformers.vision_utils import get_vision_window_index

    grids = [(1, 10, 6), (1, 8, 8), (2, 4, 12)]
    order, bounds = window_order(grids, MERGE, 2)
    index, cu = get_vision_window_index(torch.tensor(grids), MERGE, 16, 4)
    assert torch.equal(order, index)
    assert [a for a, _ in bounds] + [bounds[-1][1]] == cu.tolist()
