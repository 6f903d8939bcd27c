"""The linear layer as a Triton matmul with a fixed tiling and no split-K.

Every output element is one program's float32 accumulator, summed over K in BLOCK_K-wide steps in
increasing K, the same tiles for every number of rows: a row's bits do not depend on the batch. The M tile is
fixed too (a different M tile can change the tensor-core instruction and with it the order inside a step).
bf16/fp16 go into tl.dot as they are on a GPU (float32 accumulate); float32 inputs, and every input under
the interpreter (which mis-computes bf16 arithmetic), are widened to float32 and multiplied exactly ("ieee",
not tf32).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


# num_rows is not specialized (Triton would compile a variant for the value 1): one binary for every batch
@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(out, x, weight, bias, num_rows, num_cols, num_k, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, num_k, BLOCK_K):
        k = k0 + ks
        a = tl.load(x + rows[:, None] * stride_xm + k[None, :],
                    mask=(rows[:, None] < num_rows) & (k[None, :] < num_k), other=0.0)
        b = tl.load(weight + cols[None, :] * stride_wn + k[:, None],
                    mask=(cols[None, :] < num_cols) & (k[:, None] < num_k), other=0.0)
        if WIDEN:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols < num_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rows[:, None] * stride_om + cols[None, :], acc.to(out.dtype.element_ty),
             mask=(rows[:, None] < num_rows) & (cols[None, :] < num_cols))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (T, K) @ weight (N, K).T + bias (N,) -> (T, N) in `out_dtype` (default x's dtype), float32 accumulate,
    fixed K order, each output rounded once from its accumulator."""
    num_rows, num_k = x.shape
    num_cols = weight.shape[0]
    assert weight.shape[1] == num_k and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(num_rows, num_cols, dtype=out_dtype or x.dtype, device=x.device)
    if num_rows == 0:
        return out
    # CPU tensors run only under Triton's interpreter, which mis-computes bf16/fp16 products unwidened
    widen = x.dtype == torch.float32 or x.device.type == "cpu"
    grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(num_cols, BLOCK_N))
    _linear_kernel[grid](out, x, weight, bias if bias is not None else x, num_rows, num_cols, num_k,
                         x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, WIDEN=widen,
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
