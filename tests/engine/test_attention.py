"""Paged attention fast paths against the pure-PyTorch reference over contiguous K/V."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.kv_cache import BlockAllocator, build_block_tables, build_slot_mapping, num_blocks_needed
from lmi_handler.engine.model.attention import (
    AttentionMetadata,
    attention_padded,
    attention_per_sequence,
    reference_attention,
    write_kv,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def build_case(starts: list[int], lengths: list[int], seed: int = 0):
    """Random past K/V written to a paged cache, plus new q/k/v for the step."""
    g = torch.Generator().manual_seed(seed)
    allocator = BlockAllocator(64, BLOCK)
    tables = [allocator.allocate(num_blocks_needed(s + n, BLOCK)) for s, n in zip(starts, lengths)]
    k_cache = torch.zeros(64, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    ctx = [s + n for s, n in zip(starts, lengths)]
    keys = [torch.randn(c, KV_HEADS, HEAD_DIM, generator=g) for c in ctx]
    values = [torch.randn(c, KV_HEADS, HEAD_DIM, generator=g) for c in ctx]
    past = build_slot_mapping(tables, [0] * len(starts), starts, BLOCK)
    write_kv(k_cache, v_cache, torch.cat([k[:s] for k, s in zip(keys, starts)]),
             torch.cat([v[:s] for v, s in zip(values, starts)]), past)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=build_slot_mapping(tables, starts, lengths, BLOCK),
        block_tables=build_block_tables(tables), context_lens=torch.tensor(ctx, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), query_lens=lengths, context_lens_host=ctx,
        block_size=BLOCK)
    q = torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=g)
    new_k = torch.cat([k[s:] for k, s in zip(keys, starts)])
    new_v = torch.cat([v[s:] for v, s in zip(values, starts)])
    return q, new_k, new_v, k_cache, v_cache, meta, keys, values


CASES = {
    "prefill_only": ([0, 0], [5, 9]),
    "decode_only": ([7, 3, 12], [1, 1, 1]),
    "mixed_chunked": ([0, 6, 13, 4], [5, 1, 7, 1]),   # prefill, decode, later chunk, decode
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kernel", [attention_per_sequence, attention_padded])
def test_paged_attention_matches_reference(case, kernel):
    q, k, v, k_cache, v_cache, meta, keys, values = build_case(*CASES[case])
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    scale = HEAD_DIM ** -0.5
    expected = reference_attention(q, keys, values, meta.query_lens, scale)
    torch.testing.assert_close(kernel(q, k_cache, v_cache, meta, scale), expected, rtol=1e-5, atol=1e-5)


def test_per_sequence_attention_is_bitwise_identical_alone_and_in_batch():
    scale = HEAD_DIM ** -0.5
    q, k, v, k_cache, v_cache, meta, keys, values = build_case([0, 6, 13, 4], [5, 1, 7, 1])
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    batched = attention_per_sequence(q, k_cache, v_cache, meta, scale)
    for i in range(meta.num_seqs):
        rows = slice(int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1]))
        alone = AttentionMetadata(meta.slot_mapping[rows], meta.block_tables[i:i + 1],
                                  meta.context_lens[i:i + 1], torch.tensor([0, rows.stop - rows.start],
                                                                           dtype=torch.int32),
                                  meta.query_lens[i:i + 1], meta.context_lens_host[i:i + 1], BLOCK)
        assert torch.equal(attention_per_sequence(q[rows], k_cache, v_cache, alone, scale), batched[rows])
