"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints built with transformers' own classes (seeded; 2 text layers,
GQA, M-RoPE sections (2, 3, 3) over head_dim 16; a 2-block vision tower of 4-pixel patches merged 2 x 2, a
16-pixel window on 2.5 with its second block full), for the M-RoPE, vision tower and integration tests."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engine.helpers import TINY_VOCAB

# the last ids of the tiny vocabulary are the vision tokens
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = TINY_VOCAB - 4, TINY_VOCAB - 3, TINY_VOCAB - 2, \
    TINY_VOCAB - 1
PATCH, MERGE = 4, 2

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=TINY_VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = {
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                       spatial_merge_size=MERGE, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                       fullatt_block_indexes=[1], initializer_range=0.2),
    "qwen2_vl": dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
                     temporal_patch_size=2, hidden_size=64, initializer_range=0.2),
}


def tiny_config(model_type: str = "qwen2_5_vl"):
    """transformers' config of the tiny `model_type` ("qwen2_5_vl" or "qwen2_vl")."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    cls = Qwen2_5_VLConfig if model_type == "qwen2_5_vl" else Qwen2VLConfig
    return cls(text_config=dict(TEXT), vision_config=dict(VISION[model_type]), image_token_id=IMAGE_TOKEN_ID,
               video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_ID,
               vision_end_token_id=VISION_END_ID, tie_word_embeddings=False)


def build_tiny_qwen2_vl(path: Path | None, model_type: str = "qwen2_5_vl", seed: int = 0):
    """The tiny model of `model_type`, eager attention, fp32, biases and norm weights randomized (they start at 0
    / 1), saved to `path` with save_pretrained unless None; returns the HF model."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    cls = Qwen2_5_VLForConditionalGeneration if model_type == "qwen2_5_vl" else Qwen2VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls._from_config(tiny_config(model_type), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.2)
    if path is not None:
        model.save_pretrained(path, safe_serialization=True)
    return model


# Qwen2-VL's chat template (Qwen/Qwen2-VL-2B-Instruct's, without its system default), saved as chat_template.jinja
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VISION_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]   # ids 508..511
MIN_PIXELS, MAX_PIXELS = 8 * 8, 48 * 48


def build_tiny_processor(path: Path | None):
    """The checkpoint's processor (qwen2_vl.QwenVLProcessor: transformers' Qwen2_5_VLProcessor needs torchvision for
    its video processor): the tiny byte-level tokenizer with Qwen's vision tokens as its last ids, and
    transformers' PIL Qwen2-VL image processor at 4-pixel patches, between 64 and 2304 pixels (an image of up to
    48 x 48 keeps its size, rounded to 8). Both saved to `path` unless None."""
    from transformers import Qwen2VLImageProcessorPil

    from lmi_handler.engine.model.vision.qwen2_vl import QwenVLProcessor
    from tests.engine.helpers import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(TINY_VOCAB - len(VISION_TOKENS))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    assert tokenizer.convert_tokens_to_ids(VISION_TOKENS) == [IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID,
                                                             VISION_END_ID]
    images = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                      size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    if path is not None:
        tokenizer.save_pretrained(path)
        images.save_pretrained(path)
        (Path(path) / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    return QwenVLProcessor(tokenizer, images, QWEN_TEMPLATE)


def draw_image(width: int, height: int, seed: int = 0):
    """A Pillow RGB picture: a gradient with a rectangle and an ellipse placed by `seed`."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height))
    image.putdata([((x * 255) // width, (y * 255) // height, (seed * 40) % 256)
                   for y in range(height) for x in range(width)])
    draw = ImageDraw.Draw(image)
    draw.rectangle([seed % 7, seed % 5, width // 2, height // 2 + seed % 3], fill=(250, 30 * seed % 256, 20))
    draw.ellipse([width // 3, height // 3, width - 2, height - 1], outline=(10, 200, 90), width=2)
    return image
