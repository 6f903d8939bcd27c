"""Llama-family forward pass (Llama, SmolLM, Qwen2-style q/k/v bias) over one flat token batch.

Owns the architecture: RoPE variants, GQA attention projections, RMSNorm, SwiGLU MLP, lm_head, and
where a tensor-parallel shard of it meets the other ranks (vocabulary-parallel embedding and lm_head,
the all-reduce after o_proj and down_proj); leaves reading config/safetensors to loader.py, the paged
attention kernels to attention.py and the collectives themselves to engine/parallel/group.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lmi_handler.engine.model.attention import AttentionMetadata, attend, attention_paged, write_kv
from lmi_handler.engine.model.lora import LoraBatch
from lmi_handler.engine.model.kernels import (
    PackedWeight,
    bf16_dot_form,
    cpu_kernels,
    fused_add_rmsnorm,
    fused_rope_kv_write,
    fused_silu_mul,
    pack_weight,
    packed_linear,
    panel_arena,
    panels_shape,
)


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


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """RoPE's cos and sin rows, rotate-half layout (transformers' LlamaRotaryEmbedding's values, computed in
    float32, then cast): positions (T,) int64 -> ((T, head_dim), (T, head_dim)) in `dtype`."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]      # (T, D/2) float32
    emb = torch.cat((freqs, freqs), dim=-1)                              # (T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


ROPE_SLAB = 256   # positions per slab of LlamaModel's RoPE table (256 * head_dim floats: whole 32-float vectors)

INVARIANT_TILE = 16   # rows per bmm tile on the PyTorch fallback (MKL: 16-row tiles measured invariant)
CUDA_TILES_PER_CALL = 8   # CUDA: tiles per bmm call, a fixed shape (128 rows) so cuBLAS's choice is fixed


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None,
           invariant: bool) -> torch.Tensor:
    """x @ weight.T (+ bias). x: (T, in), weight: (out, in) or its PackedWeight -> (T, out) in x's dtype.

    PackedWeight (float32, bfloat16 or int8 panels on CPU, set up by LlamaModel.pack_weights): the C++
    kernel, one fixed chain of float32 operations per output, so a row's bits never depend on the
    batch. A plain weight: one F.linear when not
    `invariant` (fastest; BLAS picks kernels by row count, e.g. GEMV for one row, so bits move with
    the batch); when `invariant`, bmm over zero-padded 16-row tiles (the fallback where the C++ kernels
    are unavailable, and CUDA: every row goes through the same BLAS kernel whatever its batch; _tiled_matmul).
    """
    if isinstance(weight, PackedWeight):
        return packed_linear(x, weight, bias)
    if not invariant:
        return F.linear(x, weight, bias)
    out = _tiled_matmul(x, weight, INVARIANT_TILE, None if x.device.type == "cpu" else CUDA_TILES_PER_CALL)
    return out if bias is None else out + bias


