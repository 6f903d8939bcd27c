"""Weight codes (integers, or FP8 e4m3 bytes) with group scales and zero points, and their packed form for the
C++ kernel.

Owns `Codes` (what every checkpoint format is read into: one linear's codes, zeros, scales, group size and
act-order groups, in the checkpoint's own k order), `QuantWeight` (the kernel's layout, kernels/linear_quant.h,
made once at load) and the one definition of a quantized weight's float value, `dequantize`. Leaves reading
each format to gptq.py, awq.py and compressed.py, and calling the kernel to backends/cpp.py.

The value of weight element (n, k) is (value(code) - zero[g, n]) * scale[g, n] in float32, g = k's group, where
value(code) is the integer code itself (fmt "int") or, for FP8 (fmt "e4m3"), the number its float8 e4m3fn byte
holds (e4m3_values(), exact in float32; zero 0), for MXFP4 (fmt "e2m1") its E2M1_VALUES entry: the subtraction is exact and the product one rounding (exact for fp16 / bf16 scales and codes
below 2^8), so dequantize() is the float model a quantized checkpoint stands for, and every backend computes from
it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from lmi_handler.engine.model.kernels.build import PANEL, built_kernels, cpu_kernels

BITS = (4, 8)
FMTS = {"int": 0, "e4m3": 1, "e2m1": 2}          # what a code is -> the kernel's CodeFmt (linear_quant.h)
# an e2m1 code's value (OCP MX, MXFP4's elements: bit 3 the sign, bits 0-2 the magnitude); linear_quant.h's copy
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@lru_cache(maxsize=1)
def e4m3_values() -> torch.Tensor:
    """(256,) float32: the float8_e4m3fn number each byte holds (bytes 0x7f and 0xff: NaN), exactly."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def code_values(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 codes -> float32 values (exact): the integer itself (fmt "int"), the e4m3 number (fmt "e4m3") or the
    e2m1 one (fmt "e2m1": E2M1_VALUES)."""
    if fmt == "e2m1":
        return torch.tensor(E2M1_VALUES)[codes.long()]
    return codes.float() if fmt == "int" else e4m3_values()[codes.long()]


@dataclass(frozen=True)
class Codes:
    """One linear's integer weight, as read from a checkpoint (any format).

    codes: (N, K) uint8 in [0, 2^bits); zeros, scales: (G, N) float32, G = ceil(K / group_size);
    g_idx: (K,) int64 group of each input column (GPTQ's act order), None for k // group_size;
    fmt: "int" (the codes are integers), "e4m3" (float8 e4m3fn bytes, bits 8, zeros 0: FP8 checkpoints) or "e2m1"
    (e2m1 nibbles, bits 4, zeros 0: MXFP4 experts, quant/mxfp4.py)."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    bits: int
    g_idx: torch.Tensor | None = None
    fmt: str = "int"

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32: (value(codes) - zeros[g]) * scales[g] for each column's group g."""
        k = self.codes.shape[1]
        g = self.g_idx if self.g_idx is not None else torch.arange(k) // self.group_size
        return (code_values(self.codes, self.fmt) - self.zeros[g].T) * self.scales[g].T


def concat(parts: list[Codes]) -> Codes:
    """The row concatenation of several linears' codes (q/k/v, gate/up: one fused weight). Raises ValueError
    where their group sizes, bits, act-order groups or code formats differ (a fused weight has one k order)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for p in parts[1:]:
        same_g = (p.g_idx is None) == (first.g_idx is None) and (p.g_idx is None or torch.equal(p.g_idx, first.g_idx))
        if p.group_size != first.group_size or p.bits != first.bits or not same_g or p.fmt != first.fmt:
            raise ValueError("fused projections (q/k/v or gate/up) must share bits, group size, g_idx and code format")
    return Codes(torch.cat([p.codes for p in parts]), torch.cat([p.zeros for p in parts], dim=1),
                 torch.cat([p.scales for p in parts], dim=1), first.group_size, first.bits, first.g_idx, first.fmt)


@dataclass(frozen=True)
class QuantWeight:
    """A linear's codes in the C++ kernel's layout (kernels/linear_quant.h), made once at load.

    panels: uint8 (P, K, PANEL / 2) for 4 bits (byte b of panel row k: column b low nibble, column b + PANEL / 2
    high), (P, K, PANEL) for 8; scales, zeros: (G, P * PANEL) float32 (padding columns 0); perm: (K,) int64, the
    kernel's k order (x's columns are taken as x[:, perm]) where act order groups the columns out of order, else
    None; fmt: Codes.fmt ("int", or "e4m3" for FP8 bytes). The kernel's k-th column is the checkpoint's column
    perm[k]; its group is k // group_size."""

    panels: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    bits: int
    out_features: int
    in_features: int
    perm: torch.Tensor | None = None
    fmt: str = "int"

    @property
    def kind(self) -> str:
        return f"{'int' if self.fmt == 'int' else 'fp'}{self.bits}_g{self.group_size}"

    @property
    def nbytes(self) -> int:
        """Bytes one pass over the weight reads (codes, scales and zeros)."""
        return sum(t.numel() * t.element_size() for t in (self.panels, self.scales, self.zeros))

    def codes(self) -> torch.Tensor:
        """(N, K) uint8 codes in the kernel's k order."""
        p, k = self.panels.shape[:2]
        if self.bits == 4:
            lo, hi = self.panels & 15, self.panels >> 4
            cols = torch.cat([lo, hi], dim=2)                       # (P, K, PANEL)
        else:
            cols = self.panels
        return cols.transpose(1, 2).reshape(p * PANEL, k)[:self.out_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) float weight in the checkpoint's k order (Codes.dequantize's values), in `dtype`."""
        n = self.out_features
        g = torch.arange(self.in_features) // self.group_size
        w = (code_values(self.codes(), self.fmt) - self.zeros[g, :n].T) * self.scales[g, :n].T
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def permute_input(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) in the kernel's k order (exact copies)."""
        return x if self.perm is None else x.index_select(1, self.perm)


