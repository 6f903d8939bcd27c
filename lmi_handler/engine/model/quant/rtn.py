"""option.quantize=int4: a float checkpoint's layer linears rounded to nearest at load, 4-bit codes with a scale
and an offset per group of 32 input columns of each output row (llama.cpp's Q4_1 grid: w ~ d q + min), into
weight.Codes. option.quantize=fp8 on a float checkpoint: e4m3 with a scale per output row (quantize_fp8).

Per group: scale d = (max - min) / 15 and zero = -min / d (float32, so the grid's lowest point is the group's
minimum, not a multiple of d), code = round((w - min) / d) in [0, 15]; the value is (code - zero) * d as every
quantized weight (weight.py), within about half a step of w. A constant group gets d = 1 and codes 0. A checkpoint
already on a Q4_1 grid (the demo model, converted from its Q4_1 GGUF) comes back within float32 rounding.
Computed in float32, one weight widened at a time."""
from __future__ import annotations

import torch

from lmi_handler.engine.model.quant.weight import Codes

INT4_GROUP = 32


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> Codes:
    """(N, K) float weight -> 4-bit Codes (see the module). K need not be a multiple of group_size."""
    n, k = weight.shape
    groups = -(-k // group_size)
    pad = groups * group_size - k
    w = torch.nn.functional.pad(weight.float(), (0, pad)).view(n, groups, group_size)
    real = torch.nn.functional.pad(torch.ones(k), (0, pad)).view(groups, group_size) > 0
    hi = torch.where(real, w, torch.full_like(w, -torch.inf)).amax(-1)
    lo = torch.where(real, w, torch.full_like(w, torch.inf)).amin(-1)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15)
    codes = codes.view(n, -1)[:, :k].to(torch.uint8).contiguous()
    zero = -lo / scale
    return Codes(codes, zero.T.contiguous(), scale.T.contiguous(), group_size, 4)


def quantize_fp8(weight: torch.Tensor) -> Codes:
    """(N, K) float weight -> e4m3 Codes with one float32 scale per output row, amax / 448 (e4m3's largest
    finite number; an all-zero row gets scale 1): byte = the e4m3 nearest w / scale (torch's float8_e4m3fn
    rounding, to nearest even), so each weight comes back within 2^-4 of itself relatively (3 mantissa bits)."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    codes = (w / scale).to(torch.float8_e4m3fn).view(torch.uint8).contiguous()
    return Codes(codes, torch.zeros_like(scale.T), scale.T.contiguous(), w.shape[1], 8, fmt="e4m3")
