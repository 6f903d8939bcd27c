"""Tiny Llamas saved as each quantizer writes its checkpoints, for the quantized-weight tests: the packers below
follow each format's published layout (AutoGPTQ's QuantLinear.pack, AutoAWQ's WQLinear_GEMM.from_linear,
compressed-tensors' pack_to_int32 and its naive int / float compressors, DeepSeek-V3's / transformers'
FineGrainedFP8 block scales), written here from those descriptions (no quantization library imported).

Each packer quantizes a float weight by round to nearest on its format's grid and returns the checkpoint's
tensors for that module and the float weight they stand for ((code - zero) * scale, float32); build_quantized
writes a tiny Llama whose layer linears are packed so, and returns transformers' model holding those float
weights (the model whose greedy tokens ours must equal)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.engine.helpers import build_tiny_llama

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# module -> which input it reads (q/k/v share one, gate/up one): GPTQ's act order is the same for modules that
# share their input (one Hessian), as a fused weight needs
LINEAR_INPUTS = {"self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0, "self_attn.o_proj": 1,
                 "mlp.gate_proj": 2, "mlp.up_proj": 2, "mlp.down_proj": 3}


def pack_words(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint codes -> int32 words of 32 / bits codes along `dim`, code j of a word at bits [bits j, bits (j+1))."""
    f = 32 // bits
    c = codes.to(torch.int64)
    c = c.T if dim == 0 else c
    c = c.reshape(c.shape[0], -1, f)
    words = (c << (torch.arange(f) * bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.T.contiguous() if dim == 0 else words.contiguous()


def _groups(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool, bits: int):
    """Per (group, output row): (scale fp16-exact, zero) on the GPTQ / AWQ grid (zeros kept in [1, maxq]: a
    v1 checkpoint cannot hold zero point 0, see quant/formats.py)."""
    maxq = (1 << bits) - 1
    scales, zeros = torch.empty(groups, w.shape[0]), torch.empty(groups, w.shape[0])
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            scale = torch.maximum(-lo, hi) * 2 / maxq
            zero = torch.full_like(scale, (maxq + 1) / 2)
        else:
            scale = (hi - lo) / maxq
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).half().float()
        if not sym:
            zero = torch.round(-lo / scale).clamp(1, maxq)
        scales[g], zeros[g] = scale, zero
    return scales, zeros


def gptq_module(w: torch.Tensor, bits: int = 4, group_size: int = 32, sym: bool = True, desc_act: bool = False,
                v1: bool = True, seed: int = 0):
    """GPTQ tensors (qweight, qzeros, scales, g_idx) of (N, K) float weight w, and the float weight they hold.
    desc_act: the columns grouped in a random order (standing in for GPTQ's Hessian order)."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // gs
    groups = -(-k // gs)
    scales, zeros = _groups(w, g_idx, groups, sym, bits)
    q = (torch.round(w / scales[g_idx].T) + zeros[g_idx].T).clamp(0, (1 << bits) - 1)
    dequant = (q - zeros[g_idx].T) * scales[g_idx].T
    stored = (zeros.to(torch.int64) - (1 if v1 else 0)) & ((1 << bits) - 1)
    tensors = {"qweight": pack_words(q.T.contiguous(), bits, 0), "qzeros": pack_words(stored, bits, 1),
               "scales": scales.half(), "g_idx": g_idx.to(torch.int32)}
    return tensors, dequant


def awq_module(w: torch.Tensor, group_size: int = 32):
    """AWQ GEMM tensors (qweight (K, N/8), qzeros, scales) of w (N, K), 4 bits with zero points, and its value."""
    n, k = w.shape
    g_idx = torch.arange(k) // group_size
    scales, zeros = _groups(w, g_idx, k // group_size, False, 4)
    q = (torch.round(w / scales[g_idx].T) + zeros[g_idx].T).clamp(0, 15)
    dequant = (q - zeros[g_idx].T) * scales[g_idx].T

    def pack(cols: torch.Tensor) -> torch.Tensor:       # (R, N) -> (R, N / 8): nibble i holds column AWQ_ORDER[i]
        c = cols.to(torch.int64).reshape(cols.shape[0], -1, 8)[..., list(AWQ_ORDER)]
        return pack_words(c.reshape(cols.shape[0], -1), 4, 1)

    return {"qweight": pack(q.T.contiguous()), "qzeros": pack(zeros), "scales": scales.half()}, dequant


def _ct_int(w: torch.Tensor, bits: int, gs: int, sym: bool):
    """compressed-tensors' int grid: signed q in [-2^(bits-1), 2^(bits-1)), (N, G) bf16 scales and signed zeros."""
    n, k = w.shape
    half = 1 << (bits - 1)
    g = w.view(n, k // gs, gs)
    if sym:
        scale, zero = g.abs().amax(-1) / (half - 1), torch.zeros(n, k // gs)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (hi - lo) / (2 * half - 1)
    scale = scale.clamp(min=1e-4).to(torch.bfloat16).float()                                 # (N, G)
    if not sym:
        zero = (-half - torch.round(lo / scale)).clamp(-half, half - 1)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(-half, half - 1)
    dequant = ((q - zero[..., None]) * scale[..., None]).view(n, k)
    return q.view(n, k), scale, zero, dequant


def compressed_module(w: torch.Tensor, bits: int = 4, group_size: int | None = 32, sym: bool = True):
    """compressed-tensors pack-quantized tensors (weight_packed (N, K / f), weight_scale (N, G) bf16,
    weight_shape; asymmetric: weight_zero_point packed along N, (N / f, G)) of w, group_size None: per channel;
    and its value."""
    n, k = w.shape
    half = 1 << (bits - 1)
    q, scale, zero, dequant = _ct_int(w, bits, group_size or k, sym)
    packed = pack_words((q + half).to(torch.int64), bits, 1)
    tensors = {"weight_packed": packed, "weight_scale": scale.to(torch.bfloat16), "weight_shape": torch.tensor([n, k])}
    if not sym:
        tensors["weight_zero_point"] = pack_words((zero + half).to(torch.int64), bits, 0)
    return tensors, dequant


def compressed_int_module(w: torch.Tensor, sym: bool = True):
    """compressed-tensors int-quantized (W8A8's weights: int8 (N, K), weight_scale (N, 1) bf16 per channel,
    asymmetric: weight_zero_point int8 (N, 1); input_scale of static activations, which the engine drops)."""
    q, scale, zero, dequant = _ct_int(w, 8, w.shape[1], sym)
    tensors = {"weight": q.to(torch.int8), "weight_scale": scale.to(torch.bfloat16)}
    if not sym:
        tensors["weight_zero_point"] = zero.to(torch.int8)
    return tensors, dequant


def fp8_module(w: torch.Tensor, block: tuple[int, int] | None = (32, 32), scale_name: str = "weight_scale_inv",
               channel: bool = False):
    """e4m3 weight (N, K) and its float32 scales: one per (bn, bk) block (DeepSeek-V3 / Qwen3-FP8's
    weight_scale_inv, the weight is fp8 * scale), per output channel ((N, 1), compressed-tensors) or one per
    tensor; each scale amax / 448. Returns the tensors and the float weight they hold."""
    n, k = w.shape
    bn, bk = block or ((1, k) if channel else (n, k))
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    scale = (padded.abs().amax((1, 3)) / 448).clamp(min=1e-6)                               # (nb, kb)
    full = scale[:, None, :, None].expand(nb, bn, kb, bk).reshape(nb * bn, kb * bk)[:n, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    dequant = q.float() * full
    if block is None:
        scale = scale.reshape(n, 1) if channel else scale.reshape(1)
    return {"weight": q, scale_name: scale}, dequant


def _compressed(w: torch.Tensor, fmt: str = "pack-quantized", bits: int = 4, group_size: int | None = 32,
                sym: bool = True, block: tuple[int, int] | None = None, channel: bool = False):
    if fmt == "float-quantized":
        return fp8_module(w, block, "weight_scale", channel)
    if fmt == "int-quantized":
        return compressed_int_module(w, sym)
    return compressed_module(w, bits, group_size, sym)


def quant_config(method: str, **kw) -> dict:
    """config.json's quantization_config as each quantizer writes it."""
    if method == "gptq":
        return {"quant_method": "gptq", "bits": kw.get("bits", 4), "group_size": kw.get("group_size", 32),
                "sym": kw.get("sym", True), "desc_act": kw.get("desc_act", False),
                "checkpoint_format": "gptq" if kw.get("v1", True) else "gptq_v2"}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": kw.get("group_size", 32), "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(kw["block"]) if kw.get("block") else None, "modules_to_not_convert": None}
    fmt, kind, acts = kw.get("fmt", "pack-quantized"), "int", None
    strategy = "group" if kw.get("group_size", 32) else "channel"
    if fmt == "float-quantized":        # FP8 W8A8 (dynamic per-token fp8 activations)
        kind, strategy = "float", "block" if kw.get("block") else "channel" if kw.get("channel") else "tensor"
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    elif fmt == "int-quantized":        # W8A8 (dynamic per-token int8 activations)
        strategy, acts = "channel", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                     "dynamic": True}
    weights = {"num_bits": kw.get("bits", 8 if fmt != "pack-quantized" else 4), "type": kind,
               "symmetric": kw.get("sym", True), "strategy": strategy, "dynamic": False,
               "group_size": kw.get("group_size", 32) if strategy == "group" else None,
               "block_structure": list(kw["block"]) if kw.get("block") else None}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts,
                                          "output_activations": None, "weights": weights}},
            "ignore": ["lm_head"]}


