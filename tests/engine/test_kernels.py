"""The C++ row-invariant linear against its references (float32 panels: float64 within rounding; bfloat16
and int8 panels: bitwise, the same fixed order), the fused row-wise ops (RMSNorm with residual add, RoPE +
KV write, SiLU*up) in float32 and bfloat16 against their PyTorch references, and bitwise batch invariance."""
from __future__ import annotations

import contextlib
import logging
import time

import pytest
import torch

from lmi_handler.engine.model import kernels
from lmi_handler.engine.model.kernels import (
    BF16_AMX,
    BF16_DP,
    BF16_FMA,
    PANEL,
    choose_bf16_dot,
    cpu_kernels,
    fused_add_rmsnorm,
    fused_rope_kv_write,
    fused_silu_mul,
    pack_weight,
    packed_linear,
    packed_linear_silu,
    quantize_int8,
    reference_add_rmsnorm,
    reference_linear,
    reference_linear_bf16,
    reference_linear_int8,
    reference_rope_kv_write,
    reference_silu_mul,
)


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    assert cpu_kernels() is not None, "the C++ kernels must build on the test machines (g++ and ninja)"


@contextlib.contextmanager
def bf16_dot(mode: str):
    """bf16 linears in `mode` (bf16_form.choose_bf16_dot) inside the block, "auto" again after it."""
    choose_bf16_dot(mode)
    try:
        yield
    finally:
        choose_bf16_dot("auto")


def needs_amx():
    module = cpu_kernels()
    if not (module.HAS_AMX and module.amx_permitted()):
        pytest.skip("no AMX-BF16 here (build or OS)")
    return module


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
    assert_rows_alone_match_the_batch(x, pack_weight(weight), bias)


def assert_rows_alone_match_the_batch(x, packed, bias):
    """Every slice of x's 230 rows (batch sizes crossing the tiles and blocks, at every kind of position)
    gets the bits those rows got in the whole batch."""
    full = packed_linear(x, packed, bias)
    for num_rows in (1, 2, 5, 6, 7, 16, 64, 95, 96, 97, 130):
        for start in (0, 1, 3, 230 - num_rows):
            assert torch.equal(packed_linear(x[start:start + num_rows], packed, bias),
                               full[start:start + num_rows]), (num_rows, start)


def test_parallel_walk_runs_every_item_once_and_takes_from_a_slow_share():
    """parallel_walk (the linears' split of their items over threads): each item runs exactly once whatever
    the thread count (more threads than these 2 cores, more than items, none), and when the first share is
    slow (each of its items spins 500 us) work moves between the shares and still none runs twice or never:
    the worker takes items from the slow share's back, or, when the host keeps it from running until the
    caller has done the slow share (a busy CPU), the caller takes the worker's whole share (32)."""
    ops = cpu_kernels()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 5, 8):
            torch.set_num_threads(threads)
            for n in (0, 1, 2, 3, 7, 64, 1000):
                counts, _ = ops.walk_counts(n, 0.0)
                assert counts.tolist() == [1] * n, (threads, n)
        torch.set_num_threads(2)
        counts, taken = ops.walk_counts(64, 500.0)    # share 0: 32 items x 0.5 ms; share 1 done at once
        assert counts.tolist() == [1] * 64
        assert 0 < taken <= 32
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_threads_and_claim_order_do_not_change_the_bits(kind):
    """The work items (M block x panel) go to the threads by parallel_walk: each walks its own share and then takes
    items from the back of the others'. Over 2-5 threads on these cores (more threads than cores: shares finish
    unevenly), and with the items claimed in reverse or in a random order (set_claim_order), the output is the
    1-thread one, bit for bit, from one row (the weight streamed) to many (that every item runs exactly once,
    test_parallel_walk_runs_every_item_once_and_takes_from_a_slow_share)."""
    ops = cpu_kernels()
    before = torch.get_num_threads()
    try:
        for num_rows, in_features, out_features in ((50, 576, 960), (9, 576, 70), (230, 300, 130), (1, 576, 960),
                                                    (3, 300, 130)):
            x, weight, _ = random_case(num_rows, in_features, out_features, seed=2, with_bias=False)
            x = x.to(torch.bfloat16) if kind == "bfloat16" else x
            packed = pack_weight(weight, kind)
            torch.set_num_threads(1)
            one = packed_linear(x, packed, None)
            for threads, order in ((2, 0), (3, 0), (5, 0), (2, 1), (3, 2), (2, 2)):
                torch.set_num_threads(threads)
                ops.set_claim_order(order)
                for _ in range(3):
                    assert torch.equal(packed_linear(x, packed, None), one), (num_rows, out_features, threads, order)
    finally:
        torch.set_num_threads(before)
        ops.set_claim_order(0)


