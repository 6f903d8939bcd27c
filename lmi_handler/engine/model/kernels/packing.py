"""Packed weight panels for the C++ row-invariant linear (float32, bfloat16, int8).

Owns the panel layouts and int8 quantization: `pack_weight` is a function of one (out, in) weight
tensor, so any slice of a weight (a tensor-parallel shard) packs the same way. Leaves building the
extension to build.py, calling the kernels to ops.py and their references to reference.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmi_handler.engine.model.kernels.build import PANEL, built_kernels, empty_huge

KINDS = ("float32", "bfloat16", "int8")   # packed weight kinds: the panels' dtype names them


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight (out_features, in_features) repacked for ops.packed_linear.

    panels, by kind (P = ceil(out_features / PANEL); columns past out_features are zero):
      float32  (P, in, PANEL):           panels[p, k, j]         = W[p*PANEL + j, k]
      bfloat16 (P, ceil(in/2), 2 PANEL): panels[p, i, 2j + e]    = W[p*PANEL + j, 2i + e] (bf16, pairs
               of k side by side: VDPBF16PS's operand layout; an odd in_features is zero-padded)
      int8     (P, in, PANEL):           panels[p, k, j]         = q[p*PANEL + j, k], W ~ scale[n] * q[n]
    Each is k-major, so the kernel streams one panel from start to end per row block.
    scale: (out_features,) float32 for int8 (per output channel), else None.
    """

    panels: torch.Tensor
    out_features: int
    in_features: int
    scale: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return str(self.panels.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        """Bytes one pass over the weight reads (panels and scales)."""
        extra = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.panels.numel() * self.panels.element_size() + extra

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding lookup on a tied lm_head): (len(ids), in), in the
        panels' dtype (exact copies) except int8, whose rows come back dequantized in float32. On CPU with
        the kernels built, float32 and bfloat16 rows are copied by one C++ call (linear.h packed_rows, the same
        values as the tensor ops below, `rows_reference`)."""
        module = built_kernels()
        if (module is not None and self.scale is None and self.panels.device.type == "cpu" and ids.dtype == torch.int64
                and ids.dim() == 1):
            return module.packed_rows(self.panels, ids, self.out_features, self.in_features)
        return self.rows_reference(ids)

    def rows_reference(self, ids: torch.Tensor) -> torch.Tensor:
        """rows() as tensor ops, any device and kind."""
        p, j = ids // PANEL, ids % PANEL
        if self.kind == "bfloat16":
            pairs = self.panels.view(self.panels.shape[0], -1, PANEL, 2)[p, :, j]      # (n, ceil(in/2), 2)
            return pairs.reshape(len(ids), -1)[:, :self.in_features]
        rows = self.panels[p, :, j]
        return rows if self.scale is None else rows.float() * self.scale[ids, None]

    def unpack(self) -> torch.Tensor:
        """The (out_features, in_features) weight (a copy): exact for float32 and bfloat16; for int8 the
        integer codes q (int8), see `scale`."""
        return self.rows(torch.arange(self.out_features)) if self.scale is None else \
            self.panels.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].clone()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: weight (out, in) float -> (q (out, in) int8, scale (out,) float32)
    with scale[n] = max_k |weight[n, k]| / 127 and q = round(weight / scale) (half to even), so
    weight ~ scale[:, None] * q and |q| <= 127. Computed in float32 (one weight widened at a time).
    An all-zero row gets scale 1 (q = 0)."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def panels_shape(out_features: int, in_features: int, kind: str) -> tuple[int, int, int]:
    """The panels' shape of an (out_features, in_features) weight packed as `kind` (see PackedWeight)."""
    num_panels = -(-out_features // PANEL)
    if kind == "bfloat16":
        return num_panels, (in_features + in_features % 2) // 2, 2 * PANEL
    return num_panels, in_features, PANEL


ARENA_ALIGN = 4096   # bytes: each weight's panels start on a page boundary inside the arena


def panel_arena(parts: list[tuple[tuple[int, int, int], str]], huge_pages: bool = True) -> list[torch.Tensor]:
    """Uninitialised panels for several weights, [(panels_shape, kind), ...], as views of one buffer, in
    the order given (each part starting at a multiple of ARENA_ALIGN bytes).

    Why one buffer: transparent huge pages back only whole, aligned 2 MiB ranges, so a weight allocated on
    its own smaller than 2 MiB (or its tail past the last 2 MiB) sat on 4 KiB pages: in the demo model
    that was qkv, o and down of every layer and part of gate_up, about 70 % of a layer's bytes, each 4 KiB
    page a TLB miss walked under the hypervisor. Measured on this project's 2-core VM, 2 threads reading
    the demo model's 121 bf16 linears in step order with a join after each: 36.4-40.0 GB/s from separate
    allocations, 43.3-47.9 GB/s from one buffer (the whole-buffer read probe: 44-49). A step reads the
    weights in this order too, so one thread's stream runs on from one weight into the next.
    `huge_pages`: see empty_huge. Each view's bytes are the part's exactly (no padding inside a view)."""
    offsets, total = [], 0
    for shape, kind in parts:
        offsets.append(total)
        nbytes = shape[0] * shape[1] * shape[2] * getattr(torch, kind).itemsize
        total += -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
    arena = empty_huge(max(total, 1), dtype=torch.int8, huge_pages=huge_pages)
    views = []
    for (shape, kind), start in zip(parts, offsets):
        dtype = getattr(torch, kind)
        nbytes = shape[0] * shape[1] * shape[2] * dtype.itemsize
        views.append(arena[start:start + nbytes].view(dtype).view(shape))
    return views


def pack_weight(weight: torch.Tensor, kind: str = "float32", huge_pages: bool = True,
                out: torch.Tensor | None = None) -> PackedWeight:
    """(out, in) CPU weight -> PackedWeight of `kind` (see PackedWeight; in huge-page memory, see
    empty_huge). float32 and bfloat16 round the weight to that dtype (exact when it is one already:
    a bf16 checkpoint is never widened); int8 quantizes it (quantize_int8). Holds one extra copy of
    the weight only while packing. `huge_pages`: see empty_huge. `out`: the panels' memory to write
    (panels_shape's shape in the kind's dtype: a view of panel_arena's buffer), instead of a new one.
    Raises: ValueError for an unknown kind or an `out` of the wrong shape or dtype.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out_features, in_features = weight.shape
    shape = panels_shape(out_features, in_features, kind)
    if out is not None and (tuple(out.shape) != shape or out.dtype != getattr(torch, kind)):
        raise ValueError(f"out must be {shape} {kind}, got {tuple(out.shape)} {out.dtype}")
    num_panels = shape[0]
    scale = None
    if kind == "int8":
        weight, scale = quantize_int8(weight)
    weight = weight.to(getattr(torch, kind))
    k_pad = in_features % 2 if kind == "bfloat16" else 0
    padded = torch.nn.functional.pad(weight, (0, k_pad, 0, num_panels * PANEL - out_features))
    rows = in_features + k_pad
    panels = out if out is not None else \
        empty_huge(*shape, dtype=weight.dtype, device=weight.device, huge_pages=huge_pages)
    if kind == "bfloat16":        # (P, PANEL, rows/2, 2) -> (P, rows/2, PANEL, 2)
        panels.view(num_panels, rows // 2, PANEL, 2).copy_(
            padded.view(num_panels, PANEL, rows // 2, 2).transpose(1, 2))
    else:
        panels.copy_(padded.view(num_panels, PANEL, rows).transpose(1, 2))
    return PackedWeight(panels=panels, out_features=out_features, in_features=in_features, scale=scale)
