"""The C++ row-invariant linear against its float64 reference, and its bitwise batch invariance."""
from __future__ import annotations

import logging

import pytest
import torch

from lmi_handler.engine.model import kernels
from lmi_handler.engine.model.kernels import PANEL, cpu_kernels, pack_weight, packed_linear, reference_linear


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
