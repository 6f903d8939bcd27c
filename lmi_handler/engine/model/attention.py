"""Paged attention over a flat token batch: write new K/V into the block cache, attend causally.

Owns AttentionMetadata and the attention kernels (the C++ paged kernel, the cpp backend's; two SDPA paths,
the benchmarks' torch peers; a pure-PyTorch reference); leaves building the metadata from Sequences to
model_runner.py and projections/RoPE to forward.py and the backends.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmi_handler.engine.model.kernels import cpu_kernels


@dataclass
class AttentionMetadata:
    """Where a step's tokens sit in the batch and in the paged cache.

    Sequence i owns flat rows cu_seqlens_q[i] : cu_seqlens_q[i+1] (its query_lens[i] new tokens)
    and attends to cache positions 0 .. context_lens[i]-1, the new tokens being the last ones:

        context  |<------------ context_lens[i] ------------>|
                 |   already cached    |<- query_lens[i] ->|   (written this step)

    Device tensors feed the kernels; the host lists let the kernels size and loop without a sync.
    """

    slot_mapping: torch.Tensor      # (T,) int64: block_id * block_size + offset of each new token
    block_tables: torch.Tensor      # (S, max_blocks) int32, padded with a valid block id
    context_lens: torch.Tensor      # (S,) int32: cached tokens after this step, new ones included
    cu_seqlens_q: torch.Tensor      # (S+1,) int32: prefix sums of query_lens
    query_lens: list[int]           # host copy, len S
    context_lens_host: list[int]    # host copy of context_lens
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host, default=0)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values in place.

    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim); k, v: (T, num_kv_heads,
    head_dim) in the cache dtype; slot_mapping: (T,) int64.
    """
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """C++ kernel reading K/V straight from the block cache (no per-sequence gather).

    Each (query row, kv head) is one work item: the row's scores against its keys 0..pos in order,
    softmax, then the weighted sum of values in the same order. Nothing in it depends on other rows,
    on the number of sequences or on how a sequence's tokens were cut into chunks, so a row's bits
    are the same alone, in any batch and under any chunking (tests/engine/test_attention.py).
    q: (T, num_heads, head_dim) float32 or bfloat16 CPU; caches contiguous in q's dtype. Scores, softmax
    and the weighted sum run in float32 (bf16 K/V widened exactly); the output is rounded once to q's
    dtype. In bf16 the softmax weights are rounded to bf16 before the weighted sum and the output is
    scaled by the reciprocal of their (float32) sum, as torch's CPU flash attention does (transformers'
    bf16 Llama runs it through sdpa; reference_attention's `weights_dtype`). Returns (T, num_heads, head_dim).
    Raises: RuntimeError (from the kernel) on inconsistent metadata, e.g. a too-short block table.
    """
    return cpu_kernels().paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                         meta.cu_seqlens_q, scale)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's cached K (or V) as a contiguous tensor.

    cache: (num_blocks, block_size, kv_heads, head_dim); block_table: (n,) int32 or int64 with at least
    ceil(context_len / block_size) entries. Returns (context_len, kv_heads, head_dim).
    """
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]     # (a no-op .long() where the table already is int64)
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]


def _causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """(query_len, context_len) bool: query i (at position context_len - query_len + i) sees keys <= it."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= q_pos[:, None]


