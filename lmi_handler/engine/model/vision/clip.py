"""The CLIP vision transformer (LLaVA's tower) over one image, in torch ops on the engine's device and dtype.

Owns the arithmetic of transformers' CLIPVisionTransformer (modeling_clip.py), written from it: the patch embedding
(no bias) after a class embedding, learned positions, the pre-layernorm, the encoder layers (siglip.vit_layer, QuickGELU)
and the hidden states of every layer, from which a LLaVA family picks its feature layer. The post-layernorm (the pooled
output's) is never used by LLaVA and is not applied.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmi_handler.engine.model.vision.siglip import ACTIVATIONS, VisionConfig, vit_layer


class ClipTower:
    """CLIP over a batch of whole images: hidden_states(pixel_values (n, 3, S, S), upto) -> [the encoder's input
    (after pre_layrnorm), the output of layer 1, ..., of layer `upto`], each (n, 1 + P, hidden), the class token
    first (transformers' output hidden_states). `weights`: the tower's tensors without their prefix."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor]):
        self.config, self.w = config, weights
        self.act = ACTIVATIONS[config.activation]

    def hidden_states(self, pixel_values: torch.Tensor, upto: int) -> list[torch.Tensor]:
        c, w = self.config, self.w
        n = pixel_values.shape[0]
        x = F.conv2d(pixel_values, w["embeddings.patch_embedding.weight"], stride=c.patch_size)   # (n, D, g, g)
        x = x.flatten(2).transpose(1, 2)                                                        # (n, P, D)
        cls = w["embeddings.class_embedding"].expand(n, 1, -1)
        x = torch.cat([cls, x], dim=1) + w["embeddings.position_embedding.weight"][None]
        x = F.layer_norm(x, (c.hidden_size,), w["pre_layrnorm.weight"], w["pre_layrnorm.bias"], c.layer_norm_eps)
        states = [x]
        for i in range(upto):
            x = vit_layer(x, w, f"encoder.layers.{i}.", c, self.act)
            states.append(x)
        return states
