"""Pure-PyTorch references for the C++ kernels (tests compare the two; CI runs both).

Owns the definitions the kernels must meet: for the bfloat16 and int8 linears a fixed accumulation
order that PyTorch ops reproduce exactly, for the float32 linear a float64 product; leaves the fast
paths to ops.py and the C++ sources.
"""
from __future__ import annotations

import torch


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference for float32 panels: x @ weight.T (+ bias) in float64, cast to x's dtype (the kernel's
    float32 FMA chain is within rounding of it; a float32 FMA cannot be spelled in PyTorch ops)."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(x.dtype)


def reference_linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bitwise reference for bfloat16 panels, in the kernel's order (linear.h): x and weight rounded to
    bf16; per output, pair by pair (i = 0, 1, ...): acc += x[2i+1] * w[2i+1], then acc += x[2i] * w[2i],
    each a float32 add of an exact product (bf16 x bf16 fits float32's 24 bits), so one rounding each,
    as the kernel's FMA and VDPBF16PS; then + bias (float32), then one rounding to `out_dtype`.
    x: (M, K), weight: (N, K), bias: (N,) or None -> (M, N). K loops of (M, N) ops: for tests only.
    (VDPBF16PS also flushes denormal inputs and results to zero; this reference and the FMA form keep them.)
    """
    xf, wf = x.to(torch.bfloat16).float(), weight.to(torch.bfloat16).float()
    if xf.shape[1] % 2:
        xf, wf = torch.nn.functional.pad(xf, (0, 1)), torch.nn.functional.pad(wf, (0, 1))
    acc = torch.zeros(xf.shape[0], wf.shape[0])
    for i in range(xf.shape[1] // 2):
        for k in (2 * i + 1, 2 * i):
            acc.add_(xf[:, k, None] * wf[None, :, k])
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def reference_linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                          out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference for int8 panels in the kernel's order (linear.h): per output, acc = fma(x[k], q[k], acc)
    for k = 0..K-1, then acc * scale (float32), then + bias, then one rounding to `out_dtype`.
    x: (M, K) float32 or bfloat16; q: (N, K) int8; scale: (N,) float32 -> (M, N).

    For bf16 x the FMA is a float32 add of the product, which is exact (8 significant bits times 8): bitwise.
    For float32 x it is a float64 add of the exact product rounded to float32, and the float64 sum can
    round before the float32 rounding (double rounding) when the two terms' exponents are more than ~21
    bits apart and the low bits sit on a halfway point: about 2**-29 per step on random data, none in
    the tests' fixed cases.
    """
    exact = x.dtype == torch.bfloat16            # float32 products exact: float32 ops are the FMA
    xs, qs = (x.float(), q.float()) if exact else (x.double(), q.double())
    acc = torch.zeros(x.shape[0], q.shape[0])
    for k in range(x.shape[1]):
        step = xs[:, k, None] * qs[None, :, k]
        if exact:
            acc.add_(step)
        else:
            acc = (acc.double() + step).float()
    acc = acc * scale.float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def reference_add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference for fused_add_rmsnorm (transformers' LlamaRMSNorm): (new x, normed) without
    touching x."""
    x = x if delta is None else x + delta
    xf = x.float()
    return x, weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                            num_kv_heads: int) -> torch.Tensor:
    """PyTorch reference for fused_rope_kv_write (split, rotate-half RoPE, index_copy_ into the caches)."""
    head_dim = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    q = rope(q.reshape(-1, num_heads, head_dim))
    k = rope(k.reshape(-1, num_kv_heads, head_dim))
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.reshape(-1, num_kv_heads, head_dim))
    return q


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """PyTorch reference for fused_silu_mul."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
