"""engine/model/quant/formats.py and fp8.py: each format's tensors, written as its quantizer writes them
(tests/engine/quant_checkpoints.py), read back into the codes of the float weight they hold."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.model.quant import READERS
from lmi_handler.engine.model.quant.config import QuantConfig, read_quant_config
from lmi_handler.engine.model.quant.formats import unpack_int32
from lmi_handler.engine.model.quant.weight import e4m3_values
from tests.engine.quant_checkpoints import (
    awq_module,
    compressed_int_module,
    compressed_module,
    fp8_module,
    gptq_module,
    pack_words,
    quant_config,
)

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


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, None), (8, 64)])
def test_compressed_tensors_asymmetric_pack_quantized_reads_back_its_zero_points_packed_along_the_outputs(
        bits, group_size):
    tensors, dequant = compressed_module(W, bits, group_size, sym=False)
    assert tensors["weight_zero_point"].shape == (64 * bits // 32, 128 // (group_size or 128))
    config = QuantConfig("compressed-tensors", bits, group_size or -1, sym=False, fmt="pack-quantized")
    codes = _read("compressed-tensors", tensors, config)
    assert torch.equal(codes.dequantize(), dequant) and bool((codes.zeros != 1 << (bits - 1)).any())


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_int_quantized_w8a8_reads_its_int8_weight_and_channel_scales(sym):
    tensors, dequant = compressed_int_module(W, sym)
    tensors["input_scale"] = torch.tensor([0.02])                  # static activations: dropped (weight-only)
    config = QuantConfig("compressed-tensors", 8, -1, sym=sym, fmt="int-quantized")
    codes = _read("compressed-tensors/int-quantized", tensors, config)
    assert torch.equal(codes.dequantize(), dequant)


WIDE = torch.randn(70, 100, generator=torch.Generator().manual_seed(4)) * 0.1      # partial 32 x 32 blocks


@pytest.mark.parametrize("block", [(32, 32), (128, 128), None])
def test_fp8_reads_e4m3_bytes_with_block_or_tensor_scales_as_8_bit_codes_of_the_same_weight(block):
    tensors, dequant = fp8_module(WIDE, block)
    assert tensors["weight_scale_inv"].shape == ((3, 4) if block == (32, 32) else (1, 1) if block else (1,))
    tensors["activation_scale"] = torch.tensor(0.5)
    codes = _read("fp8", tensors, QuantConfig("fp8", 8, block[1] if block else -1, fp8=True, block=block))
    assert codes.codes.dtype == torch.uint8 and codes.bits == 8 and torch.equal(codes.zeros, torch.zeros_like(codes.zeros))
    assert torch.equal(codes.dequantize(), dequant)
    assert torch.allclose(dequant, WIDE, rtol=0.07, atol=1e-3)              # e4m3: 3 mantissa bits


@pytest.mark.parametrize("channel", [True, False])
def test_compressed_tensors_float_quantized_reads_e4m3_weights_with_channel_or_tensor_scales(channel):
    tensors, dequant = fp8_module(WIDE, None, "weight_scale", channel)
    assert tensors["weight_scale"].shape == ((70, 1) if channel else (1,))
    config = QuantConfig("compressed-tensors", 8, -1, fmt="float-quantized", fp8=True)
    assert torch.equal(_read("compressed-tensors/float-quantized", tensors, config).dequantize(), dequant)


def test_the_e4m3_table_holds_every_byte_s_number_exactly():
    values = e4m3_values()
    assert values[0x38] == 1.0 and values[0x7e] == 448.0 and values[0xfe] == -448.0 and values[0x01] == 2.0 ** -9
    assert torch.isnan(values[0x7f]) and torch.isnan(values[0xff])
    finite = torch.arange(256)[~torch.isnan(values)]
    assert torch.equal(values[finite].to(torch.float8_e4m3fn).view(torch.uint8).long(), finite)


@pytest.mark.parametrize("method,kw,block,reader", [
    ("fp8", dict(block=(128, 128)), (128, 128), "fp8"),
    ("fp8", dict(block=None), None, "fp8"),
    ("compressed-tensors", dict(fmt="float-quantized", block=(128, 128)), (128, 128),
     "compressed-tensors/float-quantized"),
    ("compressed-tensors", dict(fmt="float-quantized", channel=True), None, "compressed-tensors/float-quantized"),
])
def test_fp8_configs_are_read_as_e4m3_weights_whose_activation_scheme_is_named_as_not_done(method, kw, block, reader):
    config = read_quant_config({"quantization_config": quant_config(method, **kw)})
    assert config.fp8 and config.bits == 8 and config.block == block and config.reader == reader
    assert config.group_size == (block[1] if block else -1)
    assert "activations not done: weight-only" in config.describe()


def test_compressed_tensors_w8a8_is_read_as_8_bit_weights_and_its_int8_activations_named_as_not_done():
    config = read_quant_config({"quantization_config": quant_config("compressed-tensors", fmt="int-quantized")})
    assert (config.reader, config.bits, config.group_size, config.fp8) == ("compressed-tensors/int-quantized", 8, -1,
                                                                          False)
    assert "int8 dynamic per token activations not done" in config.describe()


def test_an_fp8_weight_holding_nan_bytes_is_refused_naming_the_tensor():
    tensors, _ = fp8_module(WIDE, (32, 32))
    tensors["weight"].view(torch.uint8)[3, 5] = 0x7F
    with pytest.raises(ValueError, match=r"m\.weight holds NaN"):
        _read("fp8", tensors, QuantConfig("fp8", 8, 32, fp8=True, block=(32, 32)))
