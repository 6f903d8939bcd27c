"""Tiny random vision-language checkpoints built with transformers' own classes (Idefics3 / SmolVLM, LLaVA). Idefics3: a 2-layer SigLIP of 32 x 32
tiles (16 patches of 8, pixel shuffle 2: 4 tokens a tile), a 2-layer Llama, the tiny tokenizer with Idefics3's
image tokens, the PIL image processor (images up to 64 px split into 32 px tiles and a global view) and
SmolVLM's chat template; and pictures drawn with Pillow."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import torch

from tests.engine.helpers import build_tiny_tokenizer

# SmolVLM's chat template (HuggingFaceTB/SmolVLM-256M-Instruct), content always a list of parts
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] "
    "== 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == "
    "'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
IMAGE_TOKENS = ["<global-img>"] + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]


def build_tiny_idefics3(path: Path, seed: int = 0):
    """Write the checkpoint and its processor to `path`; return (the HF model in eval mode, the processor)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = build_tiny_tokenizer(vocab_size=400)
    tokenizer.add_tokens(IMAGE_TOKENS + ["<|im_start|>"], special_tokens=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                                "<end_of_utterance>"]})
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                       do_image_splitting=True)
    processor = Idefics3Processor(images, tokenizer, image_seq_len=4, chat_template=SMOLVLM_TEMPLATE)
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=1, initializer_range=0.2),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():      # larger weights than the initializer's: the image must move the logits
        for name, p in model.named_parameters():
            if "vision_model" in name or "connector" in name:
                p.normal_(0.0, 0.3) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor


LLAVA_TEMPLATE = ("{% for message in messages %}{{ message['role'].upper() }}: {% for part in message['content'] %}"
                  "{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}\n"
                  "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def build_tiny_llava(path: Path, seed: int = 0):
    """A tiny random LLaVA-1.5 (a 3-layer CLIP of 32 x 32 images in patches of 8, feature layer -2 without the class
    token: 16 tokens an image; a 2-layer Llama) and its processor, written to `path`; returns (model, processor)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = build_tiny_tokenizer(vocab_size=400)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(images, tokenizer, patch_size=8, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, image_token="<image>", chat_template=LLAVA_TEMPLATE)
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=2, image_size=32, patch_size=8),
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=1, initializer_range=0.2),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "projector" in name:
                p.normal_(0.0, 0.3) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor


def picture(width: int, height: int, seed: int = 0):
    """An RGB picture of random coloured rectangles, drawn with Pillow."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(seed)
    image = Image.new("RGB", (width, height), tuple(torch.randint(0, 256, (3,), generator=g).tolist()))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = torch.randint(0, width, (1,), generator=g).item(), torch.randint(0, height, (1,), generator=g).item()
        x1, y1 = x0 + torch.randint(1, width, (1,), generator=g).item(), y0 + torch.randint(1, height, (1,), generator=g).item()
        draw.rectangle((x0, y0, x1, y1), fill=tuple(torch.randint(0, 256, (3,), generator=g).tolist()))
    return image


def data_url(image, fmt: str = "PNG") -> str:
    """`image` as a data: URL of the format `fmt`."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()