def test_a_region_ends_when_its_pieces_are_done_not_when_every_thread_came():
    """A thread the OS took off its core holds back only the piece it holds (pool.h): with 2 threads and the
    worker arriving 200 ms late at every region (set_worker_delay_us), 20 regions of 64 items each run every item
    exactly once and take far less than the 4 s they would if each waited for the worker (the caller takes the
    worker's share from its back)."""
    ops = cpu_kernels()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ops.walk_counts(64, 0.0)               # the worker exists
        ops.set_worker_delay_us(200_000)
        start = time.perf_counter()
        for _ in range(20):
            counts, _ = ops.walk_counts(64, 0.0)
            assert counts.tolist() == [1] * 64
        assert time.perf_counter() - start < 2.0
    finally:
        ops.set_worker_delay_us(0)
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind,form", [("float32", "auto"), ("bfloat16", "native")])
def test_narrow_tiles_do_not_change_the_bits(kind, form):
    """The narrow tiles (AMD Zen 4's choice: float32 8 rows, VDPBF16PS 6) and the wide ones (every other AVX-512
    CPU's: 12 and 8) give every row the same bits, at row counts that cut the M blocks differently, leave a
    short last tile and take the whole-K pass past one M block, and a row alone its batch bits; -1 restores
    this CPU's choice. Another mode is refused by name."""
    module = cpu_kernels()
    if kind == "bfloat16" and not module.NATIVE_BF16:
        pytest.skip("no AVX512_BF16 in this build")
    choice = module.narrow_tiles()
    try:
        module.set_narrow_tiles(1)
    except RuntimeError as exc:
        assert "AVX-512" in str(exc)
        pytest.skip("an AVX2 build: wide tiles only")
    try:
        with bf16_dot(form):
            for num_rows, in_features, out_features in ((64, 576, 960), (23, 300, 130), (200, 129, 70)):
                x, weight, bias = random_case(num_rows, in_features, out_features, seed=9, with_bias=True)
                x = x.to(torch.bfloat16) if kind == "bfloat16" else x
                packed = pack_weight(weight, kind)
                outs = []
                for narrow in (1, 0):
                    module.set_narrow_tiles(narrow)
                    assert module.narrow_tiles() == bool(narrow)
                    outs.append(packed_linear(x, packed, bias))
                assert torch.equal(outs[0], outs[1]), num_rows
                module.set_narrow_tiles(1)
                assert torch.equal(outs[0][5:10], packed_linear(x[5:10], packed, bias)), num_rows
    finally:
        module.set_narrow_tiles(-1)
    assert module.narrow_tiles() == choice
    with pytest.raises(RuntimeError, match="narrow tiles mode must be -1"):
        module.set_narrow_tiles(2)


@pytest.mark.parametrize("in_features", [1, 8, 15, 17, 129])
def test_float32_rows_copied_into_the_tile_layout_keep_their_bits(in_features):
    """With narrow tiles (Zen 4's), past 8 rows, with 64 panels or more (or past one M block), the float32 linear
    first copies x into its tiles' layout (linear.h pack_row_tiles: a tile's rows interleaved per k, an 8-row tile
    through 8 x 8 register transposes, the rest one value at a time) and runs the whole K in one pass; the wide
    tiles keep x row-major. Each row of 9-97 rows gets the bits it gets alone (2 rows: the row-major streaming path)
    in both modes and matches the float64 product: in_features around the 8-wide transpose and its tail, row counts
    leaving short last tiles (1, 4, 5 and 7 rows of an 8-row tile; 1, 4, 5, 7 and 9 of a 12-row one), 67 panels
    (the last one short). Both modes on AVX-512 builds (an AVX2 build refuses the narrow one and keeps its own)."""
    module = cpu_kernels()
    x, weight, bias = random_case(97, in_features, 66 * 32 + 6, seed=in_features, with_bias=True)
    packed = pack_weight(weight)
    alone = torch.cat([packed_linear(x[r:r + 2], packed, bias)[:1] for r in range(97)])
    torch.testing.assert_close(alone, reference_linear(x, weight, bias), rtol=1e-5, atol=1e-5 * in_features ** 0.5)
    try:
        for narrow in (1, 0):
            try:
                module.set_narrow_tiles(narrow)
            except RuntimeError:   # an AVX2 build: its own tiles only
                continue
            for num_rows in (9, 12, 13, 16, 17, 24, 31, 96, 97):
                for start in (0, 97 - num_rows):
                    got = packed_linear(x[start:start + num_rows], packed, bias)
                    assert torch.equal(got, alone[start:start + num_rows]), (narrow, num_rows, start)
    finally:
        module.set_narrow_tiles(-1)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("out_features", [576, 288, 70, 1])