def attention_per_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Batch-invariant path: one SDPA call per sequence over exactly its own context.

    A sequence's call has the same shapes whatever else is in the batch, so its output is
    bitwise the same alone or batched (the padded path below pads keys, which changes the
    reduction length: measured up to ~5e-7 abs difference on CPU).
    q: (T, num_heads, head_dim). Returns (T, num_heads, head_dim) in q's dtype.
    """
    tables = meta.block_tables.long()                   # once, not per sequence (a kernel each on CUDA)
    outs, start = [], 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
        k = gather_context(k_cache, tables[i], ctx).transpose(0, 1)[None]
        v = gather_context(v_cache, tables[i], ctx).transpose(0, 1)[None]
        qi = q[start:start + n].transpose(0, 1)[None]         # (1, H, n, D)
        mask = None if n == 1 else _causal_mask(n, ctx, q.device)
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))                   # (n, H, D)
        start += n
    return torch.cat(outs) if outs else torch.empty_like(q)


def attention_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Throughput path: one SDPA call over a padded (S, H, max_q, max_ctx) batch with a mask.

    Not batch-invariant (padding changes reduction lengths). q: (T, num_heads, head_dim).
    Returns (T, num_heads, head_dim) in q's dtype.
    """
    num_seqs, max_q, max_ctx = meta.num_seqs, meta.max_query_len, meta.max_context_len
    dev = q.device
    qlens = torch.diff(meta.cu_seqlens_q).long()                          # (S,)
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=dev), qlens)  # (T,)
    row = torch.arange(q.shape[0], device=dev) - meta.cu_seqlens_q[seq_idx].long()
    flat_idx = seq_idx * max_q + row                                       # (T,) into S*max_q
    qp = q.new_zeros(num_seqs * max_q, *q.shape[1:]).index_copy_(0, flat_idx, q)
    qp = qp.view(num_seqs, max_q, *q.shape[1:]).transpose(1, 2)           # (S, H, max_q, D)
    k = _gather_padded(k_cache, meta.block_tables, max_ctx)
    v = _gather_padded(v_cache, meta.block_tables, max_ctx)
    ctx = meta.context_lens.long()[:, None, None]                          # (S, 1, 1)
    q_pos = ctx - qlens[:, None, None] + torch.arange(max_q, device=dev)[None, :, None]
    k_pos = torch.arange(max_ctx, device=dev)[None, None, :]
    # padded query rows (q_pos >= ctx) see every real key, so no row is fully masked (NaN)
    mask = (k_pos < ctx) & (k_pos <= q_pos)                                # (S, max_q, max_ctx)
    o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask[:, None], scale=scale,
                                       enable_gqa=True)
    return o.transpose(1, 2).reshape(num_seqs * max_q, *q.shape[1:])[flat_idx]


def _gather_padded(cache: torch.Tensor, block_tables: torch.Tensor, max_ctx: int) -> torch.Tensor:
    """(S, kv_heads, max_ctx, head_dim): every sequence's blocks, padded (padding is masked)."""
    num_seqs, max_blocks = block_tables.shape
    blocks = cache[block_tables.long()]             # (S, max_blocks, block_size, kvh, D)
    return blocks.reshape(num_seqs, -1, *cache.shape[2:])[:, :max_ctx].transpose(1, 2)


def reference_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        query_lens: list[int], scale: float, weights_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pure-PyTorch reference: per-sequence causal GQA attention over contiguous K/V, in float32.

    q: (T, H, D); keys[i], values[i]: (context_len_i, kv_heads, D), the query tokens being the
    last query_lens[i] positions. weights_dtype: the unnormalized softmax weights exp(s - max) rounded to
    it before the weighted sum, which is then scaled by 1 / (their unrounded sum): attention_paged's bf16
    roundings (torch's CPU flash attention's) with torch.bfloat16; None: softmax then the weighted sum.
    Returns (T, H, D) in q's dtype.
    """
    out, start = [], 0
    for k, v, n in zip(keys, values, query_lens):
        group = q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)   # (H, ctx, D)
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[start:start + n].float().transpose(0, 1)                  # (H, n, D)
        scores = qi @ k.transpose(1, 2) * scale                          # (H, n, ctx)
        scores = scores.masked_fill(~_causal_mask(n, k.shape[1], q.device), float("-inf"))
        if weights_dtype is None:
            o = scores.softmax(-1) @ v
        else:
            weights = (scores - scores.amax(-1, keepdim=True)).exp()
            o = (weights.to(weights_dtype).to(weights.dtype) @ v) * (1 / weights.sum(-1, keepdim=True))
        out.append(o.transpose(0, 1))                                    # (n, H, D)
        start += n
    return torch.cat(out).to(q.dtype)