class Collectives(Protocol):
    """What a tensor-parallel shard of the model calls on its group (engine/parallel/group.TPGroup)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_rows(self, x: torch.Tensor, owner: torch.Tensor) -> torch.Tensor: ...

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None: ...


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None,
                        invariant: bool, group: Collectives | None) -> torch.Tensor:
    """A row-parallel linear (o_proj, down_proj: this rank holds a slice of the input features): its partial
    x @ weight.T in float32, summed over the ranks in rank order (group.all_reduce: bitwise the same on every
    rank and per row), then the bias once (every rank holds it whole), then rounded once to x's dtype.
    group None (one process): linear(). x: (T, in / degree) -> (T, out) in x's dtype.

    Summing float32 partials (not bf16 ones) keeps a bf16 model's reduce as exact as its one-rank
    accumulator; on CPU the doubled bytes are a (T, hidden) exchange per layer, small beside the weights.
    """
    if group is None:
        return linear(x, weight, bias, invariant)
    if isinstance(weight, PackedWeight):
        partial = packed_linear(x, weight, None, torch.float32)
    else:
        partial = linear(x, weight, None, invariant).float()
    out = group.all_reduce(partial)                                  # (T, out) float32
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _tiled_matmul(x: torch.Tensor, weight: torch.Tensor, tile: int, tiles_per_call: int | None = None) -> torch.Tensor:
    """x @ weight.T over zero-padded `tile`-row slices of x: (T, in) -> (T, out) in x's dtype.

    CPU: one bmm over all the tiles (MKL runs every tile through the same kernel whatever their number,
    measured): `tiles_per_call` None. CUDA: cuBLAS picks its kernel (split-K among its choices) by the whole
    problem's shape, the batch count included, so linear() passes CUDA_TILES_PER_CALL: the tiles go that
    many at a time, the last call padded with zero tiles, every call the same shape, so a row's bits do
    not depend on how many rows share its step.
    """
    num_rows = x.shape[0]
    num_tiles = -(-num_rows // tile)
    group = tiles_per_call or num_tiles
    num_calls = -(-num_tiles // group)
    xp = F.pad(x, (0, 0, 0, num_calls * group * tile - num_rows)).view(num_calls, group, tile, -1)
    w = weight.t().expand(group, -1, -1)
    outs = [torch.bmm(xp[i], w) for i in range(num_calls)]           # each (group, tile, out)
    out = outs[0] if num_calls == 1 else torch.cat(outs)
    return out.view(num_calls * group * tile, -1)[:num_rows]


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

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, invariant: bool,
                group: Collectives | None = None, lora: LoraBatch | None = None, index: int = 0):
        a = self.args
        qkv = linear(x, self.qkv_weight, self.qkv_bias, invariant)
        if lora is not None:
            qkv = lora.add(qkv, x, index, "qkv_proj")
        q, k, v = qkv.split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim,
                             a.num_kv_heads * a.head_dim], dim=-1)
        q = apply_rope(q.reshape(-1, a.num_heads, a.head_dim), cos, sin)
        k = apply_rope(k.reshape(-1, a.num_kv_heads, a.head_dim), cos, sin)
        v = v.reshape(-1, a.num_kv_heads, a.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = attend(q, k_cache, v_cache, meta, self.scale, invariant).reshape(-1, a.num_heads * a.head_dim)
        out = row_parallel_linear(o, self.o_weight, self.o_bias, invariant, group)
        return out if lora is None else lora.add(out, o, index, "o_proj")


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_up_weight = nn.Parameter(torch.empty(2 * args.intermediate_size, args.hidden_size))
        self.down_weight = nn.Parameter(torch.empty(args.hidden_size, args.intermediate_size))
        self.gate_up_bias = (nn.Parameter(torch.zeros(2 * args.intermediate_size))
                             if args.mlp_bias else None)
        self.down_bias = nn.Parameter(torch.zeros(args.hidden_size)) if args.mlp_bias else None

    def forward(self, x: torch.Tensor, invariant: bool, group: Collectives | None = None,
                lora: LoraBatch | None = None, index: int = 0) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, invariant)
        if lora is not None:
            gate_up = lora.add(gate_up, x, index, "gate_up_proj")
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        out = row_parallel_linear(act, self.down_weight, self.down_bias, invariant, group)
        return out if lora is None else lora.add(out, act, index, "down_proj")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args)

    def forward(self, x, cos, sin, kv_cache, meta, invariant: bool, group: Collectives | None = None,
                lora: LoraBatch | None = None, index: int = 0):
        """`lora`: the step's adapters, added after each projection of layer `index` (one process only)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, invariant, group, lora, index)
        return x + self.mlp(self.post_attention_layernorm(x), invariant, group, lora, index)


