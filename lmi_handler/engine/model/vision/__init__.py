"""Vision-language families: how a checkpoint's images become rows of its language model's input embeddings.

Owns the interface every vision family follows (VisionFamily, VisionEncoder) and the objects that carry an image
from the request to the prefill (ImageInput, MultimodalPrompt), plus the table of families (FAMILIES, family_of).
Leaves loading the image bytes and the request's limits to lmi_handler/multimodal/, the language model to the
layer description (families.py builds its spec from `text_config`, forward.py's DecoderModel runs it with the
image rows replaced), and when an image's rows are needed (a prefill chunk) to model_runner.py.

A family (one module here: idefics3.py, llava.py, qwen2_vl.py) provides, as a VisionFamily:

- `model_types`: the config.json model_type values it serves, e.g. ("idefics3", "smolvlm").
- `text_config(cfg) -> dict`: the language model's config.json dict (families.build_spec reads it as any text
  model's: its model_type must be a row of families.FAMILIES).
- `text_tensor_name(name) -> str | None`: a checkpoint tensor's name as the text families spell it
  (`model.layers.{i}.…`, `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight`), or None for a tensor
  of the vision side (the encoder reads those itself).
- `image_placeholder(processor) -> str`: the text a prompt marks one image with before the processor expands it
  (Idefics3 and LLaVA: "<image>"); chat templates write it for an {"type": "image"} part, and TGI's markdown
  `![](url)` is replaced by it.
- `prepare(processor, text, images, add_special_tokens) -> MultimodalPrompt`: CPU, in the request's thread; the
  checkpoint's transformers processor (AutoProcessor, PIL image processors) expands each placeholder of `text`
  into the image's tokens and makes its pixel tensors. Returns the token ids and one ImageInput per image, in
  prompt order (content_hash left empty: the caller fills it from the image's pixels).
- `load_encoder(model_dir, cfg, dtype, device) -> VisionEncoder`: the vision tower and projector, weights read from
  the checkpoint, on the engine's device in the engine's dtype.

A VisionEncoder's `encode(image: ImageInput) -> torch.Tensor` is (image.num_tokens, text hidden_size) in the
engine's dtype on its device: image row r replaces the input embedding of prompt position image.positions()[r].
It is called once per image, alone (never batched with another request's image), so its rows depend on that image
only: a request's tokens are the same whatever shares its steps.

M-RoPE families (Qwen2-VL) carry what their position streams need in ImageInput.pixel_inputs (image_grid_thw);
the language model's positions are theirs to add.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt after the processor: what the encoder takes and where its rows go.

    pixel_inputs: the family's encode() inputs for this image alone (CPU tensors as the processor made them,
    e.g. Idefics3's pixel_values (tiles, 3, H, W) float32 and pixel_attention_mask (tiles, H, W) bool).
    spans: prompt positions [start, end) its embedding rows fill, in order (Idefics3: one span per tile;
    LLaVA, Qwen2-VL: one). content_hash: BLAKE2b of the decoded image (its mode, size and pixels), the prefix
    cache's key for it: the same picture twice hits, a different one with the same text does not.
    """

    pixel_inputs: dict[str, torch.Tensor]
    spans: tuple[tuple[int, int], ...]
    content_hash: bytes = b""

    @property
    def num_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)

    @property
    def start(self) -> int:
        return self.spans[0][0]

    @property
    def end(self) -> int:
        return self.spans[-1][1]

    def positions(self) -> list[int]:
        """The prompt positions of its rows, in row order."""
        return [p for start, end in self.spans for p in range(start, end)]


@dataclass(frozen=True, eq=False)
class MultimodalPrompt:
    """A prompt with images: its token ids (each image's placeholder expanded) and its images in prompt order."""

    token_ids: tuple[int, ...]
    images: tuple[ImageInput, ...] = field(default_factory=tuple)


class VisionEncoder(Protocol):
    def encode(self, image: ImageInput) -> torch.Tensor:
        """(image.num_tokens, text hidden_size) in the engine's dtype on its device."""


class VisionFamily(Protocol):
    model_types: tuple[str, ...]

    def text_config(self, cfg: dict) -> dict: ...

    def text_tensor_name(self, name: str) -> str | None: ...

    def image_placeholder(self, processor: Any) -> str: ...

    def prepare(self, processor: Any, text: str, images: list, add_special_tokens: bool) -> MultimodalPrompt: ...

    def load_encoder(self, model_dir, cfg: dict, dtype: torch.dtype, device: torch.device) -> VisionEncoder: ...


def _families() -> dict[str, VisionFamily]:
    from lmi_handler.engine.model.vision.idefics3 import IDEFICS3

    return {model_type: family for family in (IDEFICS3,) for model_type in family.model_types}


def family_of(cfg: dict) -> VisionFamily | None:
    """The vision family of a config.json dict, or None for a text-only model."""
    return _families().get(cfg.get("model_type", ""))


def vision_model_types() -> list[str]:
    """Every model_type a vision family serves, sorted (for start-up messages)."""
    return sorted(_families())