def test_a_few_rows_split_by_panels_over_any_threads_keep_their_batch_bits(kind, out_features):
    """At most 4 rows the linear streams each thread's contiguous share of the panels (float32 two at a
    time, an odd last one alone; bf16 and int8 one at a time in K blocks): 18, 9, 3 and 1 panels over 1-3
    threads give the bits the rows get in a 64-row batch (the blocked path). On AVX-512 builds both tile
    modes run: with the narrow tiles (Zen 4) bf16 and int8 stream a few rows with no software prefetch
    (linear.h few_rows_prefetch), with the wide ones the next K block prefetched."""
    module = cpu_kernels()
    x, weight, bias = random_case(64, 576, out_features, seed=5, with_bias=True)
    x = x.to(torch.bfloat16) if kind == "bfloat16" else x
    packed = pack_weight(weight, kind)
    full = packed_linear(x, packed, bias)
    before = torch.get_num_threads()
    try:
        module.set_narrow_tiles(1)
        modes = (1, 0)
    except RuntimeError:
        modes = (-1,)   # an AVX2 build: wide tiles only
    try:
        for narrow in modes:
            module.set_narrow_tiles(narrow)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                for num_rows in (1, 2, 3, 4):
                    assert torch.equal(packed_linear(x[7:7 + num_rows], packed, bias), full[7:7 + num_rows]), \
                        (narrow, threads, num_rows)
    finally:
        torch.set_num_threads(before)
        module.set_narrow_tiles(-1)


