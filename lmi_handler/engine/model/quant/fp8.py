"""FP8 (float8 e4m3) weights of one linear read into weight.Codes: each byte kept as it is (the code, fmt "e4m3":
its value the e4m3 number, weight.e4m3_values) with a float32 scale per group of input columns and output row, zero 0, so
a weight is value(byte) * scale in float32 (one rounding) and stays 8 bits in memory. Two layouts:

- quant_method fp8 (transformers' FineGrainedFP8Config / DeepSeek-V3, Qwen3-FP8): weight float8_e4m3fn (N, K);
  weight_scale_inv float32 (ceil(N / bn), ceil(K / bk)) for weight_block_size [bn, bk] (despite its name the
  weight is fp8 * scale_inv, as DeepSeek's weight_dequant and transformers' Fp8Dequantize compute), or one value
  per tensor without a block size (vLLM's per-tensor form names it weight_scale).
- compressed-tensors float-quantized (FP8 W8A8 / W8A16 from llm-compressor): weight float8_e4m3fn (N, K);
  weight_scale (1,) per tensor, (N, 1) per channel or (ceil(N / bn), ceil(K / bk)) per block_structure block;
  weight_shape_original where the quantizer padded the weight to whole blocks.

Activation scales (input_scale, activation_scale: static fp8 activations) are dropped: weight-only, activations
stay in the engine's dtype. Leaves detection to config.py and the kernel's layout to weight.py.
"""
from __future__ import annotations

import torch

from lmi_handler.engine.model.quant.config import QuantConfig
from lmi_handler.engine.model.quant.formats import drop_activation_tensors, group_scales
from lmi_handler.engine.model.quant.weight import Codes


def block_scales(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """(ceil(n / bn), ceil(k / bk)) block scales -> (ceil(k / bk), n) float32: row n's scale of each K block.
    Raises ValueError for another shape."""
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"block scales of a ({n}, {k}) weight in {bn}x{bk} blocks must be {want}, got "
                         f"{tuple(scale.shape)}")
    return scale.float()[torch.arange(n) // bn].T.contiguous()


def read_fp8(hf: dict[str, torch.Tensor], prefix: str, q: QuantConfig) -> Codes:
    """One linear's e4m3 weight and scales (see the module) as Codes (group_size: the block's columns, or k).
    Raises KeyError for a missing tensor, ValueError for a weight not float8_e4m3fn, holding NaN or with scales of
    another shape."""
    weight = hf.pop(prefix + ".weight", None)
    names = [f"{prefix}.{m}" for m in q.markers if f"{prefix}.{m}" in hf]
    if weight is None or not names:
        raise KeyError(f"weights missing from the checkpoint: [{prefix + '.weight'!r}] with a scale of {q.markers}")
    scale = hf.pop(names[0])
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{prefix}.weight: {q.describe()} needs float8_e4m3fn weights, got {weight.dtype}")
    codes = weight.view(torch.uint8)
    if bool(((codes & 0x7F) == 0x7F).any()):
        raise ValueError(f"{prefix}.weight holds NaN (bytes 0x7f / 0xff): a broken FP8 checkpoint")
    padded = hf.pop(prefix + ".weight_shape_original", None)
    n, k = codes.shape if padded is None else (int(v) for v in padded.tolist())
    if q.block is not None and scale.numel() > 1:
        scales, group = block_scales(scale, codes.shape[0], codes.shape[1], q.block), q.block[1]
        scales = scales[:, :n]
    else:
        scales, group = group_scales(scale, codes.shape[0])[:, :n], k
    zero = hf.pop(prefix + ".weight_zero_point", None)
    if zero is not None and bool(zero.float().ne(0).any()):
        raise ValueError(f"{prefix}.weight_zero_point: FP8 weights with zero points are not supported")
    drop_activation_tensors(hf, prefix)
    codes = codes[:n, :k].contiguous()
    return Codes(codes, torch.zeros_like(scales), scales.contiguous(), group, 8, fmt="e4m3")


READERS = {"fp8": read_fp8, "compressed-tensors/float-quantized": read_fp8}
