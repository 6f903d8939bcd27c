"""The Triton K/V store and paged attention against the reference, and a row's bits under every batch and
every row kind (CPU tensors under TRITON_INTERPRET=1 without a GPU: tiny shapes, about 0.25 s a launch).

Tolerances: attention against a float64 reference, float32 within 2e-6 abs + 1e-5 rel (the online softmax
reassociates the sums), float16 within 1e-3 abs + 1e-3 rel (one rounding of the output, about 5e-4 at |x| ~ 1);
bfloat16 (CUDA only) within 1e-2. The store is a copy: bitwise.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from lmi_handler.engine.model.backends import triton as tb
from tests.engine.triton import reference as ref

pytestmark = pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)")

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 6, 2, 16     # GQA group 3: a head tile padded to 4
NUM_BLOCKS = 96
TOL = {torch.float32: (2e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


def filled_cache(contexts: list[int], dtype, device, seed: int = 0, num_kv_heads: int = NUM_KV_HEADS,
                 head_dim: int = HEAD_DIM):
    """K/V caches holding random values at each sequence's first contexts[i] positions and NaN everywhere else
    (a kernel reading past a row's keys would show it), with shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, taken = [], 0
    for context_len in contexts:
        n = -(-context_len // BLOCK_SIZE)
        tables.append(order[taken:taken + n])
        taken += n
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    for table, context_len in zip(tables, contexts):
        slots = torch.tensor(table).repeat_interleave(BLOCK_SIZE) * BLOCK_SIZE + torch.arange(BLOCK_SIZE).repeat(
            len(table))
        slots = slots[:context_len]
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(context_len, num_kv_heads, head_dim,
                                                                        generator=gen).to(dtype)
    return k_cache.to(device), v_cache.to(device), tables


def queries(num_rows: int, dtype, device, seed: int = 1, num_heads: int = NUM_HEADS,
            head_dim: int = HEAD_DIM) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, num_heads, head_dim, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_copies_each_row_to_its_slot_bitwise_and_a_padding_slot_writes_nothing(dtype, device):
    k_cache = torch.zeros(8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.randn(2, 5, NUM_KV_HEADS, 2 * HEAD_DIM).to(dtype).to(device)
    k, v = kv[0, :, :, :HEAD_DIM], kv[1, :, :, HEAD_DIM:]           # strided views, as sliced from a qkv output
    slots = torch.tensor([3, -1, 17, 30, -1], dtype=torch.int64, device=device)
    tb.store_kv(k_cache, v_cache, k, v, slots)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ref.store_kv(expected_k, expected_v, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


# one step holding every row kind: a prefill, a chunked prefill's later chunk, a decode row with three KV tiles
# behind it, and rows after a prefix-cache hit (their first 32 positions in blocks of the second sequence)
MIXED_STEP = [(6, 6), (45, 5), (70, 1), (36, 4)]


def mixed_step_tables(tables: list[list[int]]) -> list[list[int]]:
    """The prefix hit: the last sequence's first 8 blocks are the second one's (shared, as the prefix cache does)."""
    return tables[:3] + [tables[1][:32 // BLOCK_SIZE] + tables[3][32 // BLOCK_SIZE:]]


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (20, None, False), (None, 2.0, False),
                                                  (20, None, True)],
                         ids=["causal", "window", "softcap", "window-sinks"])
@pytest.mark.parametrize("dtype", ref.kernel_dtypes())
def test_attention_equals_the_reference_on_a_step_with_every_row_kind(dtype, window, softcap, sinks, device):
    """sinks: gpt-oss's per-head logit in the softmax denominator (one per query head, a GQA group's differ)."""
    k_cache, v_cache, tables = filled_cache([c for c, _ in MIXED_STEP], dtype, device)
    meta = ref.make_meta(MIXED_STEP, mixed_step_tables(tables), BLOCK_SIZE, device)
    q = queries(sum(n for _, n in MIXED_STEP), dtype, device)
    sink = torch.linspace(-1.0, 4.0, NUM_HEADS) if sinks else None
    out = tb.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5, window=window, softcap=softcap,
                             sinks=None if sink is None else sink.to(device))
    expected = ref.paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta, HEAD_DIM ** -0.5, window, softcap,
                                   sink)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.cpu(), expected, atol=atol, rtol=rtol)


def test_attention_with_one_query_head_per_kv_head_and_a_head_size_not_a_power_of_two(device):
    k_cache, v_cache, tables = filled_cache([c for c, _ in MIXED_STEP], torch.float32, device, num_kv_heads=3,
                                            head_dim=24)
    meta = ref.make_meta(MIXED_STEP, mixed_step_tables(tables), BLOCK_SIZE, device)
    q = queries(sum(n for _, n in MIXED_STEP), torch.float32, device, num_heads=3, head_dim=24)
    out = tb.paged_attention(q, k_cache, v_cache, meta, 0.2)
    expected = ref.paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta, 0.2)
    torch.testing.assert_close(out.cpu(), expected, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


@pytest.mark.parametrize("dtype", ref.kernel_dtypes())
def test_a_row_has_the_same_bits_alone_and_in_batches_of_3_and_8_with_padding_rows(dtype, device, monkeypatch):
    """The batch of 8 is scanned 2 sequences at a time for each row's sequence (SEQ_CHUNK; 64 by default)."""
    target = (70, 3)                        # a sequence's three rows at positions 67..69
    others = [(6, 6), (45, 5), (33, 1), (12, 2), (64, 1), (9, 3), (20, 1)]
    batches = {"alone": [target], "3": [others[0], target, others[1]], "8": others[2:] + [target] + others[:2]}
    padding_rows = {"alone": 0, "3": 0, "8": 3}
    results = {}
    k_cache, v_cache, tables = filled_cache([c for c, _ in others] + [target[0]], dtype, device)
    table_of = dict(zip(others + [target], tables))
    q_target = queries(target[1], dtype, device)
    for name, seqs in batches.items():
        meta = ref.make_meta(seqs, [table_of[s] for s in seqs], BLOCK_SIZE, device)
        first = sum(n for _, n in seqs[:seqs.index(target)])
        q = queries(sum(n for _, n in seqs) + padding_rows[name], dtype, device, seed=len(seqs))
        q[first:first + target[1]] = q_target
        if name == "8":
            monkeypatch.setattr(importlib.import_module(tb.__name__ + ".attention"), "SEQ_CHUNK", 2)
        out = tb.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
        results[name] = out[first:first + target[1]]
        assert torch.equal(out[out.shape[0] - padding_rows[name]:], torch.zeros_like(out[:padding_rows[name]]))
    assert torch.equal(results["alone"], results["3"]) and torch.equal(results["alone"], results["8"])


@pytest.mark.parametrize("dtype", ref.kernel_dtypes())
def test_a_decode_row_has_the_bits_of_its_position_in_a_prefill_a_chunked_prefill_and_after_a_prefix_hit(
        dtype, device):
    length = 40
    k_cache, v_cache, tables = filled_cache([length], dtype, device)
    q_all = queries(length, dtype, device)
    rows = {}
    for kind, query_len in {"decode": 1, "prefill": length, "chunked prefill": 9, "after a prefix hit": 8}.items():
        meta = ref.make_meta([(length, query_len)], tables, BLOCK_SIZE, device)
        out = tb.paged_attention(q_all[length - query_len:], k_cache, v_cache, meta, HEAD_DIM ** -0.5)
        rows[kind] = out
    for kind in ("prefill", "chunked prefill", "after a prefix hit"):
        assert torch.equal(rows[kind][-1], rows["decode"][0]), kind
        overlap = min(rows[kind].shape[0], rows["chunked prefill"].shape[0])
        assert torch.equal(rows[kind][-overlap:], rows["chunked prefill"][-overlap:]), kind


def test_the_reference_backend_s_attention_agrees_with_the_float64_reference_the_kernel_is_held_to():
    """backends/torch_ref.py's paged_attention (kernel_backend=torch) against reference.py's float64 one on the
    mixed step, causal, windowed and capped (no Triton needed)."""
    from lmi_handler.engine.model.backends import torch_ref

    k_cache, v_cache, tables = filled_cache([c for c, _ in MIXED_STEP], torch.float32, "cpu")
    meta = ref.make_meta(MIXED_STEP, mixed_step_tables(tables), BLOCK_SIZE, torch.device("cpu"))
    q = queries(sum(n for _, n in MIXED_STEP), torch.float32, "cpu")
    for window, softcap in [(None, None), (20, None), (None, 2.0)]:
        torch.testing.assert_close(torch_ref.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5, window,
                                                             softcap),
                                   ref.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5, window, softcap),
                                   atol=2e-6, rtol=1e-5)
