"""Packed weight panels for the C++ row-invariant linear (float32, bfloat16, int8) and the wrappers
that call the kernels.

Owns the panel layouts and int8 quantization: `pack_weight` is a function of one (out, in) weight
tensor, so any slice of a weight (a tensor-parallel shard) packs the same way. Leaves building the
extension to build.py and its references to reference.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmi_handler.engine.model.kernels.build import PANEL, bf16_dot_form, built_kernels, cpu_kernels, empty_huge

KINDS = ("float32", "bfloat16", "int8")   # packed weight kinds: the panels' dtype names them


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight (out_features, in_features) repacked for `packed_linear`.

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