def test_packed_weight_keeps_the_original_rows_exactly():
    weight = torch.randn(PANEL * 3 + 5, 19)
    packed = pack_weight(weight)
    assert packed.panels.shape == (4, 19, PANEL) and packed.out_features == weight.shape[0]
    assert torch.equal(packed.unpack(), weight)
    ids = torch.tensor([0, PANEL - 1, PANEL, weight.shape[0] - 1, 7])
    assert torch.equal(packed.rows(ids), weight[ids])


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_a_weight_packed_into_an_arena_view_is_the_weight_packed_on_its_own(kind):
    shapes = [(PANEL * 2 + 3, 19), (5, 8), (PANEL, 33)]
    weights = [torch.randn(*shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]
    views = kernels.panel_arena([(kernels.panels_shape(*w.shape, kind), kind) for w in weights])
    alone = [pack_weight(w, kind) for w in weights]
    packed = [pack_weight(w, kind, out=view) for w, view in zip(weights, views)]
    base = views[0].untyped_storage().data_ptr()
    assert base % (2 << 20) == 0                                   # the arena is empty_huge's buffer
    ends = 0
    for a, b, view in zip(alone, packed, views):
        assert b.panels is view and view.untyped_storage().data_ptr() == base       # one buffer
        start = view.data_ptr() - base
        assert start % kernels.ARENA_ALIGN == 0 and start >= ends             # aligned, in order, no overlap
        ends = start + view.numel() * view.element_size()
        assert torch.equal(a.panels, b.panels) and (a.scale is None or torch.equal(a.scale, b.scale))
    with pytest.raises(ValueError, match="out must be"):
        pack_weight(weights[0], kind, out=views[1])


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
        assert kernels.build_extension(broken, "lmi_cpu_kernels_broken_test") is None
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_silu_mul_gives_the_scalar_loops_bits(dtype):
    """The AVX-512 silu (exp16_glibc, vmath.h) against the scalar std::exp loop it replaces: bitwise, on
    ordinary values, on glibc's special lanes (|x| >= 88, inf, NaN, denormals, signed zeros) mixed into
    vectors of ordinary ones, and on a tail shorter than a vector."""
    if not cpu_kernels().vector_exp_agrees():
        pytest.skip("no AVX-512 expf on this CPU (or its libm computes expf otherwise): the scalar loop runs")
    g = torch.Generator().manual_seed(11)
    gate_up = torch.randn(40, 2 * 1544, generator=g) * 4
    gate_up[1] *= 40                                          # |g| past 88 in many lanes
    special = [float("nan"), float("inf"), -float("inf"), 88.0, -88.0, 88.8, -88.8, 103.0, -103.0, -104.0,
               1e-40, -1e-40, 0.0, -0.0, 87.9, -87.9]
    gate_up[0, :len(special)] = torch.tensor(special)
    gate_up[0, 1544:1544 + len(special)] = torch.tensor(special)   # up holds them too
    gate_up = gate_up.to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    vector, scalar = cpu_kernels().silu_mul(gate_up, True), cpu_kernels().silu_mul(gate_up, False)
    assert torch.equal(vector.view(bits), scalar.view(bits))


@pytest.mark.parametrize("kind,x_dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                           ("int8", torch.float32), ("int8", torch.bfloat16)])
@pytest.mark.parametrize("form", ["fma", "native"])
def test_the_gate_up_linear_with_silu_in_its_store_is_bitwise_the_two_calls(kind, x_dtype, form):
    """packed_linear_silu (linear.h's paired form: gate panel p and up panel p + P/2 in one work item, silu * up
    in the store) against fused_silu_mul(packed_linear(...)), bitwise: every row count's path (1-4 rows stream
    two panels at once, up to 8 one share a thread, more walk M blocks), bias or none, 1-3 threads, both bf16
    dot forms, K odd (a padded bf16 pair), and I not a whole number of panels (the two calls inside)."""
    before = torch.get_num_threads()
    g = torch.Generator().manual_seed(5)
    try:
        with bf16_dot(form):
            for intermediate, in_features in ((1536, 576), (96, 71), (40, 33)):
                packed = pack_weight(torch.randn(2 * intermediate, in_features, generator=g) * 0.1, kind)
                bias = torch.randn(2 * intermediate, generator=g).to(x_dtype)
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    for num_rows in (1, 2, 3, 4, 5, 8, 9, 64, 200):
                        x = (torch.randn(num_rows, in_features, generator=g) * 3).to(x_dtype)
                        for b in (None, bias):
                            fused = packed_linear_silu(x, packed, b)
                            assert fused.shape == (num_rows, intermediate) and fused.dtype == x_dtype
                            assert torch.equal(bits(fused), bits(fused_silu_mul(packed_linear(x, packed, b)))), \
                                (intermediate, in_features, threads, num_rows, b is None)
    finally:
        torch.set_num_threads(before)
    module = cpu_kernels()
    if kind != "bfloat16":   # the bf16 form is ignored by other panels, AMX included, as linear ignores it
        x = torch.randn(5, 576, generator=g).to(x_dtype)
        packed = pack_weight(torch.randn(3072, 576, generator=g), kind)
        args = (packed.panels, 3072, None, packed.scale, x_dtype == torch.bfloat16, BF16_AMX)
        assert torch.equal(bits(module.linear_silu(x, *args)), bits(module.silu_mul(module.linear(x, *args))))
    if kind == "bfloat16" and module.HAS_AMX and module.amx_permitted():   # AMX tiles: the two calls inside
        x = torch.randn(7, 576, generator=g).to(torch.bfloat16)
        packed = pack_weight(torch.randn(3072, 576, generator=g), "bfloat16")
        assert torch.equal(bits(module.linear_silu(x, packed.panels, 3072, None, None, True, BF16_AMX)),
                           bits(module.silu_mul(module.linear(x, packed.panels, 3072, None, None, True, BF16_AMX))))


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns as integers (so -0.0 and 0.0, or two NaNs, compare as the bits they are)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 49157])
def test_row_argmax_picks_torch_argmax_indices(vocab):
    """row_argmax (the sampler's greedy pick) against torch.argmax: random rows, ties (first wins), -0 and +0,
    NaN anywhere (the first NaN wins), all -inf, in a vector body and in the tail."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(24, vocab, generator=g)
    x[1] = x[1].round()                                      # many ties at the max
    x[2] = -float("inf")
    x[3] = 0.0
    x[3, vocab // 2:] = -0.0
    x[4, vocab - 1] = float("nan")
    x[5, vocab // 3] = float("nan")
    x[5, vocab - 1] = float("nan")
    x[6, vocab - 1] = float("inf")
    x[7, 0] = float("inf")
    x[7, vocab - 1] = float("inf")
    x[8] = x[8].clamp(max=0.5)                               # the max repeated wherever x >= 0.5
    assert cpu_kernels() is not None
    assert torch.equal(kernels.row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(cpu_kernels().row_argmax(x), x.argmax(dim=-1))


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


# ---- bfloat16 and int8 panels ------------------------------------------------------------------------

# rows across the 6-row register tile, k across the cache's K blocks (256 k in bf16, 512 in int8), columns
# across panels; the reference is one PyTorch op per k, so the shapes stay small
LINEAR_SHAPES = [(1, 576, 960), (7, 33, 77), (20, 576, 200), (13, 1536, 70), (5, 301, 65), (13, 1, 1)]


@pytest.mark.parametrize("num_rows,in_features,out_features", LINEAR_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bf16_packed_linear_is_bitwise_the_fixed_order_reference(num_rows, in_features, out_features, with_bias,
                                                                 out_dtype):
    """Pairs of k in order, odd element then even, one rounding per product-add (exact products): the
    kernel's FMA form and the PyTorch reference do the same float32 operations; odd in_features pads."""
    x, weight, bias = random_case(num_rows, in_features, out_features, seed=num_rows + 1, with_bias=with_bias)
    x = x.to(torch.bfloat16)
    with bf16_dot("fma"):
        ours = packed_linear(x, pack_weight(weight, "bfloat16"), bias, out_dtype)
    assert ours.shape == (num_rows, out_features) and ours.dtype == out_dtype
    assert torch.equal(ours, reference_linear_bf16(x, weight, bias, out_dtype))