class LlamaModel(nn.Module):
    """Decoder stack + lm_head over a flat token batch.

    Every forward takes `invariant`: True makes each sequence's output bitwise independent of the
    rest of the batch (packed-weight C++ linears after pack_weights(), else 16-row tiled bmm; the
    paged attention kernel, else one SDPA call per sequence); False runs plain F.linear GEMMs.

    After pack_weights(), `fused` (default True) runs the decoder stack as one C++ call a step
    (kernels' DecoderStack: the same row-invariant ops chained without Python dispatch); False
    keeps the module-by-module PyTorch path, the reference it is tested against.

    Tensor parallelism: built with `layout` (engine/parallel/layout.ShardLayout), the model is rank
    layout.rank's shard: `args` are the shard's shapes (its query and KV heads, intermediate columns and
    vocabulary rows), and `group` (set by the runner) its collectives. The embedding looks up the ids
    this rank holds and takes each row from its owner (exact); o_proj and down_proj are all-reduced in
    rank order (row_parallel_linear); compute_logits gathers the vocabulary slices to rank 0. The fused
    C++ layer has no place for the reduce, so packed shards run the same C++ ops one by one from Python
    with the reduce between them (`_forward_split`; at degree 1 bitwise the fused layer's result).

    LoRA: a step with adapters (`lora`, a LoraBatch) adds each row's adapter term after every projection
    (qkv_proj, o_proj, gate_up_proj, down_proj). Packed, the fused C++ stack adds them itself (forward_lora,
    kernels/lora.h, row by row); the PyTorch modules call LoraBatch.add (lora_delta).
    """

    fused = True
    kernel_backend = "cpp"      # option.kernel_backend's name for this path (loader.py sets the chosen one)
    _stack = None   # (kernels module, its DecoderStack), made by _forward_fused

    def __init__(self, args: LlamaArgs, layout=None):
        super().__init__()
        self.layout = layout
        self.group: Collectives | None = None     # the runner sets it on a tensor-parallel rank
        if layout is not None:
            args = replace(args, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads,
                           intermediate_size=layout.intermediate_size, vocab_size=layout.vocab_size)
        self.args = args
        self.embed_tokens = nn.Parameter(torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = (self.embed_tokens if args.tie_word_embeddings
                        else nn.Parameter(torch.empty(args.vocab_size, args.hidden_size)))
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def pack_weights(self, kind: str = "float32", lm_head_kind: str | None = None, huge_pages: bool = True) -> bool:
        """Repack every linear weight for the C++ row-invariant kernel, in place; returns whether it packed.

        kind: the decoder layers' panels ("float32", "bfloat16" or "int8", see kernels.PackedWeight),
        made from the weights as they are now (the checkpoint's values: int8 quantizes them, float32 and
        bfloat16 convert them). lm_head_kind: lm_head's panels (default `kind`). Only on CPU with the
        kernels built. The panels of every layer and lm_head share one buffer (panel_arena, step order),
        reserved first; its pages are touched only as each weight is packed and replaced, one copy held at a
        time, so peak memory grows by about one weight. A tied lm_head packed as float32 or bfloat16
        replaces the embedding too (its rows are read back from the panels, exactly); packed as int8 it
        leaves the embedding as it is.
        `huge_pages`: the panels in huge-page memory (kernels.empty_huge).
        """
        if self.embed_tokens.device.type != "cpu" or cpu_kernels() is None:
            return False
        self._stack = None
        linears = [(module, name) for layer in self.layers
                   for module, name in ((layer.self_attn, "qkv_weight"), (layer.self_attn, "o_weight"),
                                        (layer.mlp, "gate_up_weight"), (layer.mlp, "down_weight"))]
        head_kind = lm_head_kind or kind
        # every panel in one buffer, in the order a step reads them (panel_arena: huge pages throughout)
        outs = panel_arena([(panels_shape(*getattr(m, n).shape, kind), kind) for m, n in linears]
                           + [(panels_shape(*self.lm_head.shape, head_kind), head_kind)], huge_pages)
        for (module, name), out in zip(linears, outs):
            packed = pack_weight(getattr(module, name).detach(), kind, huge_pages, out=out)
            delattr(module, name)                     # drop the Parameter before holding both
            setattr(module, name, packed)
        tied = self.lm_head is self.embed_tokens
        packed = pack_weight(self.lm_head.detach(), head_kind, huge_pages, out=outs[-1])
        del self.lm_head
        self.lm_head = packed
        if tied and packed.scale is None:
            del self.embed_tokens
            self.embed_tokens = packed
        # the checkpoint's tensors may be views of one mapped file: copy the small ones left (norms,
        # biases) so that no view keeps the whole file resident next to the packed copy
        for param in self.parameters():
            param.data = param.data.clone()
        return True

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) int64 -> (T, hidden) rows of the embedding (exact copies, packed or not). A shard looks up
        the ids of its vocabulary slice (others clamped into it, then discarded) and every row comes from
        the rank that holds its id (group.gather_rows, a copy): bitwise the one-process embedding."""
        if self.group is None:
            return self._lookup(input_ids)
        start, stop = self.layout.vocab
        rows = self._lookup((input_ids - start).clamp_(0, stop - start - 1))
        return self.group.gather_rows(rows, input_ids // (stop - start))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, PackedWeight):
            return self.embed_tokens.rows(ids)
        return F.embedding(ids, self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, invariant: bool = True, lora: LoraBatch | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) int64. kv_caches[l]: (K, V), each (num_blocks, block_size,
        num_kv_heads, head_dim). `lora`: the step's adapters (None: no row has one; never on a shard).
        Writes this step's K/V; returns final-norm hidden states (T, hidden)."""
        x = self.embed(input_ids)
        if self.fused and isinstance(self.layers[0].self_attn.qkv_weight, PackedWeight) \
                and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu":
            cos, sin = self._rope_rows(positions, max(meta.context_lens_host, default=0), x.dtype)
            if self.group is None:
                return self._forward_fused(x, cos, sin, kv_caches, meta, lora)
            return self._forward_split(x, cos, sin, kv_caches, meta)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]                         # (T, 1, D)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin, kv_cache, meta, invariant, self.group, lora, i)
        return self.norm(x)

    _rope_table = None   # (cos, sin) of positions 0 .. len - 1, (len, head_dim) in one dtype; see _rope_rows

    def _rope_rows(self, positions: torch.Tensor, num_positions: int, dtype: torch.dtype):
        """rope_cos_sin(positions) as rows of a table of every position below `num_positions` (the step's
        longest context), grown in slabs of ROPE_SLAB positions when a step needs more: two index_selects a
        step instead of the ~10 ops of computing them (on CPU a step's few rows cost more in dispatch than in
        arithmetic). A slab's elements are computed as a step's are (rope_cos_sin, ROPE_SLAB * head_dim
        elements: whole vectors, no scalar tail, one thread), so a position's row is the one the step would
        compute wherever its (T, head_dim) has no tail (head_dim a multiple of 32), and the same for every
        batch always. positions: (T,) int64 CPU -> (T, head_dim) cos, sin in `dtype`."""
        table = self._rope_table
        if table is None or table[0].dtype != dtype or table[0].shape[0] < num_positions:
            have = 0 if table is None or table[0].dtype != dtype else table[0].shape[0]
            want = -(-max(num_positions, 2 * have, ROPE_SLAB) // ROPE_SLAB) * ROPE_SLAB
            slabs = [rope_cos_sin(torch.arange(start, start + ROPE_SLAB), self.inv_freq, dtype)
                     for start in range(have, want, ROPE_SLAB)]
            cos = torch.cat(([table[0]] if have else []) + [c for c, _ in slabs])
            sin = torch.cat(([table[1]] if have else []) + [s for _, s in slabs])
            table = self._rope_table = (cos, sin)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                       lora: LoraBatch | None = None) -> torch.Tensor:
        """The decoder stack and final norm as one C++ call (kernels' DecoderStack over packed CPU weights,
        bitwise _forward_split's C++ ops called one by one; the stack's gate_up linear applies silu * up in
        its store, linear_silu, the same bits as linear then silu_mul); x: (T, hidden) float32 or
        bfloat16, the activations' (and KV cache's) dtype. The stack holds the weights' tensors, made at the first call after
        pack_weights (weights replaced after that, not updated in place, need pack_weights or
        `_stack = None`). `lora`: the step's adapters, added by the stack after each projection (forward_lora,
        kernels/lora.h: row by row, batch-invariant; the set's stacks converted once, LoraBatch.kernel_set)."""
        # the bf16 dot form matters to bf16 panels only (int8 and float32 ones ignore it): asking for it
        # otherwise would run its start-up probe and log a choice that applies to nothing
        ops = cpu_kernels()
        form = bf16_dot_form() if self.layers[0].self_attn.qkv_weight.kind == "bfloat16" else 0
        if self._stack is None or self._stack[0] is not ops:
            self._stack = (ops, self._make_stack(ops))
        # the caches as two lists: pybind converts them every call either way, so they are not cached
        args = (x, cos, sin, [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping,
                meta.block_tables, meta.context_lens, meta.cu_seqlens_q, form)
        if lora is None:
            return self._stack[1].forward(*args)
        return self._stack[1].forward_lora(*args, lora.kernel_set(ops, len(self.layers)), lora.row_slot)

    def _make_stack(self, ops):
        a, layers = self.args, []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight
            layers.append([layer.input_layernorm.weight, qkv.panels, qkv.scale, attn.qkv_bias,
                           o.panels, o.scale, attn.o_bias, layer.post_attention_layernorm.weight,
                           gate_up.panels, gate_up.scale, mlp.gate_up_bias, down.panels, down.scale, mlp.down_bias])
        first = self.layers[0]
        return ops.DecoderStack(layers, self.norm.weight, a.num_heads, a.num_kv_heads, a.intermediate_size,
                                first.input_layernorm.eps, self.norm.eps, first.self_attn.scale)

    def _forward_split(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                       lora: LoraBatch | None = None) -> torch.Tensor:
        """_forward_fused's computation as C++ ops called one by one (the gate_up linear, then silu_mul,
        where the stack fuses them), so that a tensor-parallel shard can all-reduce after
        o_proj and down_proj (row_parallel_linear). `lora` (one process only): the step's adapters, added after
        each projection by the same C++ call the fused stack makes (LoraSet.add; tests' check of forward_lora).
        Each residual add is folded into the next norm (as in the fused layer); with group None the result is
        bitwise _forward_fused's (with the same `lora`)."""
        a, group = self.args, self.group
        x = x.contiguous().clone()          # updated in place by every residual add
        cos, sin = cos.contiguous(), sin.contiguous()
        delta = None
        if lora is not None:
            kernel_set = lora.kernel_set(cpu_kernels(), len(self.layers))

            def add(y, x_in, i, projection):
                return kernel_set.add(y, x_in, lora.row_slot, i, projection)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            h = fused_add_rmsnorm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.eps)
            qkv = packed_linear(h, attn.qkv_weight, attn.qkv_bias)
            if lora is not None:
                qkv = add(qkv, h, i, 0)
            q = fused_rope_kv_write(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, a.num_heads, a.num_kv_heads)
            o = attention_paged(q, k_cache, v_cache, meta, attn.scale).view(x.shape[0], -1)   # (T, H * D)
            delta = row_parallel_linear(o, attn.o_weight, attn.o_bias, True, group)
            if lora is not None:
                delta = add(delta, o, i, 1)
            h = fused_add_rmsnorm(x, delta, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            gate_up = packed_linear(h, mlp.gate_up_weight, mlp.gate_up_bias)
            if lora is not None:
                gate_up = add(gate_up, h, i, 2)
            act = fused_silu_mul(gate_up)
            delta = row_parallel_linear(act, mlp.down_weight, mlp.down_bias, True, group)
            if lora is not None:
                delta = add(delta, act, i, 3)
        return fused_add_rmsnorm(x, delta, self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden: torch.Tensor, invariant: bool = True) -> torch.Tensor | None:
        """hidden: (N, hidden_size) -> (N, vocab_size) float32. A packed lm_head writes float32 straight
        from its float32 accumulators (bf16 models too: logits are never rounded to bf16).
        A tensor-parallel shard computes its vocabulary slice's logits, gathered to rank 0 in rank order
        (each logit is one rank's whole dot product: bitwise the one-process value for the same hidden);
        the other ranks get None."""
        if isinstance(self.lm_head, PackedWeight):
            logits = packed_linear(hidden, self.lm_head, None, torch.float32)
        else:
            logits = linear(hidden, self.lm_head, None, invariant).float()
        return logits if self.group is None else self.group.gather_last_dim(logits)
