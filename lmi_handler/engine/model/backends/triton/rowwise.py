"""Row-wise ops as Triton kernels: RMSNorm with the residual add, rotary embedding, activation x up.

One program per row (act_mul: per row and fixed column block); every reduction runs over one row in float32,
so a row's bits do not depend on the batch. Results are computed in float32 and rounded once to x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ACT_BLOCK = 1024   # act_mul's column block (element-wise: any width gives the same bits)


@triton.jit
def _rms_norm_kernel(out, residual_out, x, residual, weight, hidden, eps, weight_offset, stride_x, stride_r,
                     stride_o, stride_ro, HAS_RESIDUAL: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # the add in x's dtype: float32's sum rounded once is the correctly rounded fp16/bf16 sum
        r = tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x.dtype.element_ty)
        tl.store(residual_out + row * stride_ro + cols, h, mask=mask)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
    w = weight_offset + tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_IN_FLOAT:
        normed = hf * inv
    else:   # LlamaRMSNorm: the normalized row rounded to x's dtype first, the product rounded again
        normed = (hf * inv).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + row * stride_o + cols, (normed * w).to(out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             weight_offset: float = 0.0, weight_in_float: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, residual_out): h = x + residual (x's dtype; h = x without one), out = h * rsqrt(mean(h^2) + eps)
    * (weight_offset + weight) in float32 rounded to x's dtype (weight_in_float False: the normalized row
    rounded to x's dtype before the product, LlamaRMSNorm; torch_ref.rms_norm), residual_out = h. x: (T, hidden)."""
    num_rows, hidden = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    if num_rows == 0:
        return out, residual_out
    res = residual if residual is not None else x
    _rms_norm_kernel[(num_rows,)](out, residual_out, x, res, weight, hidden, eps, weight_offset, x.stride(0),
                                  res.stride(0), out.stride(0), residual_out.stride(0),
                                  HAS_RESIDUAL=residual is not None, WEIGHT_IN_FLOAT=weight_in_float,
                                  BLOCK=triton.next_power_of_2(hidden))
    return out, residual_out


@triton.jit
def _rope_kernel(out, x, cos, sin, num_heads, stride_xt, stride_xh, stride_ot, stride_oh, stride_c, stride_s,
                 HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    row = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_heads) & (d < HEAD_DIM)
    half = HEAD_DIM // 2
    first = d < half
    partner = tl.where(first, d + half, d - half)          # rotate_half(x)[d] = -x[d + half] | x[d - half]
    xv = tl.load(x + row * stride_xt + h * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x + row * stride_xt + h * stride_xh + partner, mask=mask, other=0.0).to(tl.float32)
    xp = tl.where(first, -xp, xp)
    c = tl.load(cos + row * stride_c + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    s = tl.load(sin + row * stride_s + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    tl.store(out + row * stride_ot + h * stride_oh + d, (xv * c + xp * s).to(out.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HF's convention), x: (T, H, D), cos/sin: (T, D); a new tensor."""
    num_rows, num_heads, head_dim = x.shape
    assert head_dim % 2 == 0 and x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    _rope_kernel[(num_rows,)](out, x, cos, sin, num_heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                              cos.stride(0), sin.stride(0), HEAD_DIM=head_dim,
                              HEADS_PAD=triton.next_power_of_2(num_heads),
                              DIM_PAD=triton.next_power_of_2(head_dim))
    return out


@triton.jit
def _act_mul_kernel(out, gate_up, inter, stride_g, stride_o, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gate_up + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)          # sqrt(2 / pi) * (g + 0.044715 g^3)
        e = tl.exp(-2.0 * tl.abs(z))
        t = (1.0 - e) / (1.0 + e)
        a = 0.5 * g * (1.0 + tl.where(z < 0, -t, t))
    else:
        a = g / (1.0 + tl.exp(-g))
    tl.store(out + row * stride_o + cols, (a * u).to(out.dtype.element_ty), mask=mask)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for gate_up (T, 2I) = [gate | up]; act "silu" or "gelu_tanh". Returns (T, I)."""
    if act not in ("silu", "gelu_tanh"):
        raise ValueError(f"act must be 'silu' or 'gelu_tanh', got {act!r}")
    num_rows, width = gate_up.shape
    inter = width // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    _act_mul_kernel[(num_rows, triton.cdiv(inter, ACT_BLOCK))](out, gate_up, inter, gate_up.stride(0),
                                                               out.stride(0), GELU=act == "gelu_tanh",
                                                               BLOCK=ACT_BLOCK)
    return out


@triton.jit
def _clamped_swiglu_kernel(out, gate_up, inter, stride_g, stride_o, alpha, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.minimum(tl.load(gate_up + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32), limit)
    u = tl.load(gate_up + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    a = g / (1.0 + tl.exp(-(g * alpha)))
    tl.store(out + row * stride_o + cols, ((u + 1.0) * a).to(out.dtype.element_ty), mask=mask)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation (torch_ref.clamped_swiglu's formula) for gate_up (T, 2I) = [gate | up]: gate
    clamped to <= limit, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1), in float32 rounded once
    to gate_up's dtype. Returns (T, I)."""
    num_rows, width = gate_up.shape
    inter = width // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    _clamped_swiglu_kernel[(num_rows, triton.cdiv(inter, ACT_BLOCK))](out, gate_up, inter, gate_up.stride(0),
                                                                      out.stride(0), alpha, limit, BLOCK=ACT_BLOCK)
    return out
