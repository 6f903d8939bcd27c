"""The Python calls of the C++ kernels: the packed linear (alone and with silu * up), the fused row-wise ops
and the row argmax, each a thin wrapper of one binding.

Owns which arguments each binding gets (the bf16 panels' form from bf16_form.py); leaves the panels to
packing.py, building the extension to build.py and the references to reference.py.
"""
from __future__ import annotations

import torch

from lmi_handler.engine.model.kernels.bf16_form import bf16_dot_form
from lmi_handler.engine.model.kernels.build import built_kernels, cpu_kernels
from lmi_handler.engine.model.kernels.packing import PackedWeight


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ W.T (+ bias), each output one fixed chain of float32 operations over k (linear.h), so a row's
    bits do not depend on the other rows. x: (M, in) float32 or bfloat16 CPU (rounded to bf16 for
    bfloat16 panels) -> (M, out) in `out_dtype` (float32 or bfloat16; default x's dtype), each value
    rounded once. Needs cpu_kernels() not None.
    Bitwise references: reference.reference_linear_bf16 / reference_linear_int8 (float32 panels:
    reference_linear within rounding)."""
    out_dtype = out_dtype or x.dtype
    return cpu_kernels().linear(x, weight.panels, weight.out_features, bias, weight.scale,
                                out_dtype == torch.bfloat16, bf16_dot_form() if weight.kind == "bfloat16" else 0)


def packed_linear_silu(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up of a fused gate_up linear in one pass: bitwise fused_silu_mul(packed_linear(x, weight,
    bias)), without writing the (M, 2I) gate_up output. x: (M, in) float32 or bfloat16 CPU; weight: the
    packed cat(gate, up) rows, (2I, in); returns (M, I) in x's dtype. I not a multiple of the panel width
    (32 columns) or AMX bf16 panels take the two calls instead (same result)."""
    return cpu_kernels().linear_silu(x, weight.panels, weight.out_features, bias, weight.scale,
                                     x.dtype == torch.bfloat16, bf16_dot_form() if weight.kind == "bfloat16" else 0)


def fused_add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (when given), then weight * x / sqrt(mean(x^2) + eps) per row, in one pass.

    x, delta: (T, N) float32 or bfloat16 CPU, x contiguous; weight: (N,) in x's dtype. Returns (T, N). The
    residual add is bitwise PyTorch's; the norm is transformers' LlamaRMSNorm (float32 inside; in bf16
    the normalized row is rounded to bf16 before the scale, as there) except for the order of the sum of
    squares (a rounding-level difference). Row-wise: a row's bits depend on it alone.
    """
    return cpu_kernels().add_rmsnorm(x, delta, weight, eps)


def fused_rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                        num_kv_heads: int) -> torch.Tensor:
    """RoPE (rotate-half) on q and k of fused qkv rows; rotated k and v stored at their cache slots.

    qkv: (T, (H + 2 KVH) D) float32 or bfloat16 contiguous (q, then k, then v); cos, sin: (T, D) and
    caches (num_blocks, block_size, KVH, D) contiguous in the same dtype, written in place; slot_mapping:
    (T,) int64. Returns q: (T, H, D). Bitwise the same as reference_rope_kv_write (same float operations
    and, in bf16, the same roundings).
    Raises: RuntimeError on mismatched shapes or a slot outside the cache.
    """
    return cpu_kernels().rope_kv_write(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)


def fused_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = cat(gate, up) rows: (T, 2I) float32 or bfloat16 contiguous -> (T, I)."""
    return cpu_kernels().silu_mul(gate_up)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1), the same indices (first of the largest, a NaN counting as the largest),
    for (N, V) float32 CPU logits through the C++ kernel when it is built (vmath.h argmax_row: one vector
    pass for the max, one for its first index; torch's CPU argmax reduces a row element by element),
    else torch.argmax itself. Returns (N,) int64."""
    module = built_kernels()
    if (module is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.shape[1] == 0):
        return logits.argmax(dim=-1)
    return module.row_argmax(logits)