def test_vdpbf16ps_gives_the_bits_of_the_fma_form():
    """The AVX512_BF16 instruction (where the build has it) against the FMA form, on rows of mixed
    magnitudes and odd widths; where the CPU lacks it, the switch falls back to the FMA form."""
    module = cpu_kernels()
    g = torch.Generator().manual_seed(11)
    for num_rows, in_features, out_features in ((1, 576, 960), (6, 1536, 576), (70, 301, 33)):
        x = (torch.randn(num_rows, in_features, generator=g) * torch.logspace(-3, 3, in_features)).to(torch.bfloat16)
        packed = pack_weight(torch.randn(out_features, in_features, generator=g), "bfloat16")
        args = (packed.panels, out_features, None, None, False)
        assert torch.equal(module.linear(x, *args, BF16_DP), module.linear(x, *args, BF16_FMA))
    assert kernels.bf16_dot_form() in (BF16_FMA, BF16_DP if module.NATIVE_BF16 else BF16_FMA,
                                       BF16_AMX if module.HAS_AMX else BF16_FMA)


def test_the_bf16_dot_choice_obeys_its_override_and_logs_the_probe(caplog):
    """"fma" never takes VDPBF16PS nor AMX, "native" takes VDPBF16PS wherever the build has it (it gives the
    documented bits here), "amx" and "auto" take AMX tiles wherever the build and the OS have them (logged),
    else "auto" times VDPBF16PS against the FMA form and logs the pick; an unknown mode raises."""
    module = cpu_kernels()
    amx = bool(module.HAS_AMX and module.amx_permitted())
    dp = BF16_DP if module.NATIVE_BF16 else BF16_FMA
    with bf16_dot("fma"):
        assert kernels.bf16_dot_form() == BF16_FMA
    with bf16_dot("native"):
        assert kernels.bf16_dot_form() == dp
    with bf16_dot("amx"):
        assert kernels.bf16_dot_form() == (BF16_AMX if amx else dp)
    with bf16_dot("auto"), caplog.at_level(logging.INFO, logger="lmi_handler.engine.model.kernels.bf16_form"):
        picked = kernels.bf16_dot_form()
    if amx:
        assert picked == BF16_AMX and "AMX tiles" in caplog.text
    else:
        assert picked in (BF16_FMA, dp)
        if module.NATIVE_BF16:
            assert "start-up probe" in caplog.text
    with pytest.raises(ValueError):
        choose_bf16_dot("amx-int8")
    assert kernels.bf16_form_name(BF16_AMX) == "AMX tiles"


def test_a_build_or_os_without_amx_refuses_the_amx_form_by_name():
    """Asking the kernel for AMX where it cannot run them raises (never a silent other form); where AMX
    runs, an unknown form number raises."""
    module = cpu_kernels()
    x = torch.randn(3, 64).to(torch.bfloat16)
    panels = pack_weight(torch.randn(40, 64), "bfloat16").panels
    if module.HAS_AMX and module.amx_permitted():
        with pytest.raises(RuntimeError, match="bf16 form must be"):
            module.linear(x, panels, 40, None, None, False, 3)
    else:
        with pytest.raises(RuntimeError, match="AMX"):
            module.linear(x, panels, 40, None, None, False, BF16_AMX)


@pytest.mark.parametrize("in_features,out_features", [(576, 960), (301, 70), (1536, 33), (64, 288)])
def test_amx_tiles_keep_every_rows_bits_alone_at_any_position_and_thread_count(in_features, out_features):
    """AMX tiles (where the CPU has them): each row's bits the same alone, in batches that put it at every
    position of a 16-row tile, across 32-row blocks and 256-row chunks, over 1-3 threads; odd K (a
    zero-padded tail step), panels streamed two at a time for one row tile (an odd last one alone),
    a partial last panel, float32 and bf16 outputs, with a bias."""
    module = needs_amx()
    g = torch.Generator().manual_seed(in_features)
    x = (torch.randn(300, in_features, generator=g) * torch.logspace(-2, 2, in_features)).to(torch.bfloat16)
    panels = pack_weight(torch.randn(out_features, in_features, generator=g), "bfloat16").panels
    bias = torch.randn(out_features, generator=g)
    before = torch.get_num_threads()
    try:
        for out_bf16 in (False, True):
            full = module.linear(x, panels, out_features, bias, None, out_bf16, BF16_AMX)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                for start, rows in ((37, 1), (37, 2), (30, 5), (0, 16), (9, 17), (100, 33), (0, 64), (3, 257)):
                    part = module.linear(x[start:start + rows], panels, out_features, bias, None, out_bf16, BF16_AMX)
                    assert torch.equal(part, full[start:start + rows]), (threads, start, rows, out_bf16)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("num_rows,in_features,out_features", LINEAR_SHAPES)
