"""Vision-language families: how a checkpoint's images become rows of its language model's input embeddings.

Owns the interface every vision family follows (VisionFamily, VisionEncoder) and the objects that carry an image
from the request to the prefill (ImageInput, MultimodalPrompt), plus the table of families (FAMILIES, family_of).
Leaves loading the image bytes and the request's limits to lmi_handler/multimodal/, the language model to the
layer description (families.py builds its spec from `text_config`, forward.py's DecoderModel runs it with the
image rows replaced), and when an image's rows are needed (a prefill chunk) to model_runner.py.

A family (one module here: idefics3.py, llava.py, qwen2_vl.py) provides, as a VisionFamily:

- `model_types`: the config.json model_type values it serves, e.g. ("idefics3",).
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
- `load_processor(model_dir)`: the checkpoint's processor, prepare's first argument (Idefics3: transformers'
  AutoProcessor with PIL image processors; Qwen2-VL: its own, transformers' wants torchvision for video).
- `mrope_steps(cfg)`: None for plain RoPE; Qwen2-VL's mrope.MropeSteps, which the runner asks for each step's
  positions (the three M-RoPE streams of a prompt's images, computed from their image_grid_thw).

A VisionEncoder's `encode(image: ImageInput) -> torch.Tensor` is (image.num_tokens, text hidden_size) in the
engine's dtype on its device: image row r replaces the input embedding of prompt position image.positions()[r].
It is called once per image, alone (never batched with another request's image), so its rows depend on that image
only: a request's tokens are the same whatever shares its steps.

M-RoPE families (Qwen2-VL) carry what their position streams need in ImageInput.pixel_inputs (image_grid_thw);
their mrope_steps turns them into the language model's positions.
"""
from __future__ import annotations

import hashlib
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

    @property
    def cache_key(self) -> bytes:
        """content_hash, or (an image built without one, e.g. in a test) BLAKE2b of its pixel tensors."""
        if self.content_hash:
            return self.content_hash
        digest = hashlib.blake2b(digest_size=32)
        for name in sorted(self.pixel_inputs):
            digest.update(name.encode() + self.pixel_inputs[name].contiguous().cpu().numpy().tobytes())
        return digest.digest()

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

    def load_processor(self, model_dir) -> Any:
        """The checkpoint's processor (prepare's first argument); raises on a checkpoint without one."""

    def mrope_steps(self, cfg: dict) -> Any:
        """The language model's M-RoPE step positions (mrope.MropeSteps: Qwen2-VL), None for plain RoPE."""


def _families() -> dict[str, VisionFamily]:
    from lmi_handler.engine.model.vision.idefics3 import IDEFICS3
    from lmi_handler.engine.model.vision.llava import LLAVA
    from lmi_handler.engine.model.vision.qwen2_vl import QWEN2_VL

    return {model_type: family for family in (IDEFICS3, LLAVA, QWEN2_VL) for model_type in family.model_types}


def family_of(cfg: dict) -> VisionFamily | None:
    """The vision family of a config.json dict, or None for a text-only model."""
    return _families().get(cfg.get("model_type", ""))


def vision_model_types() -> list[str]:
    """Every model_type a vision family serves, sorted (for start-up messages)."""
    return sorted(_families())


def text_config_of(cfg: dict) -> dict:
    """The language model's config.json dict: a vision family's text_config, else `cfg` itself."""
    family = family_of(cfg)
    return cfg if family is None else family.text_config(cfg)


def text_tensors(cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors as the text families name them (a vision family's language-model tensors renamed,
    its vision tensors left out); a text model's unchanged."""
    family = family_of(cfg)
    if family is None:
        return tensors
    return {new: t for name, t in tensors.items() if (new := family.text_tensor_name(name)) is not None}


def auto_processor(model_dir):
    """transformers' AutoProcessor of the checkpoint with the PIL image processors (torchvision is not needed)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir), backend="pil")


def mrope_steps(cfg: dict):
    """The vision family's M-RoPE step positions (mrope.MropeSteps: Qwen2-VL), None for a family without."""
    family = family_of(cfg)
    return None if family is None else family.mrope_steps(cfg)


def load_encoder(model_dir, cfg: dict, dtype: torch.dtype, device: torch.device) -> VisionEncoder | None:
    """The vision family's encoder on `device` in `dtype`, or None for a text-only model."""
    family = family_of(cfg)
    return None if family is None else family.load_encoder(model_dir, cfg, dtype, device)


def read_tensors(model_dir, prefixes: tuple[str, ...], dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose names start with one of `prefixes`, in `dtype` on `device`."""
    from pathlib import Path

    from safetensors import safe_open

    from lmi_handler.engine.model.loader import safetensors_files

    out = {}
    for file in safetensors_files(model_dir):
        with safe_open(Path(model_dir) / file, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefixes):
                    out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return out


def image_block_keys(images: tuple[ImageInput, ...], block_size: int) -> dict[int, bytes]:
    """Block index -> the content hashes of the images whose rows fall in that block (the prefix cache mixes
    them into the block's key: the same tokens with another picture never share cached K/V)."""
    keys: dict[int, bytes] = {}
    for image in images:
        for block in range(image.start // block_size, (image.end - 1) // block_size + 1):
            keys[block] = keys.get(block, b"") + image.cache_key
    return keys


def token_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of `token` in `ids` (a prompt's image placeholders, one run an image)."""
    runs, start = [], None
    for i, t in enumerate(ids + [None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i))
            start = None
    return runs
