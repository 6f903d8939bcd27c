"""Each checkpoint format's tensors of one linear read into weight.Codes (the codes, zeros and scales in the
checkpoint's own k order), following each quantizer's published packing:

- GPTQ (AutoGPTQ / GPTQModel): qweight int32 (K / f, N), f = 32 / bits codes per word along k, code j of a word
  at bits [bits j, bits (j + 1)); qzeros int32 (G, N / f) packed the same way along n, holding zero - 1 in the
  v1 format (checkpoint_format "gptq": AutoGPTQ adds the 1 back when it reads them, so a stored 0 nibble reads
  as zero point 16, as there) and the zero itself in v2; scales (G, N) fp16; g_idx (K,) the group of each input
  column (act order, desc_act); sym checkpoints store zero 2^(bits-1) like any other.
- AWQ GEMM (AutoAWQ WQLinear_GEMM): qweight int32 (K, N / 8) packed along n, the 8 nibbles of a word holding
  columns 0 2 4 6 1 3 5 7 of its eight (in that order, low bits first); qzeros (G, N / 8) the same; scales (G, N).
- compressed-tensors pack-quantized: weight_packed int32 (N, K / f) packed along k low bits first, each code the
  signed value + 2^(bits-1) (so a zero point of 2^(bits-1)); weight_scale (N, G) (channel: G = 1);
  weight_shape (2,) = (N, K); asymmetric: weight_zero_point, the signed zero + 2^(bits-1) packed the same way
  along n (int32 (N / f, G)); weight_g_idx (K,) where the quantizer reordered columns (actorder).
- compressed-tensors int-quantized (W8A8's weights): weight int8 (N, K) signed; weight_scale (N, 1) channel,
  (N, G) group or (1,) tensor; weight_zero_point int8 of the scale's shape where asymmetric. Its activation
  tensors (input_scale, input_zero_point: static activations) are dropped: weight-only (docs/quantization.md).

FP8 (e4m3) weights are read by fp8.py, gpt-oss's MXFP4 experts by mxfp4.py. Leaves detection to config.py and
the kernel's layout to weight.py.
"""
from __future__ import annotations

import torch

from lmi_handler.engine.model.quant.config import QuantConfig
from lmi_handler.engine.model.quant.weight import Codes

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # nibble i of a word holds column AWQ_ORDER[i] of its eight
AWQ_REVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits codes each, low bits first, along `dim` -> uint8 codes (that dim f times
    longer)."""
    f = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).unsqueeze(-1)                    # (..., f) after the shift
    codes = (words >> shifts) & ((1 << bits) - 1)
    if dim == 0:                                                    # (R, C, f) -> (R, f, C) -> (R f, C)
        return codes.permute(0, 2, 1).reshape(-1, packed.shape[1]).to(torch.uint8)
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


def _pop(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise KeyError(f"weights missing from the checkpoint: [{name!r}]")
    return hf.pop(name)


def read_gptq(hf: dict[str, torch.Tensor], prefix: str, q: QuantConfig) -> Codes:
    codes = unpack_int32(_pop(hf, prefix + ".qweight"), q.bits, 0).T.contiguous()        # (N, K)
    n, k = codes.shape
    zeros = unpack_int32(_pop(hf, prefix + ".qzeros"), q.bits, 1)[:, :n].float() + q.zero_offset
    scales = _pop(hf, prefix + ".scales").float()
    g_idx = hf.pop(prefix + ".g_idx", None)
    group = k if q.group_size == -1 else q.group_size
    return Codes(codes, zeros, scales, group, q.bits, None if g_idx is None else g_idx.long())


def read_awq(hf: dict[str, torch.Tensor], prefix: str, q: QuantConfig) -> Codes:
    def columns(t: torch.Tensor) -> torch.Tensor:          # (R, N / 8) words -> (R, N) codes in column order
        nib = unpack_int32(t, 4, 1).view(t.shape[0], -1, 8)
        return nib[..., list(AWQ_REVERSE)].reshape(t.shape[0], -1)

    codes = columns(_pop(hf, prefix + ".qweight")).T.contiguous()                          # (N, K)
    zeros = columns(_pop(hf, prefix + ".qzeros")).float()
    scales = _pop(hf, prefix + ".scales").float()
    k = codes.shape[1]
    return Codes(codes, zeros, scales, k if q.group_size == -1 else q.group_size, q.bits)


def group_scales(scale: torch.Tensor, n: int) -> torch.Tensor:
    """compressed-tensors' weight_scale ((N, G), (N, 1) or one value per tensor) as (G, N) float32."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(1, n).contiguous()
    return scale.reshape(n, -1).T.contiguous()


def drop_activation_tensors(hf: dict[str, torch.Tensor], prefix: str) -> None:
    """Drop a linear's static activation quantization tensors: the engine's linears are weight-only."""
    for name in ("input_scale", "input_zero_point", "activation_scale", "output_scale", "output_zero_point"):
        hf.pop(f"{prefix}.{name}", None)


def read_compressed(hf: dict[str, torch.Tensor], prefix: str, q: QuantConfig) -> Codes:
    shape = hf.pop(prefix + ".weight_shape", None)
    codes = unpack_int32(_pop(hf, prefix + ".weight_packed"), q.bits, 1)
    if shape is not None:
        n, k = (int(v) for v in shape.tolist())
        codes = codes[:n, :k]
    codes = codes.contiguous()
    n, k = codes.shape
    scales = group_scales(_pop(hf, prefix + ".weight_scale"), n)                             # (G, N)
    half = float(1 << (q.bits - 1))
    zero = hf.pop(prefix + ".weight_zero_point", None)
    if zero is None:
        zeros = torch.full_like(scales, half)
    elif zero.dtype == torch.int32:                      # packed along n (group and channel strategies)
        zeros = unpack_int32(zero, q.bits, 0)[:n].float().T.contiguous()
    else:                                                # one signed value per tensor
        zeros = group_scales(zero, n) + half
    g_idx = hf.pop(prefix + ".weight_g_idx", None)
    return Codes(codes, zeros, scales, k if q.group_size == -1 else q.group_size, q.bits,
                 None if g_idx is None else g_idx.long())


def read_compressed_int(hf: dict[str, torch.Tensor], prefix: str, q: QuantConfig) -> Codes:
    weight = _pop(hf, prefix + ".weight")
    if weight.dtype != torch.int8:
        raise ValueError(f"{prefix}.weight: int-quantized weights must be int8, got {weight.dtype}")
    n, k = weight.shape
    codes = (weight.to(torch.int16) + 128).to(torch.uint8)
    scales = group_scales(_pop(hf, prefix + ".weight_scale"), n)
    zero = hf.pop(prefix + ".weight_zero_point", None)
    zeros = torch.full_like(scales, 128.0) if zero is None else group_scales(zero, n) + 128
    drop_activation_tensors(hf, prefix)
    return Codes(codes, zeros, scales, k if q.group_size == -1 else q.group_size, 8)



READERS = {"gptq": read_gptq, "awq": read_awq, "compressed-tensors": read_compressed,
           "compressed-tensors/int-quantized": read_compressed_int}      # QuantConfig.reader -> reader (fp8.py: more)