def test_amx_tiles_agree_with_the_float64_product_within_float32_accumulation(num_rows, in_features, out_features):
    """AMX tiles against the exact (float64) product of the bf16 values: every output within the bound of
    float32 accumulation over K, K * 2^-24 * sum |x w| (AMX's order inside a step is its own, so the
    reference is the exact value, not a fixed order); packed_linear takes AMX where "auto" does."""
    needs_amx()
    x, weight, _ = random_case(num_rows, in_features, out_features, seed=num_rows + 9, with_bias=False)
    x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    with bf16_dot("auto"):
        assert kernels.bf16_dot_form() == BF16_AMX
        ours = packed_linear(x, pack_weight(weight, "bfloat16"), None, torch.float32)
    exact = x.double() @ weight.double().T
    bound = in_features * 2.0 ** -24 * (x.double().abs() @ weight.double().abs().T)
    assert ((ours.double() - exact).abs() <= bound).all()
    assert not torch.equal(ours, torch.zeros_like(ours))


@pytest.mark.parametrize("num_rows", [*range(1, 14), 64, 200])
def test_the_vdpbf16ps_tile_is_bitwise_the_fma_form_and_the_reference_alone_and_in_a_batch(num_rows):
    """The native path (8-row VDPBF16PS tiles above 4 rows, where the build has AVX512_BF16) against the FMA
    form and the PyTorch reference for every tile remainder, odd K, several K blocks (577 k = 289 pairs)
    and a partial last panel; each row's bits the same computed alone."""
    module = cpu_kernels()
    g = torch.Generator().manual_seed(100 + num_rows)
    for in_features, out_features, check_reference in ((301, 70, True), (577, 33, False)):
        x = (torch.randn(num_rows, in_features, generator=g) * torch.logspace(-2, 2, in_features)).to(torch.bfloat16)
        weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
        bias = torch.randn(out_features, generator=g)
        panels = pack_weight(weight, "bfloat16").panels
        for out_bf16 in (False, True):
            native = module.linear(x, panels, out_features, bias, None, out_bf16, BF16_DP)
            assert torch.equal(native, module.linear(x, panels, out_features, bias, None, out_bf16, BF16_FMA))
            if check_reference:
                out_dtype = torch.bfloat16 if out_bf16 else torch.float32
                assert torch.equal(native, reference_linear_bf16(x, weight, bias, out_dtype))
            for row in {0, num_rows // 2, num_rows - 1}:
                alone = module.linear(x[row:row + 1], panels, out_features, bias, None, out_bf16, BF16_DP)
                assert torch.equal(alone, native[row:row + 1]), (row, in_features)


@pytest.mark.parametrize("num_rows,in_features,out_features", LINEAR_SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_packed_linear_is_bitwise_the_fixed_order_reference(num_rows, in_features, out_features, x_dtype,
                                                                 with_bias):
    x, weight, bias = random_case(num_rows, in_features, out_features, seed=num_rows + 2, with_bias=with_bias)
    x = x.to(x_dtype)
    packed = pack_weight(weight, "int8")
    q, scale = quantize_int8(weight)
    assert torch.equal(packed.unpack(), q) and torch.equal(packed.scale, scale)
    ours = packed_linear(x, packed, bias, torch.float32)
    assert torch.equal(ours, reference_linear_int8(x, q, scale, bias))
    if x_dtype == torch.bfloat16:
        assert torch.equal(packed_linear(x, packed, bias), reference_linear_int8(x, q, scale, bias, torch.bfloat16))


def test_int8_quantization_is_symmetric_per_output_channel():
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(40, 300, generator=g) * torch.logspace(-3, 1, 40)[:, None]   # rows of very different size
    weight[7] = 0
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.abs().max() <= 127
    torch.testing.assert_close(scale[:7], weight[:7].abs().amax(1) / 127)
    assert scale[7] == 1 and not q[7].any()
    assert (q.abs().amax(1)[scale != 1] == 127).all()                       # each row's largest maps to +-127
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("kind", ["bfloat16", "int8"])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 576), (129, 70)])
def test_a_row_has_the_same_bits_alone_and_in_any_batch_for_every_kind(kind, in_features, out_features):
    x, weight, bias = random_case(230, in_features, out_features, seed=3, with_bias=True)
    assert_rows_alone_match_the_batch(x.to(torch.bfloat16), pack_weight(weight, kind), bias)


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
@pytest.mark.parametrize("in_features", [19, 64])
def test_the_cpp_row_copy_is_the_tensor_ops_rows(kind, in_features):
    """PackedWeight.rows on CPU copies rows in one C++ call (linear.h packed_rows): the same values and dtype
    as its tensor-op form (rows_reference) for every row, odd widths (bf16's padded pair) included; an id
    outside the weight is refused."""
    weight = torch.randn(PANEL * 3 + 5, in_features)
    packed = pack_weight(weight, kind)
    ids = torch.arange(weight.shape[0]).flip(0)
    got, want = packed.rows(ids), packed.rows_reference(ids)
    assert got.dtype == want.dtype == packed.panels.dtype and torch.equal(got, want)
    assert torch.equal(got, weight.to(packed.panels.dtype)[ids])
    assert packed.rows(ids[:0]).shape == (0, in_features)
    with pytest.raises(RuntimeError, match="out of range"):
        packed.rows(torch.tensor([weight.shape[0]]))


