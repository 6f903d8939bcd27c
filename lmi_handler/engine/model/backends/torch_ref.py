"""The reference backend: the backend interface's ops in pure PyTorch, on any device.

Every op computes a row from that row alone (linears over fixed 16-row tiles, attention one sequence at a
time over exactly its own context), so a sequence's bits do not depend on the rest of its step; reductions
run in float32. It is what forward.py runs where no faster backend fits (kernel_backend=torch, or auto with
neither the C++ kernels nor Triton), and what the other backends are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmi_handler.engine.model.attention import AttentionMetadata, gather_context
from lmi_handler.engine.model.linear import invariant_linear
from lmi_handler.engine.model.lora import LoraBatch
from lmi_handler.engine.model.moe import MoeWeights, expert_activation, grouped_experts
from lmi_handler.engine.model.quant.weight import QuantWeight
from lmi_handler.engine.model.spec import MoeSpec

NAME = "torch"


def decoder_stack(spec, layers, final_norm, num_heads: int, num_kv_heads: int) -> None:
    """No whole-stack operation here: forward.DecoderModel walks the layers op by op."""
    return None


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v (T, kv_heads, D) at their slots of the paged caches; a slot of -1 (padding) writes nothing."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention over the paged cache, in float32, one sequence at a time: row j of sequence i
    (absolute position p) attends to positions [max(0, p - window + 1), p]; softcap: scores = softcap *
    tanh(scores / softcap) before the softmax; sinks (H,): head h's learned logit joins each row's softmax as
    one more score whose weight is dropped (gpt-oss; transformers' eager_attention_forward: softmax over
    cat(scores, sink), the sink's column left out). q: (T, H, D) -> (T, H, D) in q's dtype."""
    out = torch.empty_like(q)
    tables = meta.block_tables.long()
    start = 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
        k = gather_context(k_cache, tables[i], ctx).float()             # (ctx, kvh, D)
        v = gather_context(v_cache, tables[i], ctx).float()
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)             # (H, ctx, D)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[start:start + n].float().transpose(0, 1)                   # (H, n, D)
        scores = (qi @ k.transpose(1, 2)) * scale                         # (H, n, ctx)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = sinks.float().to(q.device)[:, None, None].expand(-1, n, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out[start:start + n] = (probs @ v).transpose(0, 1).to(q.dtype)
        start += n
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (T, K) @ weight (N, K).T (+ bias) over zero-padded 16-row tiles (linear.invariant_linear), in x's
    dtype, then cast to `out_dtype` (default x's). A quant.QuantWeight is dequantized first (its float value, in x's
    dtype: the reference of the quantized kernels)."""
    if isinstance(weight, QuantWeight):
        weight = weight.dequantize(x.dtype).to(x.device)
    out = invariant_linear(x, weight, bias)
    return out if out_dtype is None else out.to(out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             weight_offset: float = 0.0, weight_in_float: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (or x); n = h * rsqrt(mean(h^2) + eps) in float32, over the last dimension; then
    weight_in_float: out = n * (weight_offset + weight) in float32, cast once to x's dtype (transformers'
    Gemma and OLMo-2 norms); else out = (weight_offset + weight) * n cast to x's dtype first, the product in
    that dtype (transformers' LlamaRMSNorm). The one description of the norm every backend's kernel is held
    to. Returns (out, h)."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_float:
        return (normed * (weight_offset + weight.float())).to(x.dtype), h
    w = weight if weight_offset == 0.0 else weight_offset + weight
    return (w * normed.to(x.dtype)).to(x.dtype), h


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos, sin (T, D) in transformers' rotate-half convention."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> act(gate) * up; act "silu" or "gelu_tanh"."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> gpt-oss's expert activation in gate_up's dtype, transformers' GptOssExperts'
    operations: gate clamped to <= limit, up to [-limit, limit], gate * sigmoid(gate * alpha) * (up + 1)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: MoeWeights,
                spec: MoeSpec | None = None) -> torch.Tensor:
    """A sparse layer's routed experts (moe.grouped_experts with this backend's linear and activation): token
    t's output is sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) in float32 in rank order k, rounded once to x's
    dtype; each expert's gate_up / down (with their biases where w has them) over its own rows; the activation
    spec.activation's (None: silu * up). x: (T, hidden); ids (T, K) int64; weights (T, K) float32 -> (T, hidden)."""
    return grouped_experts(x, ids, weights, w, linear, act_mul, expert_activation(spec, act_mul, clamped_swiglu))


def lora_add(y: torch.Tensor, x: torch.Tensor, lora: LoraBatch, layer: int, module: str,
             num_layers: int) -> torch.Tensor:
    """y + the step's LoRA term of projection `module` of `layer` (LoraBatch.add: its tiled product, each row
    against its own adapter); y unchanged when no adapter of the step has that projection. x: (T, in) the
    projection's input, y: (T, out) its output."""
    return lora.add(y, x, layer, module)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(S, V) -> (S,) int64: the argmax, the lowest index on ties."""
    return logits.argmax(-1)
