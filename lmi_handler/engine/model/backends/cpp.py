"""The C++ ops backend: the backend interface's ops on the C++ CPU kernels (engine/model/kernels), for
forward.DecoderModel, so that every family runs on them (llama.py's fused stack runs the plain Llama specs).

Owns the mapping of each op to its kernel and the packing of the linears' weights at load (pack_linear: one
PackedWeight of float32, bfloat16 or int8 panels per weight, made once); leaves the kernels to kernels/
(linear.h's row-invariant packed linear, attention.h's paged attention with its window and score cap,
families.h's norm with the weight offset, rope and GELU-tanh * up, rowwise.h's silu * up) and what to call
when to forward.py. Every op computes a row from that row alone, by construction of its kernel, so a
sequence's bits do not depend on the rest of its step. Activations float32 or bfloat16 on CPU.
"""
from __future__ import annotations

import torch

from lmi_handler.engine.model.attention import AttentionMetadata
from lmi_handler.engine.model.backends import torch_ref
from lmi_handler.engine.model.kernels import PackedWeight, cpu_kernels, pack_weight, packed_linear, row_argmax

NAME = "cpp"
lora_add = None     # no LoRA kernel of its own here: forward.py adds LoraBatch.add's tiled product
lora_stack = None

store_kv = torch_ref.store_kv           # index copies: exact, nothing to gain in C++
log_softmax = torch_ref.log_softmax


def pack_linear(weight: torch.Tensor, kind: str) -> PackedWeight:
    """The checkpoint's (out, in) weight as `kind` panels ("float32", "bfloat16" or "int8": quantized from the
    checkpoint's own values, per output channel), made once at load (loader.load_decoder)."""
    return pack_weight(weight, kind)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """attention.h's paged attention (keys walked block by block from the window's first block, online
    softmax in float32; bf16 rounds the softmax weights as torch's CPU flash attention does), with the window
    and Gemma 2's score cap. q: (T, H, D) -> (T, H, D) in q's dtype."""
    return cpu_kernels().paged_attention_masked(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                meta.cu_seqlens_q, scale, window or 0, softcap or 0.0)


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, K) @ W.T (+ bias) over the packed panels (linear.h: one fixed chain of float32 operations per
    output whatever T is) -> (T, N) in x's dtype."""
    return packed_linear(x.contiguous(), weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (or x); out = h * rsqrt(mean(h^2) + eps) * (weight_offset + weight), all in float32
    (the offset added to the weight in float32, as transformers' Gemma does), cast to x's dtype. Returns
    (out, h)."""
    return cpu_kernels().rms_norm_offset(x, residual, weight, eps, weight_offset)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos, sin (T, D), rotate-half (torch_ref.rope's operations and roundings)."""
    return cpu_kernels().rope(x, cos, sin)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> act(gate) * up; act "silu" (rowwise.h) or "gelu_tanh" (families.h)."""
    kernels = cpu_kernels()
    gate_up = gate_up.contiguous()
    return kernels.silu_mul(gate_up) if act == "silu" else kernels.gelu_tanh_mul(gate_up)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(S, V) -> (S,) int64: the argmax, the lowest index on ties."""
    return row_argmax(logits.float())
