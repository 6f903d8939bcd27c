"""The references the Triton kernel tests compare against. Where the op is the same, it is the reference
backend's own (backends/torch_ref.py: store_kv, log_softmax, greedy); attention, linear and the row-wise ops
are recomputed here in float64 straight from the definitions in backends/__init__.py, stricter than
torch_ref's float32 (test_triton.py checks that torch_ref agrees with them)."""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from lmi_handler.engine.model.attention import AttentionMetadata
from lmi_handler.engine.model.backends import torch_ref

store_kv, log_softmax, greedy = torch_ref.store_kv, torch_ref.log_softmax, torch_ref.greedy


def make_meta(seqs: list[tuple[int, int]], block_tables: list[list[int]], block_size: int,
              device: torch.device) -> AttentionMetadata:
    """AttentionMetadata for sequences given as (context_len, query_len), with their block tables."""
    query_lens = [q for _, q in seqs]
    context_lens = [c for c, _ in seqs]
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    cu = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    slots = [tables[i, p // block_size].item() * block_size + p % block_size
             for i, (c, q) in enumerate(seqs) for p in range(c - q, c)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device), cu_seqlens_q=cu.to(device),
        query_lens=query_lens, context_lens_host=context_lens, block_size=block_size)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale, window=None, softcap=None, sinks=None):
    """Row by row: gather the row's keys [max(0, p - window + 1), p] and attend in float64; q's dtype out.
    sinks (H,): each head's logit joins the softmax, its weight dropped (gpt-oss)."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    row = 0
    for i, (context_len, query_len) in enumerate(zip(meta.context_lens_host, meta.query_lens)):
        table = meta.block_tables[i].long()
        slots = table[torch.arange(context_len) // block_size] * block_size + torch.arange(context_len) % block_size
        k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double().repeat_interleave(group, dim=1)
        v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double().repeat_interleave(group, dim=1)
        for j in range(query_len):
            p = context_len - query_len + j
            lo = 0 if window is None else max(0, p - window + 1)
            scores = torch.einsum("hd,khd->hk", q[row].double(), k[lo:p + 1]) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is None:
                probs = scores.softmax(-1)
            else:
                probs = torch.cat([scores, sinks.double()[:, None]], dim=-1).softmax(-1)[:, :-1]
            out[row] = torch.einsum("hk,khd->hd", probs, v[lo:p + 1]).to(q.dtype)
            row += 1
    return out


def linear(x, weight, bias=None):
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(x.dtype)


def rms_norm(x, weight, eps, residual=None, weight_offset=0.0, weight_in_float=True):
    h = x if residual is None else x + residual
    hf = h.double()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if not weight_in_float:                  # LlamaRMSNorm: the normalized row rounded to x's dtype first
        normed = normed.to(x.dtype).double()
    return (normed * (weight_offset + weight.double())).to(x.dtype), h


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    xd = x.double()
    rotated = torch.cat([-xd[..., half:], xd[..., :half]], dim=-1)
    return (xd * cos.double()[:, None] + rotated * sin.double()[:, None]).to(x.dtype)


def act_mul(gate_up, act):
    gate, up = gate_up.double().chunk(2, dim=-1)
    a = F.silu(gate) if act == "silu" else 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) *
                                                                        (gate + 0.044715 * gate ** 3)))
    return (a * up).to(gate_up.dtype)


def kernel_dtypes() -> list[torch.dtype]:
    """float32 and float16 everywhere; bfloat16 too where the kernels run compiled on a GPU (the interpreter
    mis-computes bfloat16 arithmetic)."""
    compiled = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    return [torch.float32, torch.float16] + ([torch.bfloat16] if compiled else [])
