"""K/V store into the paged cache and paged attention, as Triton kernels.

One attention kernel serves every row kind a step can hold (prefill, chunked prefill, decode, rows after a
prefix-cache hit): a program owns one query row and one KV head, with the query heads that read that KV head
(the GQA group, padded to a power of two) in one tile. It walks the row's keys in tiles of KV_TILE positions
aligned to absolute positions (tile boundaries at multiples of KV_TILE), with an online softmax in float32.
Nothing in a program depends on the other rows, on the number of sequences or on how a sequence's tokens were
cut into chunks, so a row's bits are the same alone, in any batch and under any chunking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_TILE = 32     # key positions per tile: fixed, never a function of the batch
SEQ_CHUNK = 64   # sequences scanned at a time to find a row's sequence (a fixed width: no recompile per batch size)


@triton.jit
def _store_kv_kernel(k_cache, v_cache, k, v, slot_mapping, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kc, stride_vc, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_mapping + row)
    if slot >= 0:
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, DIM_PAD)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_DIM)
        dst = slot * stride_kc + h * HEAD_DIM + d          # the cache is contiguous: (slot, head, dim)
        tl.store(k_cache + dst, tl.load(k + row * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
        dst = slot * stride_vc + h * HEAD_DIM + d
        tl.store(v_cache + dst, tl.load(v + row * stride_vt + h * stride_vh + d, mask=mask), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Copy each row of k, v (T, num_kv_heads, head_dim) to its slot of the contiguous caches
    (num_blocks, block_size, num_kv_heads, head_dim); a slot of -1 (a padding row) writes nothing."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    _store_kv_kernel[(num_tokens,)](
        k_cache, v_cache, k, v, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_heads * head_dim, num_heads * head_dim, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_heads), DIM_PAD=triton.next_power_of_2(head_dim))


@triton.jit
def _tanh(x):
    """tanh from exp (the same code on every Triton version and in the interpreter)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# num_seqs is not specialized (Triton would compile a variant for the value 1): one binary for every batch
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
        out, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, num_seqs, scale, softcap, window, sinks,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_block, stride_kc_slot, stride_kc_head, stride_bt,
        block_size, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        SEQ_CHUNK: tl.constexpr, TILE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
        USE_SINKS: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    head = kv_head * GROUP + g
    qo_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    # the row's sequence: how many sequences end at or before it (rows past the last one are padding)
    seq = 0
    for base in range(0, num_seqs, SEQ_CHUNK):
        seqs = base + tl.arange(0, SEQ_CHUNK)
        ends = tl.load(cu_seqlens_q + 1 + seqs, mask=seqs < num_seqs, other=2147483647)
        seq += tl.sum((ends <= row).to(tl.int32), axis=0)
    in_batch = seq < num_seqs
    start = tl.load(cu_seqlens_q + seq, mask=in_batch, other=0)
    end = tl.load(cu_seqlens_q + seq + 1, mask=in_batch, other=0)
    context_len = tl.load(context_lens + seq, mask=in_batch, other=0)
    # the row's absolute position; -1 for a padding row (past the last sequence, or of a sequence with no context)
    pos = tl.where(in_batch, context_len - (end - start) + (row - start), -1)
    out_ptrs = out + row * stride_ot + head[:, None] * stride_oh + d[None, :]
    if pos >= 0:
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        qv = tl.load(q + row * stride_qt + head[:, None] * stride_qh + d[None, :], mask=qo_mask, other=0.0)
        qv = qv.to(tl.float32)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for tile_start in range((lo // TILE) * TILE, pos + 1, TILE):
            kpos = tile_start + tl.arange(0, TILE)
            valid = (kpos >= lo) & (kpos <= pos)
            block = tl.load(block_tables + seq * stride_bt + kpos // block_size, mask=valid, other=0)
            slot = block.to(tl.int64) * stride_block + (kpos % block_size) * stride_kc_slot
            kv_off = slot[:, None] + kv_head * stride_kc_head + d[None, :]
            kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
            kt = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            vt = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(qv[:, None, :] * kt[None, :, :], axis=2) * scale        # (GROUP_PAD, TILE)
            if USE_SOFTCAP:
                scores = softcap * _tanh(scores / softcap)
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))      # finite: every tile holds a valid key
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt[None, :, :], axis=1)
            m = m_new
        if USE_SINKS:   # the head's sink: one more logit in the max and the denominator, attending to nothing
            sink = tl.load(sinks + head, mask=g < GROUP, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, sink)
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.exp(sink - m_new)
            acc = acc * alpha[:, None]
        tl.store(out_ptrs, (acc / denom[:, None]).to(out.dtype.element_ty), mask=qo_mask)
    else:
        tl.store(out_ptrs, tl.zeros([GROUP_PAD, DIM_PAD], tl.float32).to(out.dtype.element_ty), mask=qo_mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                    window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of each row of q (T, num_heads, head_dim) over the paged cache (INTERFACE.md).

    Row j of sequence i sits at position context_lens[i] - query_lens[i] + j and attends to positions
    [max(0, p - window + 1), p]; sinks (num_heads,): each head's logit joins the softmax's max and denominator
    after the last tile (gpt-oss); padding rows (past cu_seqlens_q[-1], or of a sequence with no
    context) get zeros. Returns (T, num_heads,
    head_dim) in q's dtype. The caches must be contiguous.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert window is None or window >= 1, f"window must be >= 1 or None, got {window}"
    num_seqs = meta.block_tables.shape[0]
    group = num_heads // num_kv_heads
    _paged_attention_kernel[(num_tokens, num_kv_heads)](
        out, q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.cu_seqlens_q, num_seqs, scale,
        softcap if softcap is not None else 1.0, window if window is not None else 0,
        sinks.float().contiguous() if sinks is not None else q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), meta.block_tables.stride(0), k_cache.shape[1],
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 2), HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim), SEQ_CHUNK=SEQ_CHUNK,
        TILE=KV_TILE, USE_WINDOW=window is not None, USE_SOFTCAP=softcap is not None, USE_SINKS=sinks is not None)
    return out
