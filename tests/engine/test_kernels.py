"""The C++ row-invariant linear against its float64 reference, the fused row-wise ops (RMSNorm with
residual add, RoPE + KV write, SiLU*up) against their PyTorch references, and bitwise batch invariance."""
from __future__ import annotations

import logging

import pytest
import torch

from lmi_handler.engine.model import kernels
from lmi_handler.engine.model.kernels import (
    PANEL,
    cpu_kernels,
    fused_add_rmsnorm,
    fused_rope_kv_write,
    fused_silu_mul,
    pack_weight,
    packed_linear,
    reference_add_rmsnorm,
    reference_linear,
    reference_rope_kv_write,
    reference_silu_mul,
)


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    assert cpu_kernels() is not None, "the C++ kernels must build on the test machines (g++ and ninja)"


def random_case(num_rows: int, in_features: int, out_features: int, seed: int, with_bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize("num_rows,in_features,out_features", [
    (1, 576, 960), (7, 33, 77), (64, 576, 3072), (97, 1536, 576), (200, 129, 31), (13, 1, 1), (5, 300, 65)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_float64_reference(num_rows, in_features, out_features, with_bias):
    x, weight, bias = random_case(num_rows, in_features, out_features, seed=num_rows, with_bias=with_bias)
    ours = packed_linear(x, pack_weight(weight), bias)
    assert ours.shape == (num_rows, out_features) and ours.dtype == torch.float32
    # float32 rounding of a length-K dot product of unit normals: ~1e-7 * sqrt(K) * |terms|
    torch.testing.assert_close(ours, reference_linear(x, weight, bias), rtol=1e-5, atol=1e-5 * in_features ** 0.5)


@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 576), (129, 70)])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(in_features, out_features):
    """Batch sizes cross the register tile (6 rows) and the cache block (96 rows); the row sits at
    every kind of position: first, inside a tile, in a tail tile, past the first block."""
    x, weight, bias = random_case(230, in_features, out_features, seed=1, with_bias=True)
    packed = pack_weight(weight)
    full = packed_linear(x, packed, bias)
    for num_rows in (1, 2, 5, 6, 7, 16, 64, 95, 96, 97, 130):
        for start in (0, 1, 3, 230 - num_rows):
            assert torch.equal(packed_linear(x[start:start + num_rows], packed, bias),
                               full[start:start + num_rows]), (num_rows, start)


def test_threads_do_not_change_the_bits():
    x, weight, _ = random_case(50, 576, 960, seed=2, with_bias=False)
    packed = pack_weight(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed_linear(x, packed, None)
        torch.set_num_threads(max(2, before))
        assert torch.equal(packed_linear(x, packed, None), one)
    finally:
        torch.set_num_threads(before)


def test_packed_weight_keeps_the_original_rows_exactly():
    weight = torch.randn(PANEL * 3 + 5, 19)
    packed = pack_weight(weight)
    assert packed.panels.shape == (4, 19, PANEL) and packed.out_features == weight.shape[0]
    assert torch.equal(packed.unpack(), weight)
    ids = torch.tensor([0, PANEL - 1, PANEL, weight.shape[0] - 1, 7])
    assert torch.equal(packed.rows(ids), weight[ids])


def test_huge_page_buffers_are_2mib_aligned_float32_and_freed_with_their_tensor():
    t = kernels.empty_huge(300, 7, 5)
    assert t.shape == (300, 7, 5) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * 300 * 7 * 5
    assert kernels.empty_huge(0, 4).shape == (0, 4)
    # packed weights live there, the KV cache too; other dtypes and huge_pages=False (option.huge_pages,
    # LMI_HUGE_PAGES=0: tests/test_config.py) get torch.empty
    assert pack_weight(torch.randn(70, 9)).panels.data_ptr() % (2 << 20) == 0
    assert kernels.empty_huge(4, dtype=torch.float64).dtype == torch.float64
    packed = pack_weight(torch.randn(70, 9), huge_pages=False)
    assert packed.panels.shape == (3, 9, PANEL)


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_build_is_waited_for(tmp_path, caplog):
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    assert not kernels.clear_stale_build_lock(tmp_path)           # none there
    old = time.time() - kernels.STALE_LOCK_S - 5                   # left by a build killed long ago
    lock.touch()
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING):
        assert kernels.clear_stale_build_lock(tmp_path)
    assert not lock.exists() and "did not finish" in caplog.text
    lock.touch()                                                   # a build in progress that finishes
    threading.Timer(0.3, lock.unlink).start()
    start = time.monotonic()
    assert not kernels.clear_stale_build_lock(tmp_path, poll_s=0.05)
    assert time.monotonic() - start >= 0.25
    lock.touch()                                                   # one that dies: stale after max_age_s
    assert kernels.clear_stale_build_lock(tmp_path, max_age_s=0.5, poll_s=0.05) and not lock.exists()


