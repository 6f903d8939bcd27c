"""engine/model/quant/formats.py: each format's tensors, written as its quantizer writes them
(tests/engine/quant_checkpoints.py), read back into the codes of the float weight they hold."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.model.quant.config import QuantConfig
from lmi_handler.engine.model.quant.formats import READERS, unpack_int32
from tests.engine.quant_checkpoints import awq_module, compressed_module, gptq_module, pack_words

W = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.1


def _read(method: str, tensors: dict, config: QuantConfig):
    hf = {f"m.{name}": t for name, t in tensors.items()}
    codes = READERS[method](hf, "m", config)
    assert hf == {}, "every tensor of the module is taken"
    return codes


@pytest.mark.parametrize("bits", [4, 8])
def test_int32_words_unpack_along_either_dimension_low_bits_first(bits):
    codes = torch.randint(0, 1 << bits, (16, 24), dtype=torch.uint8)
    assert torch.equal(unpack_int32(pack_words(codes, bits, 0), bits, 0), codes)
    assert torch.equal(unpack_int32(pack_words(codes, bits, 1), bits, 1), codes)
    assert pack_words(codes, bits, 0).shape == (16 * bits // 32, 24)


@pytest.mark.parametrize("bits,group_size,sym,desc_act,v1", [(4, 32, True, False, True), (4, 32, False, True, True),
                                                               (4, -1, False, False, False), (8, 64, True, True, True),
                                                               (8, 32, False, False, False)])
def test_gptq_reads_back_the_weight_it_packed_in_v1_and_v2_with_act_order(bits, group_size, sym, desc_act, v1):
    tensors, dequant = gptq_module(W, bits, group_size, sym, desc_act, v1)
    config = QuantConfig("gptq", bits, group_size, sym, desc_act, zero_offset=1 if v1 else 0)
    codes = _read("gptq", tensors, config)
    assert torch.equal(codes.dequantize(), dequant)
    assert (codes.g_idx is not None and not torch.equal(codes.g_idx, torch.arange(128) // codes.group_size)) == desc_act


def test_awq_reads_back_the_weight_it_packed_in_its_0_2_4_6_1_3_5_7_nibble_order():
    tensors, dequant = awq_module(W, 32)
    assert tensors["qweight"].shape == (128, 8)
    assert torch.equal(_read("awq", tensors, QuantConfig("awq", 4, 32, sym=False)).dequantize(), dequant)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, None), (8, 64)])
def test_compressed_tensors_pack_quantized_reads_back_the_weight_it_packed(bits, group_size):
    tensors, dequant = compressed_module(W, bits, group_size)
    config = QuantConfig("compressed-tensors", bits, group_size or -1)
    assert torch.equal(_read("compressed-tensors", tensors, config).dequantize(), dequant)
