"""Idefics3 and SmolVLM: SigLIP over each tile of an image, pixel shuffle and a linear projector, into a Llama-shaped
language model (the layer description's "llama" row).

Owns the family's VisionFamily: the processor's prompt (transformers' Idefics3Processor splits an image into tiles
and a global view, each tile `image_seq_len` <image> tokens after <row_r_col_c> or <global-img>), which tiles
are which image's, the tensor names, and the encoder (modeling_idefics3.py's Idefics3Connector written as ours).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmi_handler.engine.model.vision import ImageInput, MultimodalPrompt, auto_processor, read_tensors, token_runs
from lmi_handler.engine.model.vision.siglip import SiglipTower, VisionConfig

TEXT_PREFIX = "model.text_model."
VISION_PREFIX = "model.vision_model."
PROJECTOR = "model.connector.modality_projection.proj.weight"


class Idefics3Family:
    model_types = ("idefics3",)

    def text_config(self, cfg: dict) -> dict:
        text = dict(cfg.get("text_config") or {})
        text.setdefault("model_type", "llama")
        if cfg.get("tie_word_embeddings") is not None:      # the top-level config's (Idefics3Config) decides
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        return text

    def load_processor(self, model_dir):
        return auto_processor(model_dir)

    def mrope_steps(self, cfg: dict) -> None:
        return None                      # plain RoPE

    def text_tensor_name(self, name: str) -> str | None:
        if name.startswith(TEXT_PREFIX):
            return "model." + name[len(TEXT_PREFIX):]
        return name if name == "lm_head.weight" else None

    def image_placeholder(self, processor) -> str:
        return processor.image_token

    def prepare(self, processor, text: str, images: list, add_special_tokens: bool) -> MultimodalPrompt:
        """The processor over `text` and its images (one sample); each image's tiles and token spans. A tile is
        one run of <image> tokens; the run after <global-img> is an image's last."""
        out = processor(text=[text], images=[images] if images else None, add_special_tokens=add_special_tokens,
                        return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        if not images:
            return MultimodalPrompt(tuple(ids))
        pixels, masks = out["pixel_values"][0], out["pixel_attention_mask"][0]     # (tiles, 3, H, W), (tiles, H, W)
        image_id = processor.image_token_id
        global_id = processor.tokenizer.convert_tokens_to_ids(processor.global_image_tag)
        found, spans, tile = [], [], 0
        for start, end in token_runs(ids, image_id):
            spans.append((start, end))
            if start > 0 and ids[start - 1] == global_id:
                n = len(spans)
                found.append(ImageInput({"pixel_values": pixels[tile:tile + n].clone(),
                                         "pixel_attention_mask": masks[tile:tile + n].clone()}, tuple(spans)))
                tile, spans = tile + n, []
        if len(found) != len(images) or tile != pixels.shape[0] or spans:
            raise ValueError(f"the processor's prompt has {len(found)} images of {tile} tiles, expected "
                             f"{len(images)} images of {pixels.shape[0]} tiles")
        return MultimodalPrompt(tuple(ids), tuple(found))

    def load_encoder(self, model_dir, cfg: dict, dtype: torch.dtype, device: torch.device) -> "Idefics3Encoder":
        tensors = read_tensors(model_dir, (VISION_PREFIX, PROJECTOR), dtype, device)
        tower = {name[len(VISION_PREFIX):]: t for name, t in tensors.items() if name.startswith(VISION_PREFIX)}
        return Idefics3Encoder(VisionConfig.read(cfg["vision_config"]), tower, tensors[PROJECTOR],
                               cfg.get("scale_factor", 2), dtype, device)


class Idefics3Encoder:
    """encode(image) -> (tiles * image_seq_len, text hidden): SigLIP over the image's tiles, pixel shuffle (each
    scale² neighbouring patches' features concatenated), the projector (no bias)."""

    def __init__(self, config: VisionConfig, tower: dict[str, torch.Tensor], projector: torch.Tensor,
                 scale_factor: int, dtype: torch.dtype, device: torch.device):
        self.tower = SiglipTower(config, tower)
        self.projector, self.scale, self.dtype, self.device = projector, scale_factor, dtype, device
        self.patch_size = config.patch_size

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> torch.Tensor:
        pixels = image.pixel_inputs["pixel_values"].to(self.device, self.dtype)          # (n, 3, H, W)
        mask = image.pixel_inputs["pixel_attention_mask"].to(self.device)               # (n, H, W)
        p = self.patch_size
        patch_mask = mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0        # (n, H/p, W/p)
        hidden = self.tower(pixels, patch_mask)                                          # (n, P, D)
        out = F.linear(pixel_shuffle(hidden, self.scale), self.projector)               # (n, P/s², text hidden)
        return out.reshape(-1, out.shape[-1])


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """(n, P, D) -> (n, P / scale², D * scale²): Idefics3Connector.pixel_shuffle on a square grid of patches."""
    n, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(n, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (scale * scale), dim * scale * scale)


IDEFICS3 = Idefics3Family()
