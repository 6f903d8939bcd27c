"""LLaVA (1.5): a CLIP tower's chosen hidden layer, its class token dropped ("default") or kept ("full"), through a
two-layer GELU projector, into a Llama-shaped (or any text family's) language model.

Owns the family's VisionFamily: the processor's prompt (transformers' LlavaProcessor writes one run of <image> tokens
per image, one per patch), the tensor names in both of transformers' layouts (legacy `language_model.model.*`,
`vision_tower.vision_model.*`, and today's `model.language_model.*`, `model.vision_tower.*`), and the encoder
(modeling_llava.py's get_image_features and LlavaMultiModalProjector written as ours).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmi_handler.engine.model.vision import ImageInput, MultimodalPrompt, auto_processor, read_tensors, token_runs
from lmi_handler.engine.model.vision.clip import ClipTower
from lmi_handler.engine.model.vision.siglip import ACTIVATIONS, VisionConfig

TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                 ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
TOWER_PREFIXES = ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.",
                  "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class LlavaFamily:
    model_types = ("llava",)

    def load_processor(self, model_dir):
        return auto_processor(model_dir)

    def mrope_steps(self, cfg: dict) -> None:
        return None                      # plain RoPE

    def text_config(self, cfg: dict) -> dict:
        text = dict(cfg.get("text_config") or {})
        text.setdefault("model_type", "llama")
        if cfg.get("tie_word_embeddings") is not None:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        return text

    def text_tensor_name(self, name: str) -> str | None:
        for old, new in TEXT_PREFIXES:
            if name.startswith(old):
                return new + name[len(old):]
        return None

    def image_placeholder(self, processor) -> str:
        return processor.image_token

    def prepare(self, processor, text: str, images: list, add_special_tokens: bool) -> MultimodalPrompt:
        """The processor over `text` and its images; image k is the k-th run of image tokens and pixel_values[k]."""
        out = processor(text=[text], images=images or None, add_special_tokens=add_special_tokens, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        if not images:
            return MultimodalPrompt(tuple(ids))
        spans = token_runs(ids, processor.image_token_id)
        pixels = out["pixel_values"]                                                  # (images, 3, S, S)
        if len(spans) != len(images) or pixels.shape[0] != len(images):
            raise ValueError(f"the processor's prompt has {len(spans)} image runs and {pixels.shape[0]} pixel "
                             f"tensors for {len(images)} images")
        return MultimodalPrompt(tuple(ids), tuple(ImageInput({"pixel_values": pixels[k:k + 1].clone()}, (span,))
                                                  for k, span in enumerate(spans)))

    def load_encoder(self, model_dir, cfg: dict, dtype: torch.dtype, device: torch.device) -> "LlavaEncoder":
        tensors = read_tensors(model_dir, TOWER_PREFIXES + PROJECTOR_PREFIXES, dtype, device)
        tower, projector = {}, {}
        for name, t in tensors.items():
            for prefix in TOWER_PREFIXES:      # the longest first: vision_model. is part of the prefix where saved
                if name.startswith(prefix):
                    tower[name[len(prefix):]] = t
                    break
            else:
                projector[name.split("multi_modal_projector.")[1]] = t
        return LlavaEncoder(VisionConfig.read(cfg["vision_config"]), tower, projector, cfg, dtype, device)


class LlavaEncoder:
    """encode(image) -> (patches [+ 1 with "full"], text hidden): CLIP's vision_feature_layer hidden states (a list
    of layers: concatenated), the class token dropped under "default", then linear_1, the projector's activation,
    linear_2."""

    def __init__(self, config: VisionConfig, tower: dict, projector: dict, cfg: dict, dtype: torch.dtype,
                 device: torch.device):
        self.tower, self.projector, self.dtype, self.device = ClipTower(config, tower), projector, dtype, device
        layer = cfg.get("vision_feature_layer", -2)
        self.layers = [layer] if isinstance(layer, int) else list(layer)
        self.layers = [i if i >= 0 else config.num_layers + 1 + i for i in self.layers]    # of num_layers + 1 states
        self.drop_cls = cfg.get("vision_feature_select_strategy", "default") == "default"
        self.act = ACTIVATIONS[cfg.get("projector_hidden_act", "gelu")]

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> torch.Tensor:
        pixels = image.pixel_inputs["pixel_values"].to(self.device, self.dtype)           # (1, 3, S, S)
        states = self.tower.hidden_states(pixels, max(self.layers))
        features = torch.cat([states[i][:, 1:] if self.drop_cls else states[i] for i in self.layers], dim=-1)
        p = self.projector
        h = self.act(F.linear(features, p["linear_1.weight"], p.get("linear_1.bias")))
        out = F.linear(h, p["linear_2.weight"], p.get("linear_2.bias"))                  # (1, tokens, hidden)
        return out.reshape(-1, out.shape[-1])


LLAVA = LlavaFamily()
