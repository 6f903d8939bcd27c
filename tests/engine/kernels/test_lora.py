"""The C++ LoRA term (kernels/lora.h: lora_add, LoraSet) against lora_delta, its pure-PyTorch reference.

The two sum in different orders (the kernel: one FMA chain per rank and per output column; lora_delta: MKL's
bmm), so they agree within float32 rounding, not bitwise; in bf16 both round the term and the sum to bf16, so
a value may differ by the one bf16 rounding a float32 difference can flip. Batch invariance is the kernel's
own and checked bitwise.
"""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.model.kernels import cpu_kernels
from lmi_handler.engine.model.lora import lora_delta

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _case(seed: int, rows: int = 29, in_features: int = 70, out_features: int = 45):
    """Three slots of rank 8 (slot 1 a rank-5 adapter, zero-padded), x and y of `rows` rows with base rows
    (-1) among them; 70 and 45 features: vector lanes and a scalar tail on both sides."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(3, 8, in_features, generator=g), torch.randn(3, out_features, 8, generator=g)
    a[1, 5:], b[1, :, 5:] = 0, 0
    scale = torch.tensor([2.0, 0.5, 1.25])
    row_slot = torch.tensor([(i * 7) % 4 - 1 for i in range(rows)])
    x, y = torch.randn(rows, in_features, generator=g), torch.randn(rows, out_features, generator=g)
    return x, y, row_slot, a, b, scale


def _cpp(y, x, row_slot, a, b, scale):
    return cpu_kernels().lora_add(y.clone(), x, row_slot, a, b.transpose(1, 2).contiguous(), scale)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_the_cpp_lora_term_matches_lora_delta_and_leaves_base_rows_alone(dtype):
    x, y, row_slot, a, b, scale = _case(0)
    x, y = x.to(DTYPES[dtype]), y.to(DTYPES[dtype])
    got = _cpp(y, x, row_slot, a, b, scale)
    expected = y + lora_delta(x, row_slot, a, b, scale)
    base = row_slot < 0
    assert base.any() and (~base).any() and len(set(row_slot.tolist())) == 4
    assert torch.equal(got[base], y[base])                                   # the base rows' bits kept
    assert (got[~base] - y[~base]).abs().max() > 1                          # the adapters' term is there
    if dtype == "fp32":
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:                                                                    # at most one bf16 rounding apart
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_rows_cpp_lora_term_is_the_same_bits_alone_and_in_any_batch(dtype):
    x, y, row_slot, a, b, scale = _case(1, rows=40)
    x, y = x.to(DTYPES[dtype]), y.to(DTYPES[dtype])
    mixed = _cpp(y, x, row_slot, a, b, scale)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    shuffled = _cpp(y[order], x[order], row_slot[order], a, b, scale)
    assert torch.equal(shuffled, mixed[order])
    for t in range(40):
        alone = _cpp(y[t:t + 1], x[t:t + 1], row_slot[t:t + 1], a, b, scale)
        assert torch.equal(alone[0], mixed[t]), t


def test_the_lora_set_adds_each_projections_term_where_the_set_has_one():
    """LoraSet (the decoder stack's stacks of one adapter set): projection p of layer l adds the lora_add term
    of that pair, and a projection no adapter of the set has is left as it is."""
    x, y, row_slot, a, b, scale = _case(2)
    bt = b.transpose(1, 2).contiguous()
    lora_set = cpu_kernels().LoraSet([[None] * 8, [None, None, a, bt, None, None, None, None]], scale)
    assert lora_set.num_slots == 3
    assert torch.equal(lora_set.add(y.clone(), x, row_slot, 1, 1), _cpp(y, x, row_slot, a, b, scale))
    assert torch.equal(lora_set.add(y.clone(), x, row_slot, 0, 1), y)
    assert torch.equal(lora_set.add(y.clone(), x, row_slot, 1, 2), y)


def test_a_slot_outside_the_set_is_refused_naming_it():
    x, y, row_slot, a, b, scale = _case(3)
    with pytest.raises(RuntimeError, match=r"row_slot\[2\] = 3 is outside \[-1, 3\)"):
        _cpp(y, x, torch.tensor([0, 1, 3] + [0] * 26), a, b, scale)
