"""The LoRA term of a projection as one Triton kernel: each row's x A_s^T B_s^T * scale_s added onto the
projection's output for its adapter slot s (punica's gathered shrink-then-expand, fused into one launch).

The grid is (row block, slot, column block). A program takes BLOCK_M consecutive rows and keeps those whose
slot is its own (the others are masked out and left alone, so a row of slot -1 is never touched): it shrinks
them against the slot's A over the whole input in BLOCK_K steps of increasing K (no split-K, no split over
the batch), keeps the (BLOCK_M, r_max) product in registers, expands it against the slot's B for its columns,
scales and adds. Every product is float32 ("ieee", no tf32), inputs widened inside the kernel (the
interpreter mis-computes bf16 arithmetic otherwise), and each output element depends only on its own row of x
and its slot's A and B: a row's bits do not depend on the rows beside it or on how many there are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 128, 64


# num_rows is not specialized (Triton would compile a variant for the value 1): one binary for every batch
@triton.jit(do_not_specialize=["num_rows"])
def _lora_kernel(y, x, row_slot, a_stack, b_stack, scale, num_rows, num_cols, num_k, rank,
                 stride_y, stride_x, stride_as, stride_ar, stride_bs, stride_bn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    slot = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mine = (tl.load(row_slot + rows, mask=rows < num_rows, other=-1) == slot) & (rows < num_rows)
    if tl.sum(mine.to(tl.int32), axis=0) > 0:          # a block without a row of this slot does nothing
        ranks = tl.arange(0, BLOCK_R)
        ks = tl.arange(0, BLOCK_K)
        a_base = a_stack + slot.to(tl.int64) * stride_as
        shrunk = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(0, num_k, BLOCK_K):
            k = k0 + ks
            xv = tl.load(x + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                         mask=mine[:, None] & (k[None, :] < num_k), other=0.0)
            av = tl.load(a_base + ranks[None, :] * stride_ar + k[:, None],
                         mask=(ranks[None, :] < rank) & (k[:, None] < num_k), other=0.0)
            shrunk = tl.dot(xv.to(tl.float32), av.to(tl.float32), shrunk, input_precision="ieee")
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        bv = tl.load(b_stack + slot.to(tl.int64) * stride_bs + cols[None, :] * stride_bn + ranks[:, None],
                     mask=(cols[None, :] < num_cols) & (ranks[:, None] < rank), other=0.0)
        delta = tl.dot(shrunk, bv.to(tl.float32), input_precision="ieee") * tl.load(scale + slot).to(tl.float32)
        where = y + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        keep = mine[:, None] & (cols[None, :] < num_cols)
        out = tl.load(where, mask=keep, other=0.0).to(tl.float32) + delta
        tl.store(where, out.to(y.dtype.element_ty), mask=keep)


@dataclass(frozen=True)
class LoraStack:
    """One projection's adapter stacks as lora_add takes them, checked and made contiguous once (lora_stack):
    a (num_slots, r_max, in), b (num_slots, out, r_max), ranks below r_max zero-padded; block_r the kernel's
    rank tile (a power of two >= r_max, at least 16)."""

    a: torch.Tensor
    b: torch.Tensor
    block_r: int


def lora_stack(a_stack: torch.Tensor, b_stack: torch.Tensor) -> LoraStack:
    """The stacks of one projection (LoraBatch.stacks' pair) as a LoraStack, made once per adapter set
    (LoraBatch.backend_stacks). Raises ValueError when b_stack is not (num_slots, out, r_max) for a_stack's
    (num_slots, r_max, in)."""
    if a_stack.dim() != 3 or b_stack.dim() != 3 or (b_stack.shape[0], b_stack.shape[2]) != a_stack.shape[:2]:
        raise ValueError(f"lora_stack: b_stack {tuple(b_stack.shape)} must be (num_slots, out, r_max) for a_stack "
                         f"{tuple(a_stack.shape)} (num_slots, r_max, in)")
    return LoraStack(a_stack.contiguous(), b_stack.contiguous(), max(16, triton.next_power_of_2(a_stack.shape[1])))


def lora_add(y: torch.Tensor, x: torch.Tensor, row_slot: torch.Tensor, stack: LoraStack,
             scale: torch.Tensor) -> torch.Tensor:
    """y += each row's LoRA term, in place, and returns y: y[t] + (x[t] A_s^T) B_s^T * scale_s for s =
    row_slot[t] >= 0, computed in float32 and rounded once to y's dtype; rows of slot -1 keep their bits.

    y: (T, out) the projection's output; x: (T, in) its input; row_slot: (T,) int64 on their device; stack:
    lora_stack(A, B) of the projection; scale: (num_slots,). The same term as lora.lora_delta, without its
    tiles' gather and scatter. Checks here only what the step brings (the rows of x and y against the stack).
    """
    a_stack, b_stack = stack.a, stack.b
    num_rows, num_k = x.shape
    num_slots, rank, _ = a_stack.shape
    num_cols = y.shape[1]
    if a_stack.shape[2] != num_k or b_stack.shape[1] != num_cols or y.shape[0] != num_rows:
        raise ValueError(f"lora_add: shapes do not match: y {tuple(y.shape)}, x {tuple(x.shape)}, a_stack "
                         f"{tuple(a_stack.shape)}, b_stack {tuple(b_stack.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    assert y.stride(1) == 1 and row_slot.is_contiguous()
    if num_rows == 0 or num_slots == 0:
        return y
    grid = (triton.cdiv(num_rows, BLOCK_M), num_slots, triton.cdiv(num_cols, BLOCK_N))
    _lora_kernel[grid](y, x, row_slot, a_stack, b_stack, scale, num_rows, num_cols, num_k, rank,
                       y.stride(0), x.stride(0), a_stack.stride(0), a_stack.stride(1), b_stack.stride(0),
                       b_stack.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_R=stack.block_r)
    return y
