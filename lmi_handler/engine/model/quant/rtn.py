"""option.quantize=int4: a float checkpoint's layer linears rounded to nearest at load, 4-bit codes with a zero
point and a scale per group of 32 input columns (llama.cpp's Q4_1 grid), into weight.Codes.

Per group of one output row: scale = (max - min) / 15 rounded up to bfloat16 (so the dequantized value, code minus
zero times scale, is exact in float32), zero = round(-min / scale) clamped to [0, 15], code = round(w / scale) +
zero clamped to [0, 15] (so each weight is within half a step of its value, or one step at the range's ends
where both roundings went up). A constant group gets scale 1 and its value in the zero point where it is an integer
(else the nearest). Computed in float32, one weight widened at a time."""
from __future__ import annotations

import torch

from lmi_handler.engine.model.quant.weight import Codes

INT4_GROUP = 32


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> Codes:
    """(N, K) float weight -> 4-bit Codes (see the module). K need not be a multiple of group_size."""
    n, k = weight.shape
    groups = -(-k // group_size)
    w = torch.nn.functional.pad(weight.float(), (0, groups * group_size - k)).view(n, groups, group_size)
    real = torch.nn.functional.pad(torch.ones(k), (0, groups * group_size - k)).view(groups, group_size) > 0
    big, small = torch.finfo(torch.float32).max, torch.finfo(torch.float32).min
    hi = torch.where(real, w, torch.full_like(w, small)).amax(-1).clamp(min=0)
    lo = torch.where(real, w, torch.full_like(w, big)).amin(-1).clamp(max=0)
    exact = (hi - lo) / 15
    scale = exact.to(torch.bfloat16)
    up = (scale.view(torch.int16) + 1).view(torch.bfloat16)                  # the next bf16 (scale >= 0)
    scale = torch.where(scale.float() < exact, up, scale).float()           # never below: the range fits 0..15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    codes = (torch.round(w / scale[..., None]) + zero[..., None]).clamp(0, 15)
    codes = codes.view(n, -1)[:, :k].to(torch.uint8).contiguous()
    return Codes(codes, zero.T.contiguous(), scale.T.contiguous(), group_size, 4)
