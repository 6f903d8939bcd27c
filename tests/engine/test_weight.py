"""engine/model/quant/weight.py and kernels/linear_quant.h: the code panels, the one float value of a quantized
weight (dequantize) and the C++ linear over the codes, against the float32 linear over that value."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.model.backends import torch_ref
from lmi_handler.engine.model.kernels import cpu_kernels, pack_weight, packed_linear
from lmi_handler.engine.model.linear import invariant_linear
from lmi_handler.engine.model.quant import Codes, pack_codes, quant_linear, quantize_fp8, quantize_int4

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels did not build")


def _codes(bits: int, group_size: int, act_order: bool, n: int = 70, k: int = 96, seed: int = 0,
           fp8: bool = False) -> Codes:
    """Random codes; fp8: e4m3 bytes (every finite one, no NaN) with float32 scales and zero 0."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen).to(torch.uint8)
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=gen).float()
    scales = (torch.rand(groups, n, generator=gen) * 0.05 + 1e-3).half().float()
    g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)] if act_order else None
    if fp8:
        codes = torch.where((codes & 0x7f) == 0x7f, codes - 1, codes)          # 0x7f / 0xff: NaN
        scales = torch.rand(groups, n, generator=gen) * 1e-3 + 1e-5
        return Codes(codes, torch.zeros_like(scales), scales, group_size, 8, g_idx, "e4m3")
    return Codes(codes, zeros, scales, group_size, bits, g_idx)


CASES = [(4, 32, False), (4, 32, True), (4, 40, False), (4, 96, False), (8, 32, False), (8, 64, True)]
FP8_CASES = [(8, 32, False), (8, 40, False), (8, 96, False)]       # 32 x 32 blocks, a partial block, per channel


@pytest.mark.parametrize("bits,group_size,act_order,fp8", [c + (False,) for c in CASES] + [(8, 32, True, True)])
def test_the_packed_codes_hold_exactly_the_weight_they_were_read_as(bits, group_size, act_order, fp8):
    codes = _codes(bits, group_size, act_order, fp8=fp8)
    weight = pack_codes(codes)
    assert torch.equal(weight.dequantize(), codes.dequantize())
    assert weight.panels.dtype == torch.uint8 and weight.panels.shape[2] == (16 if bits == 4 else 32)


@pytest.mark.parametrize("bits,group_size,act_order", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gives_the_bits_of_the_float32_linear_over_the_dequantized_weight_alone_and_in_any_batch(
        bits, group_size, act_order, dtype):
    _check_kernel(_codes(bits, group_size, act_order), dtype)


@pytest.mark.parametrize("bits,group_size,act_order", FP8_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_over_fp8_bytes_gives_the_bits_of_the_float32_linear_over_their_scaled_e4m3_values(
        bits, group_size, act_order, dtype):
    codes = _codes(bits, group_size, act_order, fp8=True)
    assert pack_codes(codes).panels.dtype == torch.uint8 and pack_codes(codes).kind == f"fp8_g{group_size}"
    _check_kernel(codes, dtype)


def _check_kernel(codes: Codes, dtype: torch.dtype) -> None:
    """Bitwise the float32 packed linear over dequantize() (columns in the kernel's k order), for 1 to 40 rows,
    and each row's bits the same alone as in the batch (one fixed chain over k per output)."""
    weight = pack_codes(codes)
    perm = weight.perm if weight.perm is not None else torch.arange(weight.in_features)
    floats = pack_weight(weight.dequantize()[:, perm].contiguous(), "float32")
    bias = torch.randn(weight.out_features)
    x = torch.randn(40, weight.in_features).to(dtype)
    for rows in (1, 3, 40):
        y = quant_linear(x[:rows], weight, bias)
        assert y.dtype == dtype
        assert torch.equal(y, packed_linear(x[:rows, perm].contiguous(), floats, bias, dtype))
    batch = quant_linear(x, weight, bias)
    assert all(torch.equal(quant_linear(x[i:i + 1], weight, bias)[0], batch[i]) for i in (0, 17, 39))
    exact = x.double() @ codes.dequantize().double().T + bias.double()
    assert torch.allclose(quant_linear(x, weight, bias, torch.float32).double(), exact, rtol=0, atol=1e-3)


def test_the_torch_backend_multiplies_by_the_dequantized_weight_as_its_reference():
    weight = pack_codes(_codes(4, 32, True))
    x = torch.randn(5, weight.in_features)
    assert torch.equal(torch_ref.linear(x, weight), invariant_linear(x, weight.dequantize()))


def test_int4_rounding_keeps_each_weight_within_half_a_step_of_its_group_s_q4_1_grid():
    w = torch.randn(48, 80)
    w[3, :32] = 0.25                                   # a constant group
    codes = quantize_int4(w)
    assert codes.bits == 4 and codes.group_size == 32 and codes.scales.shape == (3, 48)
    assert int(codes.codes.max()) <= 15
    step = codes.scales[torch.arange(80) // 32].T
    assert bool(((codes.dequantize() - w).abs() <= step / 2 * (1 + 1e-4) + 1e-6).all())
    assert torch.equal(codes.dequantize()[3, :32], torch.full((32,), 0.25))
    d, lo = torch.rand(48, 1) * 0.1, torch.randn(48, 1)      # weights already on a Q4_1 grid come back
    on_grid = torch.randint(0, 16, (48, 32)).float() * d + lo
    on_grid[:, 0], on_grid[:, 1] = lo[:, 0], (15 * d + lo)[:, 0]
    assert torch.allclose(quantize_int4(on_grid).dequantize(), on_grid, rtol=0, atol=1e-5)


def test_the_kernel_turns_every_finite_e4m3_byte_into_its_number():
    """An identity x reads the dequantized weight back: each of the 254 finite bytes (both zeros, the
    subnormals, +-448) times scale 1 is exactly the float8_e4m3fn number torch gives it."""
    finite = torch.tensor([b for b in range(256) if b & 0x7f != 0x7f], dtype=torch.uint8)
    codes = finite.view(2, 127).repeat(16, 1)                                   # (32, 127)
    ones = torch.ones(1, 32)
    weight = pack_codes(Codes(codes, torch.zeros_like(ones), ones, 127, 8, fmt="e4m3"))
    y = quant_linear(torch.eye(127), weight)                                    # (127, 32) = W^T
    assert torch.equal(y.T, codes.view(torch.float8_e4m3fn).float())


def test_fp8_rounding_keeps_each_weight_within_e4m3_s_half_step_of_its_row_scale():
    w = torch.randn(48, 80)
    w[5] = 0.0                                                                   # an all-zero row: scale 1
    codes = quantize_fp8(w)
    assert codes.fmt == "e4m3" and codes.group_size == 80 and codes.scales.shape == (1, 48)
    scale = codes.scales.T
    err = (codes.dequantize() - w).abs()
    assert bool((err <= torch.maximum(w.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6)).all())
    assert torch.equal(codes.dequantize()[5], torch.zeros(80))
    assert torch.allclose(codes.dequantize().abs().amax(1), w.abs().amax(1), rtol=1e-6, atol=0)      # amax -> 448
