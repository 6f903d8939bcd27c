"""The linear pieces every backend's walk shares: the tiled batch-invariant matmul of the PyTorch reference,
the collectives a tensor-parallel shard calls, and the row-parallel linear that meets them.

Owns INVARIANT_TILE / tiled_matmul (the reference backend's linear), Collectives (what forward.DecoderModel
calls on its group) and row_parallel_linear (the float32 reduce after o_proj and down_proj); leaves the
collectives themselves to engine/parallel/group.py and each backend's own linear kernel to backends/.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

INVARIANT_TILE = 16   # rows per bmm tile of the reference linear (MKL: 16-row tiles measured invariant)
CUDA_TILES_PER_CALL = 8   # CUDA: tiles per bmm call, a fixed shape (128 rows) so cuBLAS's choice is fixed


class Collectives(Protocol):
    """What a tensor-parallel shard of the model calls on its group (engine/parallel/group.TPGroup)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_rows(self, x: torch.Tensor, owner: torch.Tensor) -> torch.Tensor: ...

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None: ...


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) over zero-padded INVARIANT_TILE-row tiles (tiled_matmul), so every row goes
    through the same BLAS kernel whatever its batch (plain F.linear picks kernels by row count, e.g. GEMV for
    one row, and a row's bits move with the batch). x: (T, in), weight: (out, in) -> (T, out) in x's dtype."""
    out = tiled_matmul(x, weight, INVARIANT_TILE, None if x.device.type == "cpu" else CUDA_TILES_PER_CALL)
    return out if bias is None else out + bias


def tiled_matmul(x: torch.Tensor, weight: torch.Tensor, tile: int, tiles_per_call: int | None = None) -> torch.Tensor:
    """x @ weight.T over zero-padded `tile`-row slices of x: (T, in) -> (T, out) in x's dtype.

    CPU: one bmm over all the tiles (MKL runs every tile through the same kernel whatever their number,
    measured): `tiles_per_call` None. CUDA: cuBLAS picks its kernel (split-K among its choices) by the whole
    problem's shape, the batch count included, so invariant_linear passes CUDA_TILES_PER_CALL: the tiles go
    that many at a time, the last call padded with zero tiles, every call the same shape, so a row's bits do
    not depend on how many rows share its step.
    """
    num_rows = x.shape[0]
    num_tiles = -(-num_rows // tile)
    group = tiles_per_call or num_tiles
    num_calls = -(-num_tiles // group)
    xp = F.pad(x, (0, 0, 0, num_calls * group * tile - num_rows)).view(num_calls, group, tile, -1)
    w = weight.t().expand(group, -1, -1)
    outs = [torch.bmm(xp[i], w) for i in range(num_calls)]           # each (group, tile, out)
    out = outs[0] if num_calls == 1 else torch.cat(outs)
    return out.view(num_calls * group * tile, -1)[:num_rows]


def row_parallel_linear(x: torch.Tensor, weight, bias: torch.Tensor | None, group: Collectives | None,
                        linear: Callable) -> torch.Tensor:
    """A row-parallel linear (o_proj, down_proj: this rank holds a slice of the input features): its partial
    x @ weight.T in float32 (`linear(x, weight, None, torch.float32)`, a backend's linear: the C++ packed one
    writes its float32 accumulators as they are), summed over the ranks in rank order (group.all_reduce:
    bitwise the same on every rank and per row), then the bias once (every rank holds it whole), then rounded
    once to x's dtype. group None (one process): linear(x, weight, bias). x: (T, in / degree) -> (T, out).

    Summing float32 partials (not bf16 ones) keeps a bf16 model's reduce as exact as its one-rank
    accumulator; on CPU the doubled bytes are a (T, hidden) exchange per layer, small beside the weights.
    """
    if group is None:
        return linear(x, weight, bias)
    out = group.all_reduce(linear(x, weight, None, torch.float32))       # (T, out) float32
    return (out if bias is None else out + bias.float()).to(x.dtype)