def pack_codes(codes: Codes) -> QuantWeight:
    """Codes -> QuantWeight (see there). Act order (g_idx not k // group_size) becomes a permutation of k that
    makes each group contiguous. Raises ValueError for bits outside BITS, or act-order groups of unequal size."""
    if codes.bits not in BITS:
        raise ValueError(f"{codes.bits}-bit weights are not supported (supported: {list(BITS)})")
    n, k = codes.codes.shape
    gs = codes.group_size
    q, perm = codes.codes, None
    natural = torch.arange(k) // gs
    if codes.g_idx is not None and not torch.equal(codes.g_idx.long(), natural):
        perm = torch.argsort(codes.g_idx.long(), stable=True)
        if not torch.equal(codes.g_idx.long()[perm], natural):
            raise ValueError(f"g_idx does not hold {gs} columns per group (act-order groups must be equal)")
        q = q[:, perm]
    p = -(-n // PANEL)
    q = torch.nn.functional.pad(q, (0, 0, 0, p * PANEL - n)).view(p, PANEL, k).transpose(1, 2)   # (P, K, PANEL)
    if codes.bits == 4:
        half = PANEL // 2
        panels = (q[..., :half] | (q[..., half:] << 4)).contiguous()
    else:
        panels = q.contiguous()

    def cols(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t.float(), (0, p * PANEL - n)).contiguous()

    return QuantWeight(panels, cols(codes.scales), cols(codes.zeros), gs, codes.bits, n, k, perm, codes.fmt)


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (M, K) float32 or bfloat16 CPU @ W.T (+ bias) through kernels/linear_quant.h: bitwise the float32 packed
    linear over weight.dequantize() (columns in the kernel's k order), each row alone. -> (M, N) in `out_dtype`
    (default x's dtype)."""
    out_dtype = out_dtype or x.dtype
    module = built_kernels() or cpu_kernels()
    return module.quant_linear(weight.permute_input(x).contiguous(), weight.panels, weight.out_features,
                               weight.scales, weight.zeros, weight.group_size, weight.bits, bias,
                               out_dtype == torch.bfloat16, FMTS[weight.fmt])
