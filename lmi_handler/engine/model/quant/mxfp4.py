"""MXFP4 expert weights (gpt-oss's checkpoints, quantization_config {"quant_method": "mxfp4"}): one expert's
blocks and scales read into weight.Codes, once at load.

The layout, as transformers' integrations/mxfp4.py reads it (and OpenAI's checkpoints are written): for a
stacked expert tensor <name> (gpt-oss: model.layers.{i}.mlp.experts.gate_up_proj and .down_proj),
<name>_blocks uint8 (E, N, G, 16) and <name>_scales uint8 (E, N, G), N the expert's output features (gate_up:
2I with gate and up interleaved, row 2j gate j and row 2j + 1 up j; down: hidden), G = K / 32 groups of 32
inputs. Byte b of a group holds input 2b in its low nibble and input 2b + 1 in its high nibble, each an e2m1
code (sign bit 3, then FP4_VALUES' magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6); the group's scale is e8m0, the
power 2^(scale - 127). Weight (n, k) = FP4_VALUES[code] * 2^(scale[n, k // 32] - 127): exact in float32 and
bfloat16 (one significant bit times a power of two), so the float model an MXFP4 checkpoint stands for is
one exact set of values, dequantize() here.

Our layout: the kernel's 4-bit panels holding the e2m1 codes as they are (kernels/linear_quant.h's CODE_E2M1
form: E2M1_VALUES[code] * 2^(scale - 127), zero 0), bitwise the float32 linear over the dequantized weight.
Half a byte a weight plus float32 group scales and zeros (6 bits a weight; MXFP4 itself 4.25, bfloat16 16).
Leaves detection to config.py, the kernel layout to weight.py and which tensors an expert's are to
families.py.
"""
from __future__ import annotations

import torch

from lmi_handler.engine.model.quant.config import QuantConfig
from lmi_handler.engine.model.quant.weight import E2M1_VALUES, Codes

FP4_VALUES = E2M1_VALUES
GROUP = 32


def unpack_e2m1(blocks: torch.Tensor) -> torch.Tensor:
    """(..., G, 16) uint8 -> (..., G * 32) uint8 e2m1 codes, input 2b from byte b's low nibble, 2b + 1 its high."""
    lo, hi = blocks & 15, blocks >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-2], -1)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight of MXFP4 blocks (..., N, G, 16) and scales (..., N, G) uint8: (..., N, G * 32) in
    `dtype`, FP4_VALUES[code] * 2^(scale - 127) (exact)."""
    values = torch.tensor(FP4_VALUES)[unpack_e2m1(blocks).long()]
    exponents = (scales.to(torch.int32) - 127).repeat_interleave(GROUP, dim=-1)
    return torch.ldexp(values, exponents.float()).to(dtype)


def codes_of(blocks: torch.Tensor, scales: torch.Tensor) -> Codes:
    """One linear's MXFP4 blocks (N, G, 16) and scales (N, G) as e2m1 Codes (see the module): codes (N, K) the
    e2m1 codes, zeros 0, scales (G, N) = 2^(scale - 127)."""
    group_scales = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32).float() - 127).T.contiguous()
    return Codes(unpack_e2m1(blocks).contiguous(), torch.zeros_like(group_scales), group_scales, GROUP, 4,
                 fmt="e2m1")


def read_mxfp4(hf: dict[str, torch.Tensor], names: tuple, q: QuantConfig) -> Codes:
    """Expert e of stacked tensor `name` (names = (name, e, transform): families._gpt_oss_expert_names) from
    <name>_blocks / <name>_scales, its rows put in our order ("transposed_pairs": the gate rows, then the up
    rows; the blocks are stored (out, in) already, so nothing is transposed). The stacked tensors stay in `hf`
    for the other experts (the loader drops them after the last)."""
    name, e, transform = names
    if f"{name}_blocks" not in hf or f"{name}_scales" not in hf:
        raise KeyError(f"weights missing from the checkpoint: [{name + '_blocks'!r}, {name + '_scales'!r}]")
    blocks, scales = hf[f"{name}_blocks"][e], hf[f"{name}_scales"][e]
    if transform == "transposed_pairs":
        blocks, scales = torch.cat([blocks[0::2], blocks[1::2]]), torch.cat([scales[0::2], scales[1::2]])
    return codes_of(blocks, scales)
