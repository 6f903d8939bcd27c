"""Qwen2-VL and Qwen2.5-VL: a ViT over each image's patches at its own resolution (2D rotary, Qwen2.5's windowed
attention between full-attention blocks), 2 x 2 neighbouring patches merged into one token of the language model,
a Qwen2 decoder with M-RoPE (families.py's qwen2_vl_text / qwen2_5_vl_text rows, spec.RopeSpec.mrope_section).

Owns the family's VisionFamily (the processor's prompt: each image one run of <|image_pad|> tokens, its
image_grid_thw; the text config and tensor names) and the tower (modeling_qwen2_vl.py's
Qwen2VisionTransformerPretrainedModel and modeling_qwen2_5_vl.py's Qwen2_5_VisionTransformerPretrainedModel written
as ours, in torch ops on the engine's device and dtype). Leaves the prompt's position streams to mrope.py.

A patch is t x p x p pixels of each channel (temporal_patch_size t: a still image is repeated t times), flattened
by the processor in merge-block order: the 4 patches of one merged token are consecutive rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmi_handler.config import ConfigError
from lmi_handler.engine.model.mrope import MropeSteps
from lmi_handler.engine.model.vision import ImageInput, MultimodalPrompt, token_runs

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}
VISION_PREFIXES = ("visual.", "model.visual.")
IMAGE_TOKEN = "<|image_pad|>"               # one merged patch of an image in the prompt (Qwen's tokenizers)
TEXT_PREFIX = "model.language_model."      # a layout transformers 4.x saved (with model.visual.*); the hub's: model.layers.*


@dataclass(frozen=True)
class TowerConfig:
    """The tower's shape from config.json's vision_config (read through transformers' config class, its
    defaults and legacy keys). version 2: LayerNorm and a GELU MLP, full attention in every block; 2.5: RMSNorm,
    a SwiGLU MLP with biases, windows of window_size pixels except in fullatt_block_indexes."""

    version: str
    width: int                # the ViT's hidden size (Qwen2-VL's embed_dim)
    out_width: int            # the language model's hidden size (the merger's output)
    num_heads: int
    depth: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    merge: int                # spatial_merge_size
    activation: str
    rope_theta: float
    window_size: int | None = None
    full_blocks: tuple[int, ...] = ()

    @classmethod
    def read(cls, cfg: dict) -> "TowerConfig":
        from lmi_handler.engine.model.families import hf_config_of

        v = hf_config_of(cfg).vision_config
        if v.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"config.json vision_config.hidden_act={v.hidden_act!r} is not supported; supported: "
                              f"{sorted(ACTIVATIONS)}")
        theta = float((v.rope_parameters or {}).get("rope_theta", 10000.0))
        common = dict(num_heads=v.num_heads, depth=v.depth, patch_size=v.patch_size, in_channels=v.in_channels,
                      temporal_patch_size=v.temporal_patch_size, merge=v.spatial_merge_size,
                      activation=v.hidden_act, rope_theta=theta)
        if cfg.get("model_type") == "qwen2_vl":
            return cls("2", width=v.embed_dim, out_width=v.hidden_size, **common)
        return cls("2.5", width=v.hidden_size, out_width=v.out_hidden_size, window_size=v.window_size,
                   full_blocks=tuple(v.fullatt_block_indexes), **common)

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads


class Qwen2VisionTower:
    """forward(pixel_values (N, C t p p), grid_thw [(t, h, w)] in patches, one entry per image or frame) ->
    (N / merge², out_width): every image's merged tokens in the processor's order. `weights`: the checkpoint's
    tensors under visual. (the prefix stripped), in the dtype on the device. Attention never crosses an image
    (nor, on 2.5, a window outside the full-attention blocks)."""

    def __init__(self, config: TowerConfig, weights: dict[str, torch.Tensor]):
        self.c, self.w = config, weights
        self.act = ACTIVATIONS[config.activation]
        spatial = config.head_dim // 2          # h and w rotate head_dim / 4 pairs each
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.patch_weight = weights["patch_embed.proj.weight"].reshape(config.width, -1)   # Conv3d as a linear
        # the version's variant, chosen once: 2's LayerNorm and fc1 / fc2 MLP, 2.5's RMSNorm and SwiGLU
        self._norm = self._layer_norm if config.version == "2" else self._rms_norm
        self._mlp = self._fc_mlp if config.version == "2" else self._swiglu_mlp

    def __call__(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        c = self.c
        x = F.linear(pixel_values.to(self.patch_weight.dtype), self.patch_weight)            # (N, width)
        cos, sin = self._rotary(grid_thw, x.device)                                        # (N, head_dim) f32
        full = _segments([t_h_w[1] * t_h_w[2] for t_h_w in grid_thw for _ in range(t_h_w[0])])
        order, windows = None, full
        if c.version == "2.5":
            order, windows = window_order(grid_thw, c.merge, c.window_size // c.merge // c.patch_size)
            x, cos, sin = (_by_merged_token(t, order, c.merge) for t in (x, cos, sin))
        for i in range(c.depth):
            segments = full if c.version == "2" or i in c.full_blocks else windows
            x = self._block(x, cos, sin, segments, f"blocks.{i}.")
        out = self._merger(x)
        return out if order is None else out[torch.argsort(order)]

    def _rotary(self, grid_thw, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (h, w) in merge-block order -> cos, sin (N, head_dim): the h pairs, then the w pairs,
        repeated for the second half (transformers' VisionRotaryEmbedding and recomposition)."""
        m = self.c.merge
        rows = []
        for t, h, w in grid_thw:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            block = (h // m, m, w // m, m)
            hw = torch.stack([hh.reshape(block).transpose(1, 2).flatten(),
                              ww.reshape(block).transpose(1, 2).flatten()], dim=-1)
            rows.append(hw.repeat(t, 1))
        freqs = torch.cat(rows).to(device)[..., None].float() * self.inv_freq.to(device)     # (N, 2, head_dim / 4)
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def _layer_norm(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """Qwen2-VL: LayerNorm with bias, eps 1e-6."""
        return F.layer_norm(x, (x.shape[-1],), self.w[p + ".weight"], self.w[p + ".bias"], 1e-6)

    def _rms_norm(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """Qwen2.5-VL: RMSNorm in float32, the row rounded to x's dtype, then times the weight; eps 1e-6."""
        x32 = x.float()
        return self.w[p + ".weight"] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def _fc_mlp(self, h: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        h = self.act(F.linear(h, w[p + "fc1.weight"], w[p + "fc1.bias"]))
        return F.linear(h, w[p + "fc2.weight"], w[p + "fc2.bias"])

    def _swiglu_mlp(self, h: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        gate = self.act(F.linear(h, w[p + "gate_proj.weight"], w[p + "gate_proj.bias"]))
        up = F.linear(h, w[p + "up_proj.weight"], w[p + "up_proj.bias"])
        return F.linear(gate * up, w[p + "down_proj.weight"], w[p + "down_proj.bias"])

    def _block(self, x, cos, sin, segments: list[tuple[int, int]], p: str) -> torch.Tensor:
        x = x + self._attention(self._norm(x, p + "norm1"), cos, sin, segments, p + "attn.")
        return x + self._mlp(self._norm(x, p + "norm2"), p + "mlp.")

    def _attention(self, x, cos, sin, segments: list[tuple[int, int]], p: str) -> torch.Tensor:
        """Bidirectional attention within each segment [a, b) of rows (an image, a frame or a window); segments of
        one length run as one batch."""
        w, heads, dim = self.w, self.c.num_heads, self.c.head_dim
        n = x.shape[0]
        q, k, v = F.linear(x, w[p + "qkv.weight"], w[p + "qkv.bias"]).view(n, 3, heads, dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        by_length: dict[int, list[int]] = {}
        for a, b in segments:
            by_length.setdefault(b - a, []).append(a)
        for length, starts in by_length.items():
            rows = (torch.tensor(starts)[:, None] + torch.arange(length)).to(x.device)     # (S, length)
            qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))                     # (S, heads, length, dim)
            out[rows] = _eager_attention(qs, ks, vs, dim ** -0.5).transpose(1, 2)
        return F.linear(out.reshape(n, heads * dim), w[p + "proj.weight"], w[p + "proj.bias"])

    def _merger(self, x: torch.Tensor) -> torch.Tensor:
        """ln_q, then each merge² consecutive rows concatenated -> Linear, GELU (erf), Linear."""
        w, m = self.w, self.c.merge
        h = self._norm(x, "merger.ln_q").reshape(-1, x.shape[-1] * m * m)
        h = F.gelu(F.linear(h, w["merger.mlp.0.weight"], w["merger.mlp.0.bias"]))
        return F.linear(h, w["merger.mlp.2.weight"], w["merger.mlp.2.bias"])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, heads, dim) rotated in float32 (transformers' apply_rotary_pos_emb_vision), back in x's dtype."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return (x32 * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]).to(x.dtype)


def _eager_attention(q, k, v, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v, the softmax in float32 (transformers' eager_attention_forward)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _segments(lengths: list[int]) -> list[tuple[int, int]]:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _by_merged_token(x: torch.Tensor, order: torch.Tensor, merge: int) -> torch.Tensor:
    """Rows of x regrouped by merged token: token order[i]'s merge² rows become the i-th group."""
    unit = merge * merge
    return x.reshape(-1, unit, x.shape[-1])[order].reshape(x.shape)


def window_order(grid_thw, merge: int, window: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Qwen2.5's windows over the merged grid, `window` merged tokens a side (transformers'
    get_vision_window_index): (the merged tokens in window order (M,) int64, each window's [a, b) in patch rows
    of that order). A frame's grid is cut into windows from its top-left; edge windows are smaller."""
    order, bounds, base, row = [], [], 0, 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for frame in range(t):
            for top in range(0, gh, window):
                for left in range(0, gw, window):
                    cell = index[frame, top:top + window, left:left + window].flatten()
                    order.append(cell + base)
                    bounds.append((row, row + cell.numel() * merge * merge))
                    row += cell.numel() * merge * merge
        base += t * gh * gw
    return torch.cat(order), bounds


class Qwen2VLFamily:
    """The VisionFamily of Qwen2-VL and Qwen2.5-VL (engine/model/vision/__init__.py)."""

    model_types = ("qwen2_vl", "qwen2_5_vl")

    def text_config(self, cfg: dict) -> dict:
        """The decoder's config.json dict: transformers' text_config (a flat legacy config.json's text keys
        normalized by the config class: rope_scaling type mrope -> default with its mrope_section), model_type
        qwen2_vl_text / qwen2_5_vl_text, the top-level config's tie_word_embeddings (which transformers ties by)."""
        from lmi_handler.engine.model.families import hf_config_of

        top = hf_config_of(cfg)
        text = top.get_text_config().to_dict()
        text.update(model_type=cfg["model_type"] + "_text", tie_word_embeddings=bool(top.tie_word_embeddings))
        text.pop("architectures", None)
        return text

    def text_tensor_name(self, name: str) -> str | None:
        if name.startswith(VISION_PREFIXES):
            return None
        return "model." + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name

    def image_placeholder(self, processor) -> str:
        """One image in a prompt: <|vision_start|><|image_pad|><|vision_end|>, as Qwen's chat template writes it;
        the processor repeats <|image_pad|> once per merged token."""
        return "<|vision_start|>" + processor.image_token + "<|vision_end|>"

    def mrope_steps(self, cfg: dict) -> MropeSteps:
        """Each step's M-RoPE positions (mrope.py), the image grids merged spatial_merge_size a side."""
        return MropeSteps(TowerConfig.read(cfg).merge)

    def load_processor(self, model_dir) -> "QwenVLProcessor":
        return QwenVLProcessor.load(model_dir)

    def prepare(self, processor: "QwenVLProcessor", text: str, images: list,
                add_special_tokens: bool) -> MultimodalPrompt:
        """The processor over `text` and its images; each image's patch rows, grid and token run."""
        out = processor(text, images, add_special_tokens)
        ids = out["input_ids"]
        if not images:
            return MultimodalPrompt(tuple(ids))
        grids = out["image_grid_thw"].tolist()
        merge = processor.image_processor.merge_size
        runs = token_runs(ids, processor.image_token_id)
        if len(runs) != len(grids) or any(b - a != t * h * w // merge ** 2 for (a, b), (t, h, w) in zip(runs, grids)):
            raise ValueError(f"the processor's prompt has {len(runs)} image token runs for {len(grids)} images")
        found, row = [], 0
        for (start, end), grid in zip(runs, grids):
            n = grid[0] * grid[1] * grid[2]
            found.append(ImageInput({"pixel_values": out["pixel_values"][row:row + n].clone(),
                                     "image_grid_thw": torch.tensor([grid])}, ((start, end),)))
            row += n
        return MultimodalPrompt(tuple(ids), tuple(found))

    def load_encoder(self, model_dir, cfg: dict, dtype: torch.dtype, device: torch.device) -> "Qwen2VLEncoder":
        return Qwen2VLEncoder(Qwen2VisionTower(TowerConfig.read(cfg), tower_weights(model_dir, dtype, device)),
                              dtype, device)


def tower_weights(model_dir, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The checkpoint's visual.* (or model.visual.*) tensors, named without the prefix, in `dtype` on `device`."""
    from pathlib import Path

    from safetensors import safe_open

    from lmi_handler.engine.model.loader import safetensors_files

    out = {}
    for file in safetensors_files(model_dir):
        with safe_open(Path(model_dir) / file, framework="pt") as f:
            for name in f.keys():
                if name.startswith(VISION_PREFIXES):
                    out[name.split("visual.", 1)[1]] = f.get_tensor(name).to(device=device, dtype=dtype)
    return out


class QwenVLProcessor:
    """transformers' Qwen2_5_VLProcessor / Qwen2VLProcessor for images, built from the checkpoint's tokenizer and
    preprocessor_config.json (its PIL image processor, Qwen2VLImageProcessorPil): transformers' own class also
    builds a video processor, which needs torchvision. Called with a prompt and its images, it resizes and
    patchifies each image (smart_resize within the checkpoint's pixel bounds, 28-pixel multiples on a real
    checkpoint), then expands the i-th <|image_pad|> of the text to image i's t * h * w / merge² tokens, as
    transformers' processor does, and tokenizes."""

    def __init__(self, tokenizer, image_processor, chat_template: str | None = None):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token = IMAGE_TOKEN
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.chat_template = chat_template or tokenizer.chat_template

    @classmethod
    def load(cls, model_dir) -> "QwenVLProcessor":
        """From the checkpoint: its tokenizer, preprocessor_config.json and the processor's chat template
        (chat_template.jinja, or chat_template.json's, else the tokenizer's)."""
        import json
        from pathlib import Path

        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        model_dir = Path(model_dir)
        template = None
        if (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        elif (model_dir / "chat_template.json").is_file():
            template = json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
        return cls(AutoTokenizer.from_pretrained(str(model_dir)),
                   Qwen2VLImageProcessorPil.from_pretrained(str(model_dir)), template)

    def __call__(self, text: str, images: list, add_special_tokens: bool = True) -> dict:
        """{"input_ids": list[int], and with images "pixel_values" (N, C t p p) float32, "image_grid_thw" (I, 3)}.
        Raises ValueError when the text's <|image_pad|> count is not the number of images."""
        out: dict = {}
        if text.count(self.image_token) != len(images):
            raise ValueError(f"{len(images)} images but {text.count(self.image_token)} {self.image_token} in the text")
        if images:
            out.update(self.image_processor(images=images, return_tensors="pt"))
            merge = self.image_processor.merge_size
            hold = "\x00image\x00"
            for grid in out["image_grid_thw"].tolist():
                text = text.replace(self.image_token, hold * (grid[0] * grid[1] * grid[2] // merge ** 2), 1)
            text = text.replace(hold, self.image_token)
        out["input_ids"] = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return out


class Qwen2VLEncoder:
    """encode(image) -> (merged tokens, text hidden) in the engine's dtype on its device: the tower over the
    image's patches alone."""

    def __init__(self, tower: Qwen2VisionTower, dtype: torch.dtype, device: torch.device):
        self.tower, self.dtype, self.device = tower, dtype, device

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> torch.Tensor:
        pixels = image.pixel_inputs["pixel_values"].to(self.device, self.dtype)
        grids = [tuple(g) for g in image.pixel_inputs["image_grid_thw"].tolist()]
        return self.tower(pixels, grids)


QWEN2_VL = Qwen2VLFamily()
