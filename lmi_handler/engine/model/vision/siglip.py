"""The SigLIP vision transformer (Idefics3 / SmolVLM's variable-resolution form; Gemma 3's is the fixed-size case)
over one image's tiles, in torch ops on the engine's device and dtype.

Owns the arithmetic of transformers' SiglipVisionTransformer / Idefics3VisionTransformer (modeling_siglip.py,
modeling_idefics3.py), written from them: the patch embedding, the NaViT-style position ids of a partly padded
tile, the pre-norm encoder layers (bidirectional attention over the tile's real patches, GELU-tanh MLP; the layer
CLIP shares, vit_layer) and the post-layernorm. Leaves what follows the tower (pixel shuffle, projector) to the family's module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
               "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


@dataclass(frozen=True)
class VisionConfig:
    """The tower's shape, from config.json's vision_config."""

    hidden_size: int
    num_heads: int
    num_layers: int
    patch_size: int
    image_size: int
    layer_norm_eps: float
    activation: str

    @classmethod
    def read(cls, vision: dict) -> "VisionConfig":
        return cls(hidden_size=vision["hidden_size"], num_heads=vision["num_attention_heads"],
                   num_layers=vision["num_hidden_layers"], patch_size=vision["patch_size"],
                   image_size=vision["image_size"], layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
                   activation=vision.get("hidden_act", "gelu_pytorch_tanh"))

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipTower:
    """SigLIP over a batch of tiles: forward(pixel_values (n, 3, H, W), patch_mask (n, H/p, W/p) bool) ->
    (n, H/p * W/p, hidden) after the post-layernorm. `weights`: the checkpoint's tensors under the tower's
    prefix (embeddings.*, encoder.layers.{i}.*, post_layernorm.*), already in the dtype on the device."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor]):
        self.config, self.w = config, weights
        self.act = ACTIVATIONS[config.activation]

    def __call__(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        c, w = self.config, self.w
        x = F.conv2d(pixel_values, w["embeddings.patch_embedding.weight"], w["embeddings.patch_embedding.bias"],
                     stride=c.patch_size)                                       # (n, D, H/p, W/p)
        x = x.flatten(2).transpose(1, 2)                                        # (n, P, D)
        x = x + F.embedding(self.position_ids(patch_mask), w["embeddings.position_embedding.weight"])
        keep = patch_mask.flatten(1)                                            # (n, P) real patches
        mask = None if bool(keep.all()) else keep[:, None, None, :]             # host sync: once per image
        for i in range(c.num_layers):
            x = vit_layer(x, w, f"encoder.layers.{i}.", c, self.act, mask)
        return F.layer_norm(x, (c.hidden_size,), w["post_layernorm.weight"], w["post_layernorm.bias"],
                            c.layer_norm_eps)

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """(n, P) int64: each real patch's position on the tower's grid of patches_per_side², by its fraction
        of the tile's real patches (Idefics3VisionEmbeddings' bucketize); padding patches 0. A full tile of the
        tower's own size gets 0..P-1."""
        n, rows, cols = patch_mask.shape
        side = self.config.patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=patch_mask.device)
        real_rows = patch_mask[:, :, 0].sum(dim=1)                              # (n,)
        real_cols = patch_mask[:, 0, :].sum(dim=1)
        frac_h = (torch.arange(rows, device=patch_mask.device, dtype=torch.float32)[None, :]
                  * (1.0 / real_rows)[:, None]).clamp(max=1.0 - 1e-6)
        frac_w = (torch.arange(cols, device=patch_mask.device, dtype=torch.float32)[None, :]
                  * (1.0 / real_cols)[:, None]).clamp(max=1.0 - 1e-6)
        bucket_h = torch.bucketize(frac_h, boundaries, right=True)
        bucket_w = torch.bucketize(frac_w, boundaries, right=True)
        ids = (bucket_h[:, :, None] * side + bucket_w[:, None, :]).reshape(n, -1)
        return torch.where(patch_mask.view(n, -1), ids, torch.zeros_like(ids))


def vit_layer(x: torch.Tensor, w: dict[str, torch.Tensor], p: str, c: VisionConfig, act,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """One pre-norm encoder layer of SigLIP / CLIP (their EncoderLayer): x + attention(layer_norm1(x)) over every
    (unmasked) patch, then + fc2(act(fc1(layer_norm2(x)))). x: (n, P, D); mask: (n, 1, 1, P) bool keys or None."""
    n, length, dim = x.shape
    heads = c.num_heads
    h = F.layer_norm(x, (dim,), w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"], c.layer_norm_eps)
    q, k, v = (F.linear(h, w[p + f"self_attn.{name}_proj.weight"], w[p + f"self_attn.{name}_proj.bias"])
               .view(n, length, heads, dim // heads).transpose(1, 2) for name in "qkv")
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)                # (n, heads, P, head_dim)
    a = a.transpose(1, 2).reshape(n, length, dim)
    x = x + F.linear(a, w[p + "self_attn.out_proj.weight"], w[p + "self_attn.out_proj.bias"])
    h = F.layer_norm(x, (dim,), w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"], c.layer_norm_eps)
    h = act(F.linear(h, w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"]))
    return x + F.linear(h, w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])