def build_quantized(path: Path, method: str, seed: int = 0, **kw):
    """A tiny Llama (tests.engine.helpers.build_tiny_llama, untied) written to `path` with its layer linears in
    `method`'s format ("gptq", "awq", "compressed-tensors", "fp8"; kw: bits, group_size, sym, desc_act, v1;
    compressed-tensors fmt (pack-quantized, int-quantized, float-quantized); fp8 and float-quantized block,
    channel). Returns the transformers model whose linears hold the dequantized weights."""
    hf = build_tiny_llama(path, seed=seed, tie_word_embeddings=False)
    tensors = {}
    state = hf.state_dict()
    with torch.no_grad():
        for i in range(hf.config.num_hidden_layers):
            for module, j in LINEAR_INPUTS.items():
                prefix = f"model.layers.{i}.{module}"
                w = state.pop(prefix + ".weight")
                if method == "gptq":
                    packed, dequant = gptq_module(w, seed=seed + 4 * i + j, **kw)
                elif method == "awq":
                    packed, dequant = awq_module(w, kw.get("group_size", 32))
                elif method == "fp8":
                    packed, dequant = fp8_module(w, kw.get("block"))
                else:
                    packed, dequant = _compressed(w, **kw)
                tensors.update({f"{prefix}.{name}": t for name, t in packed.items()})
                hf.get_submodule(prefix).weight.copy_(dequant)
    tensors.update({name: t.contiguous() for name, t in state.items()})
    (path / "model.safetensors").unlink()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant_config(method, **kw)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf
