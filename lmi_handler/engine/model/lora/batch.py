"""The batched low-rank product: each row's LoRA term against its own adapter, in row-invariant tiles
(`lora_delta`, the pure-PyTorch reference), and a step's stacks as the forward (`LoraBatch.add`) and the C++
decoder stack (`LoraBatch.kernel_set`, for kernels/lora.h's row-wise product) take them."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Callable, Iterable

import torch

from lmi_handler.engine.model.lora.adapters import FUSED, KERNEL_PROJECTIONS, LoraAdapter

TILE = 16                 # rows per bmm tile: a row's bits do not depend on how many rows share its step
CUDA_TILES_PER_CALL = 8   # CUDA: a fixed bmm batch count, so cuBLAS's kernel choice is fixed


@dataclass
class TileLayout:
    """Where each adapter row goes in lora_delta's tiles: rows grouped by slot, each slot's rows padded to whole
    TILE-row tiles. Made once per step (LoraBatch) so the projections' calls need no host sync."""

    rows: torch.Tensor          # (N,) int64 flat rows that have an adapter, grouped by slot
    slots: torch.Tensor         # (N,) int64 their slots
    place: torch.Tensor         # (N,) int64 their row in the tiles (num_tiles * TILE rows)
    tile_slot: torch.Tensor     # (num_tiles,) int64 each tile's slot
    num_tiles: int
    groups: tuple[tuple[int, int, int], ...] = ()   # (slot, first tile, tiles) of each slot used, host ints (CPU)


def tile_layout(row_slot: torch.Tensor) -> TileLayout | None:
    """The tiles of a step's rows (row_slot (T,) int64, -1 = base); None when no row has an adapter."""
    rows = torch.nonzero(row_slot >= 0).flatten()
    if rows.numel() == 0:
        return None
    slots = row_slot[rows]
    order = torch.argsort(slots, stable=True)
    rows, slots = rows[order], slots[order]
    used, counts = torch.unique_consecutive(slots, return_counts=True)
    tiles_per_slot = [-(-n // TILE) for n in counts.tolist()]       # host sync: the tile count sizes the tensors
    device = row_slot.device
    tile_slot = torch.repeat_interleave(used, torch.tensor(tiles_per_slot, device=device))
    first_tile = torch.tensor([0] + tiles_per_slot[:-1], device=device).cumsum(0)       # per used slot
    first_row = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])
    group = torch.repeat_interleave(torch.arange(len(tiles_per_slot), device=device), counts)
    place = first_tile[group] * TILE + torch.arange(rows.numel(), device=device) - first_row[group]
    groups = ()
    if device.type == "cpu":                          # a CPU tensor's values are on the host already
        starts = [0] + list(accumulate(tiles_per_slot))[:-1]
        groups = tuple(zip(used.tolist(), starts, tiles_per_slot))
    return TileLayout(rows, slots, place, tile_slot, sum(tiles_per_slot), groups)


def lora_delta(x: torch.Tensor, row_slot: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
               scale: torch.Tensor, layout: TileLayout | None = None) -> torch.Tensor:
    """Each row's LoRA term against its own adapter: (x A_s^T) B_s^T * scale_s for s = row_slot[t], 0 for -1.

    x: (T, in); row_slot: (T,) int64 on x's device, -1 = the base (no adapter); a_stack: (num_slots, r_max, in);
    b_stack: (num_slots, out, r_max), ranks below r_max zero-padded; scale: (num_slots,); layout: tile_layout(
    row_slot), made here when not given. Returns (T, out) in x's dtype, computed in a_stack's dtype. Grouped:
    each slot's rows are gathered into zero-padded TILE-row tiles and all tiles go through one bmm against their
    slot's A then B (as linear.invariant_linear), so a row's bits depend only on itself and its adapter,
    never on the rows beside it.
    """
    out = torch.zeros(x.shape[0], b_stack.shape[1], dtype=x.dtype, device=x.device)
    layout = layout if layout is not None else tile_layout(row_slot)
    if layout is None:
        return out
    dtype = a_stack.dtype
    xt = torch.zeros(layout.num_tiles * TILE, x.shape[1], dtype=dtype, device=x.device)
    xt[layout.place] = x[layout.rows].to(dtype)
    tiles = xt.view(layout.num_tiles, TILE, -1)
    shrink = _tiled_bmm(tiles, a_stack, layout.tile_slot, layout.groups)         # (tiles, TILE, r_max)
    expand = _tiled_bmm(shrink, b_stack, layout.tile_slot, layout.groups)        # (tiles, TILE, out)
    delta = expand.view(layout.num_tiles * TILE, -1)[layout.place] * scale[layout.slots].to(dtype)[:, None]
    out[layout.rows] = delta.to(x.dtype)
    return out


def _tiled_bmm(tiles: torch.Tensor, stack: torch.Tensor, tile_slot: torch.Tensor,
               groups: tuple[tuple[int, int, int], ...] = ()) -> torch.Tensor:
    """tiles[i] @ stack[tile_slot[i]]^T for every tile: (n, TILE, k) x (num_slots, m, k) -> (n, TILE, m).
    CPU: one bmm per slot used (`groups`, TileLayout's), its weight broadcast over the slot's tiles (a stride-0
    view, as linear.tiled_matmul: MKL runs every tile through the same kernel whatever their number), so
    no tile copies its weight. CUDA: CUDA_TILES_PER_CALL tiles a call (the last padded), so the kernel cuBLAS
    picks never depends on n."""
    if tiles.device.type == "cpu" and groups:
        outs = [torch.bmm(tiles[first:first + n], stack[slot].t().expand(n, -1, -1)) for slot, first, n in groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    weights = stack.index_select(0, tile_slot).transpose(1, 2)                # (n, k, m)
    if tiles.device.type == "cpu":
        return torch.bmm(tiles, weights)
    n, per = tiles.shape[0], CUDA_TILES_PER_CALL
    pad = -n % per
    tiles = torch.nn.functional.pad(tiles, (0, 0, 0, 0, 0, pad))
    weights = torch.nn.functional.pad(weights, (0, 0, 0, 0, 0, pad))
    outs = [torch.bmm(tiles[i:i + per], weights[i:i + per]) for i in range(0, n + pad, per)]
    return torch.cat(outs)[:n]


@dataclass
class LoraBatch:
    """One step's adapters, built once per step by the model runner: each row's slot and, per (layer,
    projection), the stacked A and B of the step's adapters (slot i = adapters[i]).

    Projection names are the base's (q_proj ...) or a fused one of FUSED (qkv_proj, gate_up_proj): a fused
    projection's A stacks its parts' A along the rank, its B places each part's B in its own rows and rank
    columns (block diagonal), so one lora_delta gives every part its own term, exactly.
    """

    row_slot: torch.Tensor                          # (T,) int64, -1 = base
    scale: torch.Tensor                             # (num_slots,)
    stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # the stacks as a kernel takes them (kernel_set, backend_stacks), made once per adapter set: shared by the
    # copies the runner makes of its kept LoraBatch each step (dataclasses.replace passes this dict on, not a copy)
    prepared: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, adapters: list[LoraAdapter], rows_per_seq: list[int], seq_adapter: list[int | None],
              shapes: dict[str, tuple[int, int]], device: torch.device, dtype: torch.dtype = torch.float32,
              fused: Iterable[str] = ()) -> "LoraBatch":
        """`adapters`: the step's distinct adapters (slot order); sequence j computes rows_per_seq[j] rows with
        slot seq_adapter[j] (None = base); `shapes`: base_module_shapes; `fused`: FUSED names the forward
        calls instead of their parts. Stacks in `dtype` on `device`."""
        slots = [-1 if s is None else s for s in seq_adapter]
        row_slot = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64),
                                           torch.tensor(rows_per_seq, dtype=torch.int64)).to(device, non_blocking=True)
        scale = torch.tensor([a.scale for a in adapters], dtype=dtype).to(device, non_blocking=True)
        keys = {key for a in adapters for key in a.weights}
        stacks = {}
        for layer, module in sorted(keys):
            stacks[(layer, module)] = _stack(adapters, layer, [module], shapes, device, dtype)
        for name in fused:
            parts = FUSED[name]
            for layer in sorted({layer for layer, module in keys if module in parts}):
                stacks[(layer, name)] = _stack(adapters, layer, list(parts), shapes, device, dtype)
        return cls(row_slot, scale, stacks)

    @cached_property
    def layout(self) -> TileLayout | None:
        """tile_layout(row_slot), made at the first add and then shared by every projection of the step; the
        C++ stack and the Triton kernel group the rows themselves and never ask for it."""
        return tile_layout(self.row_slot)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """y + this step's LoRA term for projection `module` of `layer` (y unchanged when no adapter of the
        step has it). x: (T, in) the projection's input, y: (T, out) its output."""
        stack = self.stacks.get((layer, module))
        if stack is None:
            return y
        return y + lora_delta(x, self.row_slot, stack[0], stack[1], self.scale, self.layout)


    def kernel_set(self, ops, num_layers: int):
        """These stacks as the C++ kernels' LoraSet (kernels/lora.h; `ops`: cpu_kernels()): per layer, A and B^T
        (float32, contiguous) of KERNEL_PROJECTIONS (the FUSED names and o/down_proj; None where no adapter of the
        set has one), and the scales. Made at the first call and kept with the set (`prepared`), so a step pays
        nothing for it."""
        made = self.prepared.get("cpu")
        if made is None or made[0] is not ops:
            layers = []
            for layer in range(num_layers):
                pairs: list[torch.Tensor | None] = []
                for module in KERNEL_PROJECTIONS:
                    stack = self.stacks.get((layer, module))
                    pairs += [None, None] if stack is None else [
                        stack[0].float().contiguous(), stack[1].float().transpose(1, 2).contiguous()]
                layers.append(pairs)
            made = self.prepared["cpu"] = (ops, ops.LoraSet(layers, self.scale.float().contiguous()))
        return made[1]

    def backend_stacks(self, prepare: Callable[[torch.Tensor, torch.Tensor], object]) -> dict:
        """These stacks as a backend's LoRA kernel takes them: (layer, projection) -> prepare(A, B) (`prepare`: the
        backend's lora_stack, which checks and lays them out). Made at the first call and kept with the set
        (`prepared`, as kernel_set), so a step's projections pay nothing for it."""
        made = self.prepared.get("backend")
        if made is None or made[0] is not prepare:
            made = self.prepared["backend"] = (prepare, {key: prepare(a, b) for key, (a, b) in self.stacks.items()})
        return made[1]


def _stack(adapters: list[LoraAdapter], layer: int, parts: list[str], shapes: dict[str, tuple[int, int]],
           device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A (num_slots, r_max * len(parts), in), B (num_slots, sum of the parts' out, r_max * len(parts))."""
    r_max = max(a.rank for a in adapters)
    in_features = shapes[parts[0]][0]
    outs = [shapes[p][1] for p in parts]
    a_stack = torch.zeros(len(adapters), r_max * len(parts), in_features, dtype=dtype)
    b_stack = torch.zeros(len(adapters), sum(outs), r_max * len(parts), dtype=dtype)
    for slot, adapter in enumerate(adapters):
        row = 0
        for i, part in enumerate(parts):
            pair = adapter.weights.get((layer, part))
            if pair is not None:
                a, b = pair
                a_stack[slot, i * r_max:i * r_max + a.shape[0]] = a
                b_stack[slot, row:row + outs[i], i * r_max:i * r_max + a.shape[0]] = b
            row += outs[i]
    return a_stack.to(device, non_blocking=True), b_stack.to(device, non_blocking=True)   # (no stream sync)


def linear_with_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     lora: LoraBatch | None, layer: int, module: str) -> torch.Tensor:
    """A plain Linear's forward with the step's adapters: x W^T (+ bias) + lora term. The reference the
    forward's hook (LoraBatch.add after its own linear) is tested against."""
    y = torch.nn.functional.linear(x, weight, bias)
    return y if lora is None else lora.add(y, x, layer, module)