def test_bad_shapes_are_refused_with_a_message():
    packed = pack_weight(torch.randn(40, 16))
    with pytest.raises(RuntimeError, match="in_features"):
        packed_linear(torch.randn(3, 17), packed, None)
    with pytest.raises(RuntimeError, match="float32"):
        packed_linear(torch.randn(3, 16, dtype=torch.float64), packed, None)


def test_a_failed_build_logs_a_warning_and_returns_none(tmp_path, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels._build(broken, "lmi_cpu_kernels_broken_test") is None
    assert "PyTorch fallback" in caplog.text


@pytest.mark.parametrize("num_rows,width", [(1, 576), (7, 33), (64, 576), (300, 1), (130, 200)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_fused_add_rmsnorm_matches_the_pytorch_norm_and_adds_the_residual_bitwise(num_rows, width, with_delta):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(num_rows, width, generator=g) * 3
    delta = torch.randn(num_rows, width, generator=g) if with_delta else None
    weight = torch.randn(width, generator=g)
    expected_x, expected = reference_add_rmsnorm(x, delta, weight, 1e-5)
    ours = fused_add_rmsnorm(x, delta, weight, 1e-5)
    assert torch.equal(x, expected_x)           # the residual add is the same single rounding
    # only the sum of squares' order differs: a few ulps of the scale factor
    torch.testing.assert_close(ours, expected, rtol=2e-6, atol=1e-6)


def rope_case(num_rows: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_rows, (heads + 2 * kv_heads) * head_dim, generator=g)
    angles = torch.rand(num_rows, head_dim // 2, generator=g) * 100
    emb = torch.cat((angles, angles), dim=-1)
    num_blocks, block = num_rows // 4 + 3, 4
    slots = torch.randperm(num_blocks * block, generator=g)[:num_rows]
    caches = [torch.randn(num_blocks, block, kv_heads, head_dim, generator=g) for _ in range(2)]
    return qkv, emb.cos(), emb.sin(), caches, slots


@pytest.mark.parametrize("num_rows,heads,kv_heads,head_dim", [(1, 9, 3, 64), (5, 4, 4, 16), (37, 8, 2, 32),
                                                              (64, 9, 3, 64), (3, 2, 1, 2)])
def test_fused_rope_kv_write_is_bitwise_the_pytorch_rope_and_index_copy(num_rows, heads, kv_heads, head_dim):
    qkv, cos, sin, (k_cache, v_cache), slots = rope_case(num_rows, heads, kv_heads, head_dim, seed=num_rows)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected_q = reference_rope_kv_write(qkv, cos, sin, k_ref, v_ref, slots, heads, kv_heads)
    q = fused_rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    assert q.shape == (num_rows, heads, head_dim)
    assert torch.equal(q, expected_q) and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_fused_rope_kv_write_refuses_a_slot_outside_the_cache():
    qkv, cos, sin, (k_cache, v_cache), slots = rope_case(3, 2, 1, 8, seed=0)
    slots[1] = k_cache.shape[0] * k_cache.shape[1]
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused_rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, 2, 1)


@pytest.mark.parametrize("num_rows,intermediate", [(1, 1536), (9, 7), (64, 1536), (200, 100)])
def test_fused_silu_mul_matches_pytorch_within_rounding(num_rows, intermediate):
    gate_up = torch.randn(num_rows, 2 * intermediate, generator=torch.Generator().manual_seed(3)) * 4
    torch.testing.assert_close(fused_silu_mul(gate_up), reference_silu_mul(gate_up), rtol=1e-6, atol=1e-7)


def test_fused_row_ops_give_a_row_the_same_bits_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(5)
    x, delta = torch.randn(150, 576, generator=g), torch.randn(150, 576, generator=g)
    weight, gate_up = torch.randn(576, generator=g), torch.randn(150, 3072, generator=g)
    full_norm = fused_add_rmsnorm(x.clone(), delta, weight, 1e-6)
    full_act = fused_silu_mul(gate_up)
    qkv, cos, sin, caches, slots = rope_case(150, 9, 3, 64, seed=6)
    full_q = fused_rope_kv_write(qkv, cos, sin, *[c.clone() for c in caches], slots, 9, 3)
    for num_rows, start in ((1, 0), (1, 77), (3, 10), (64, 20), (149, 1)):
        rows = slice(start, start + num_rows)
        assert torch.equal(fused_add_rmsnorm(x[rows].clone(), delta[rows], weight, 1e-6), full_norm[rows])
        assert torch.equal(fused_silu_mul(gate_up[rows].contiguous()), full_act[rows])
        q = fused_rope_kv_write(qkv[rows].contiguous(), cos[rows], sin[rows], *[c.clone() for c in caches],
                                slots[rows], 9, 3)
        assert torch.equal(q, full_q[rows]), (num_rows, start)
