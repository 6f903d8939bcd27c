"""Llama-family forward pass (Llama, SmolLM, Qwen2-style q/k/v bias) over one flat token batch.

Owns the architecture: RoPE variants, GQA attention projections, RMSNorm, SwiGLU MLP, lm_head;
leaves reading config/safetensors to loader.py and the paged attention kernels to attention.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lmi_handler.engine.model.attention import (AttentionMetadata, attention_padded,
                                                attention_per_sequence, write_kv)


@dataclass(frozen=True)
class LlamaArgs:
    """The architecture knobs we read from an HF config.json (see loader.args_from_config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)   # rope_type + its parameters; {} = default
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # bias on q/k/v (Llama attention_bias, always on for Qwen2)
    o_proj_bias: bool = False      # bias on o_proj (Llama attention_bias; never for Qwen2)
    mlp_bias: bool = False


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies, as transformers' ROPE_INIT_FUNCTIONS compute them.

    Supports rope_type default, linear (positions / factor) and llama3 (Llama 3.1 smoothing).
    Raises: ValueError for other types (dynamic, yarn, longrope are not implemented).
    """
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = args.rope_scaling.get("rope_type", args.rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / args.rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, args.rope_scaling)
    raise ValueError(f"rope_type={rope_type!r} is not supported (default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, the band between interpolated."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class GemmTiles:
    """Batch-invariant GEMM plan for one forward: rows [0, num_large_rows) are multiplied `large`
    rows at a time, the rest `small` rows at a time (zero-padded to whole tiles).

    BLAS picks its kernel (and so its reduction order) by the number of rows, e.g. GEMV for one
    row, so a plain GEMM makes a row's bits depend on its batch. A fixed tile puts every row
    through the same kernel whatever else is in the batch. The runner sends the rows of long
    prefill chunks to the large tile (fast GEMM) and decode rows to the small one (cheap padding).
    Measured on MKL/AVX-512 with 2 threads: tiles of 2 and 16 rows are invariant, 4 and 8 are not.
    """

    num_large_rows: int
    large: int = 16
    small: int = 2


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           tiles: GemmTiles | None) -> torch.Tensor:
    """x @ weight.T (+ bias). x: (T, in), weight: (out, in) -> (T, out) in x's dtype.

    tiles None: one plain GEMM over all T rows (fastest, not batch-invariant).
    """
    if tiles is None:
        return F.linear(x, weight, bias)
    n = tiles.num_large_rows
    parts = [_tiled_matmul(x[:n], weight, tiles.large)] if n else []
    if n < x.shape[0]:
        parts.append(_tiled_matmul(x[n:], weight, tiles.small))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if bias is None else out + bias


def _tiled_matmul(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    """x @ weight.T as one bmm over zero-padded `tile`-row slices of x: (T, in) -> (T, out)."""
    num_rows = x.shape[0]
    num_tiles = -(-num_rows // tile)
    xp = F.pad(x, (0, 0, 0, num_tiles * tile - num_rows)).view(num_tiles, tile, -1)
    out = torch.bmm(xp, weight.t().expand(num_tiles, -1, -1))     # (num_tiles, tile, out)
    return out.view(num_tiles * tile, -1)[:num_rows]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as transformers' LlamaRMSNorm: normalize in float32, scale in the model dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos, sin: (T, 1, head_dim) in x's dtype (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        q_out = args.num_heads * args.head_dim
        kv_out = args.num_kv_heads * args.head_dim
        # q, k, v fused into one projection (split by row blocks: q, then k, then v)
        self.qkv_weight = nn.Parameter(torch.empty(q_out + 2 * kv_out, args.hidden_size))
        self.qkv_bias = nn.Parameter(torch.zeros(q_out + 2 * kv_out)) if args.attention_bias else None
        self.o_weight = nn.Parameter(torch.empty(args.hidden_size, q_out))
        self.o_bias = nn.Parameter(torch.zeros(args.hidden_size)) if args.o_proj_bias else None
        self.scale = args.head_dim ** -0.5

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, tiles: GemmTiles | None):
        a = self.args
        qkv = linear(x, self.qkv_weight, self.qkv_bias, tiles)
        q, k, v = qkv.split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim,
                             a.num_kv_heads * a.head_dim], dim=-1)
        q = apply_rope(q.reshape(-1, a.num_heads, a.head_dim), cos, sin)
        k = apply_rope(k.reshape(-1, a.num_kv_heads, a.head_dim), cos, sin)
        v = v.reshape(-1, a.num_kv_heads, a.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        attend = attention_padded if tiles is None else attention_per_sequence
        o = attend(q, k_cache, v_cache, meta, self.scale)             # (T, H, D)
        return linear(o.reshape(-1, a.num_heads * a.head_dim), self.o_weight, self.o_bias, tiles)


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_up_weight = nn.Parameter(torch.empty(2 * args.intermediate_size, args.hidden_size))
        self.down_weight = nn.Parameter(torch.empty(args.hidden_size, args.intermediate_size))
        self.gate_up_bias = (nn.Parameter(torch.zeros(2 * args.intermediate_size))
                             if args.mlp_bias else None)
        self.down_bias = nn.Parameter(torch.zeros(args.hidden_size)) if args.mlp_bias else None

    def forward(self, x: torch.Tensor, tiles: GemmTiles | None) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_weight, self.gate_up_bias, tiles).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_weight, self.down_bias, tiles)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args)

    def forward(self, x, cos, sin, kv_cache, meta, tiles: GemmTiles | None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, tiles)
        return x + self.mlp(self.post_attention_layernorm(x), tiles)


class LlamaModel(nn.Module):
    """Decoder stack + lm_head over a flat token batch.

    Every forward takes `tiles`: None runs plain GEMMs and one padded attention call (fastest);
    a GemmTiles runs row-tiled GEMMs and one attention call per sequence, which makes each
    sequence's output bitwise independent of the rest of the batch.
    """

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Parameter(torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = (self.embed_tokens if args.tie_word_embeddings
                        else nn.Parameter(torch.empty(args.vocab_size, args.hidden_size)))
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, tiles: GemmTiles | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) int64. kv_caches[l]: (K, V), each (num_blocks, block_size,
        num_kv_heads, head_dim). Writes this step's K/V; returns final-norm hidden states (T, hidden)."""
        x = F.embedding(input_ids, self.embed_tokens)
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]   # (T, D/2) float32
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]                 # (T, 1, D)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta, tiles)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, tiles: GemmTiles | None = None) -> torch.Tensor:
        """hidden: (N, hidden_size) -> (N, vocab_size) float32."""
        return linear(hidden, self.lm_head, None, tiles).float()