def test_bf16_and_int8_panels_keep_the_rows_the_embedding_reads():
    weight = torch.randn(PANEL * 3 + 5, 19)
    packed = pack_weight(weight, "bfloat16")                  # odd in_features: padded pairs
    assert packed.panels.shape == (4, 10, 2 * PANEL) and packed.panels.dtype == torch.bfloat16
    assert torch.equal(packed.unpack(), weight.to(torch.bfloat16))
    ids = torch.tensor([0, PANEL - 1, PANEL, weight.shape[0] - 1, 7])
    assert torch.equal(packed.rows(ids), weight.to(torch.bfloat16)[ids])
    q, scale = quantize_int8(weight)
    assert torch.equal(pack_weight(weight, "int8").rows(ids), q[ids].float() * scale[ids, None])
    assert packed.nbytes == 4 * 10 * 2 * PANEL * 2
    with pytest.raises(ValueError, match="kind"):
        pack_weight(weight, "int4")


def test_a_bf16_weight_is_packed_without_widening():
    weight = torch.randn(70, 64).to(torch.bfloat16)
    packed = pack_weight(weight, "bfloat16")
    assert packed.panels.dtype == torch.bfloat16 and torch.equal(packed.unpack(), weight)
    assert packed.panels.data_ptr() % (2 << 20) == 0 and kernels.empty_huge(3, dtype=torch.int8).dtype == torch.int8


def test_row_ops_in_bf16_round_where_pytorch_rounds():
    """bf16 activations: RoPE is bitwise PyTorch's bf16 ops (each product and the sum rounded to bf16); the
    norm and SiLU differ from PyTorch only in float32 rounding before their final bf16 rounding, so by at
    most one bf16 step, rarely."""
    g = torch.Generator().manual_seed(8)
    x, delta = (torch.randn(64, 576, generator=g) * 3).to(torch.bfloat16), torch.randn(64, 576, generator=g).to(torch.bfloat16)
    weight = torch.randn(576, generator=g).to(torch.bfloat16)
    expected_x, expected = reference_add_rmsnorm(x, delta, weight, 1e-5)
    ours = fused_add_rmsnorm(x, delta, weight, 1e-5)
    assert torch.equal(x, expected_x) and ours.dtype == torch.bfloat16
    assert_within_one_bf16_step(ours, expected)
    gate_up = (torch.randn(64, 3072, generator=g) * 4).to(torch.bfloat16)
    assert_within_one_bf16_step(fused_silu_mul(gate_up), reference_silu_mul(gate_up))
    qkv, cos, sin, caches, slots = rope_case(37, 9, 3, 64, seed=9)
    qkv, cos, sin = qkv.to(torch.bfloat16), cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    k_cache, v_cache = (c.to(torch.bfloat16) for c in caches)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected_q = reference_rope_kv_write(qkv, cos, sin, k_ref, v_ref, slots, 9, 3)
    q = fused_rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, 9, 3)
    assert torch.equal(q, expected_q) and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def assert_within_one_bf16_step(ours: torch.Tensor, expected: torch.Tensor, max_fraction: float = 0.01):
    """Every value equal or one bf16 step away (2**-7 relative), and at most `max_fraction` not equal."""
    step = expected.float().abs().clamp_min(1e-30) * 2 ** -7
    assert ((ours.float() - expected.float()).abs() <= step * 1.01).all()
    assert (ours != expected).float().mean() <= max_fraction


def test_bf16_row_ops_give_a_row_the_same_bits_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(10)
    x, delta = torch.randn(150, 576, generator=g).to(torch.bfloat16), torch.randn(150, 576, generator=g).to(torch.bfloat16)
    weight, gate_up = torch.randn(576, generator=g).to(torch.bfloat16), torch.randn(150, 3072, generator=g).to(torch.bfloat16)
    full_norm = fused_add_rmsnorm(x.clone(), delta, weight, 1e-6)
    full_act = fused_silu_mul(gate_up)
    for num_rows, start in ((1, 0), (1, 77), (3, 10), (64, 20), (149, 1)):
        rows = slice(start, start + num_rows)
        assert torch.equal(fused_add_rmsnorm(x[rows].clone(), delta[rows], weight, 1e-6), full_norm[rows])
        assert torch.equal(fused_silu_mul(gate_up[rows].contiguous()), full_act[rows])


