"""A mixture-of-experts layer's routed experts as one grouped Triton matmul per projection (the fused MoE
kernel): the (token, rank) pairs sorted by expert, each expert's pairs padded to whole BLOCK_M row blocks, and
every program one (row block, column block) of one expert, with the matmul's fixed K tile and no split-K.

Each output element is one program's float32 accumulator over its own row, summed in BLOCK_K steps in
increasing K whatever the batch (matmul.py's rule), so a pair's gate_up and down outputs have the same bits
alone and in any batch; silu * up is rowwise.act_mul; the combination per token runs in rank order
(moe.combine_ranks). The grid is bounded without a host sync (cdiv(T * K, BLOCK_M) + E blocks, the unused ones
exiting at once), and an expert no pair chose has no block: its weights are never read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmi_handler.engine.model.backends.triton.matmul import BLOCK_K, BLOCK_M, BLOCK_N
from lmi_handler.engine.model.backends.triton.rowwise import act_mul
from lmi_handler.engine.model.moe import MoeWeights, combine_ranks


@triton.jit
def _grouped_kernel(out, x, weight, sorted_pairs, block_expert, num_cols, num_k, row_div, stride_xm,
                    stride_we, stride_wn, stride_om, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair] = x[pair // row_div] @ weight[e].T for the pairs of row block program_id(0), all of expert e =
    block_expert[program_id(0)] (-1: an unused block); sorted_pairs -1 pads an expert's last block."""
    block = tl.program_id(0)
    expert = tl.load(block_expert + block)
    if expert >= 0:
        slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_pairs + slots)
        live = pairs >= 0
        rows = tl.where(live, pairs // row_div, 0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        w = weight + expert.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, num_k, BLOCK_K):
            k = k0 + ks
            a = tl.load(x + rows[:, None] * stride_xm + k[None, :], mask=live[:, None] & (k[None, :] < num_k),
                        other=0.0)
            b = tl.load(w + cols[None, :] * stride_wn + k[:, None], mask=(cols[None, :] < num_cols) &
                        (k[:, None] < num_k), other=0.0)
            if WIDEN:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        tl.store(out + tl.where(live, pairs, 0)[:, None] * stride_om + cols[None, :], acc.to(out.dtype.element_ty),
                 mask=live[:, None] & (cols[None, :] < num_cols))


def sort_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, rank) pairs p = t * K + k grouped by expert, each expert's run padded with -1 to whole
    BLOCK_M blocks: (sorted_pairs (num_blocks * BLOCK_M,) int32, block_expert (num_blocks,) int32, -1 past the
    used blocks), num_blocks = cdiv(T * K, BLOCK_M) + num_experts (a bound: no host sync). Token order inside an
    expert's run (a stable sort)."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs, BLOCK_M) + num_experts
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first_block = torch.cumsum(blocks, 0) - blocks
    first_pair = torch.cumsum(counts, 0) - counts
    sorted_ids = flat[order]
    dest = first_block[sorted_ids] * BLOCK_M + torch.arange(num_pairs, device=ids.device) - first_pair[sorted_ids]
    sorted_pairs = torch.full((num_blocks * BLOCK_M,), -1, dtype=torch.int32, device=ids.device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_expert = torch.full((num_blocks,), -1, dtype=torch.int32, device=ids.device)
    used = torch.repeat_interleave(torch.arange(num_experts, dtype=torch.int32, device=ids.device), blocks)
    block_expert[:used.numel()] = used
    return sorted_pairs, block_expert


def _grouped(out, x, weight, sorted_pairs, block_expert, row_div: int) -> torch.Tensor:
    num_cols, num_k = weight.shape[1], weight.shape[2]
    widen = x.dtype == torch.float32 or x.device.type == "cpu"     # matmul.py: the interpreter widens everything
    grid = (block_expert.numel(), triton.cdiv(num_cols, BLOCK_N))
    _grouped_kernel[grid](out, x, weight, sorted_pairs, block_expert, num_cols, num_k, row_div,
                          x.stride(0), weight.stride(0), weight.stride(1), out.stride(0), WIDEN=widen,
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """torch_ref.moe_experts' contract: gate_up over every pair's token row, silu * up, down over the pairs' rows,
    each a grouped matmul; combined per token in rank order in float32. The experts' weights are stacked once
    per layer (w.prepared: gate_up (E, 2I, hidden), down (E, hidden, I))."""
    if w.prepared is None:
        w.prepared = (torch.stack(list(w.gate_up)), torch.stack(list(w.down)))
        w.gate_up, w.down = list(w.prepared[0].unbind(0)), list(w.prepared[1].unbind(0))  # views: one copy held
    gate_up_w, down_w = w.prepared
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    sorted_pairs, block_expert = sort_pairs(ids, gate_up_w.shape[0])
    gate_up = torch.empty(num_pairs, gate_up_w.shape[1], dtype=x.dtype, device=x.device)
    _grouped(gate_up, x.contiguous(), gate_up_w, sorted_pairs, block_expert, top_k)
    act = act_mul(gate_up, "silu")
    outs = torch.empty(num_pairs, down_w.shape[1], dtype=x.dtype, device=x.device)
    _grouped(outs, act, down_w, sorted_pairs, block_expert, 1)
    return combine_ranks(outs.view(num_tokens, top_k, -1), weights, x.dtype)