@pytest.mark.slow
def test_an_avx2_build_gives_the_same_bits_as_the_references():
    """CPUs without AVX-512 get the same kernels with 8-float vectors (-march=haswell: AVX2 + FMA). Built
    here under another name and checked like the native build: bf16 and int8 panels bitwise the fixed-order
    references (so every CPU gives the same bf16 and int8 logits), rows the same alone and in a batch."""
    from torch.utils.cpp_extension import load_inline

    from lmi_handler.engine.model.kernels.build import _SOURCE, _module_name, cpu_flags

    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    # linear.h alone (the headers it includes, the same flags as the extension's build): the whole extension
    # took CI 160 s to build a second time, for the one binding this test calls
    binding = ('#include "linear.h"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n  m.attr("VECTOR_WIDTH") = Vec::W;\n'
               '  m.attr("NATIVE_BF16") = NATIVE_BF16;\n  m.def("linear", &linear);\n}\n')
    module = load_inline(name=_module_name(_SOURCE) + "_avx2_linear", cpp_sources=[binding],
                         extra_include_paths=[str(_SOURCE.parent)],
                         extra_cflags=["-O3", "-march=haswell", "-ffp-contract=off", "-fopenmp"],
                         extra_ldflags=["-fopenmp"])
    assert module.VECTOR_WIDTH == 8 and not module.NATIVE_BF16
    for num_rows, in_features, out_features in ((1, 576, 960), (7, 33, 77), (20, 576, 200), (13, 1536, 70)):
        x, weight, bias = random_case(num_rows, in_features, out_features, seed=num_rows, with_bias=True)
        xb = x.to(torch.bfloat16)
        bf, i8 = pack_weight(weight, "bfloat16"), pack_weight(weight, "int8")
        q, scale = quantize_int8(weight)
        ours_bf = module.linear(xb, bf.panels, out_features, bias, None, False, False)
        ours_i8 = module.linear(x, i8.panels, out_features, bias, i8.scale, False, False)
        assert torch.equal(ours_bf, reference_linear_bf16(xb, weight, bias))
        assert torch.equal(ours_i8, reference_linear_int8(x, q, scale, bias))
        for row in (0, num_rows - 1):
            assert torch.equal(module.linear(xb[row:row + 1], bf.panels, out_features, bias, None, False, False),
                               ours_bf[row:row + 1])


def test_the_build_name_changes_with_the_torch_install_so_venvs_never_rebuild_each_others_build(monkeypatch, tmp_path):
    """torch writes its include paths into the build file: two venvs sharing a name would rebuild in turn."""
    from lmi_handler.engine.model.kernels.build import _SOURCE, _module_name

    here = _module_name(_SOURCE)
    assert _module_name(_SOURCE) == here                      # stable within one install
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert _module_name(_SOURCE) != here


def test_the_build_name_changes_with_the_sources_directory_so_checkouts_never_rebuild_each_others_build(tmp_path):
    """The build file names the source path: two checkouts of one version (git worktrees) sharing a name would
    rebuild in turn at every start; the same sources copied elsewhere get a name of their own."""
    import shutil

    from lmi_handler.engine.model.kernels.build import _SOURCE, _module_name

    copy = tmp_path / "kernels"
    shutil.copytree(_SOURCE.parent, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    assert _module_name(copy / _SOURCE.name) != _module_name(_SOURCE)


@pytest.mark.parametrize("mode", ["fma", "native", "amx", "auto"])
def test_every_bf16_form_choice_is_logged_and_a_form_the_cpu_lacks_is_a_warning(mode, caplog):
    """option.bf16_kernel's choice (bf16_form.choose_bf16_dot) says which form runs; asking for VDPBF16PS or AMX on a
    CPU without them runs the FMA form, with a warning naming what is missing (the AVX2-only AMD host has neither)."""
    module = cpu_kernels()
    with bf16_dot(mode), caplog.at_level(logging.INFO, logger="lmi_handler.engine.model.kernels.bf16_form"):
        form = kernels.bf16_dot_form()
    lines = [r for r in caplog.records if "bf16 linears" in r.getMessage() or "AMX tiles were asked" in r.getMessage()]
    assert lines, caplog.text
    if mode == "fma" or not (module.NATIVE_BF16 or module.HAS_AMX):
        assert form == BF16_FMA and "FMA form" in lines[-1].getMessage()
    if mode in ("native", "amx") and not module.NATIVE_BF16 and not module.HAS_AMX:
        assert any(r.levelno == logging.WARNING and "no AVX512_BF16" in r.getMessage() for r in lines), caplog.text
