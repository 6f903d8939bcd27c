"""A sparse layer's MLP as its MoeSpec describes it: the router, the routed experts and Qwen2-MoE's gated
shared expert.

Owns MoeWeights (a sparse layer's tensors by role), the routing rule (route: top-k with the softmax before or
after it, norm_topk_prob) and the combination of the experts with the shared expert (moe_mlp); leaves the
experts' arithmetic to the backend's moe_experts op (backends/torch_ref.py is its definition), the layer walk
to forward.py and reading the tensors to loader.py. Every step is row-wise (a token's router logits, its
top-k, its experts' rows, its sum over its ranks), so a token's bits never depend on the rest of its step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmi_handler.engine.model.spec import MoeSpec


@dataclass
class MoeWeights:
    """A sparse layer's weights (a backend's packed form where it packs linears: kernels.PackedWeight on cpp).

    router: (num_experts, hidden); gate_up[e]: expert e's cat(gate, up) rows (2I, hidden); down[e]: (hidden,
    I); gate_up_bias[e] (2I,) / down_bias[e] (hidden,): gpt-oss's expert biases, None without; shared_*:
    Qwen2-MoE's shared expert (gate_up (2S, hidden), down (hidden, S)) and its gate (1, hidden), None without
    one. `prepared`: what a backend made of the experts once (the cpp backend's panel lists)."""

    router: object
    gate_up: list
    down: list
    router_bias: torch.Tensor | None = None
    shared_gate_up: object | None = None
    shared_down: object | None = None
    shared_gate: object | None = None
    gate_up_bias: list | None = None
    down_bias: list | None = None
    prepared: object | None = None


def route(logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights from its router logits (T, E) float32 -> (ids (T, K) int64,
    weights (T, K) float32), ranks in descending score order (torch.topk's).

    softmax_topk (transformers' MixtralTopKRouter / Qwen2MoeTopKRouter): softmax over all E in float32, the
    top k probabilities, divided by their sum when norm_topk_prob. topk_softmax (GraniteMoeTopKRouter,
    GptOssTopKRouter): the top k logits, then a softmax over those k."""
    if spec.routing == "topk_softmax":
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return ids, top.softmax(-1)
    top, ids = torch.topk(logits.softmax(-1), spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return ids, top


def moe_mlp(h: torch.Tensor, w: MoeWeights, spec: MoeSpec, ops) -> torch.Tensor:
    """The sparse MLP of h (T, hidden) -> (T, hidden) in h's dtype: router logits in float32 (the backend's
    linear writing its accumulators), route(), the experts through ops.moe_experts (each token's outputs summed
    in its rank order), plus sigmoid(shared_gate(h)) * shared_expert(h) where the layer has one (Qwen2-MoE)."""
    logits = ops.linear(h, w.router, w.router_bias, torch.float32)          # (T, E) float32
    ids, weights = route(logits, spec)
    out = ops.moe_experts(h, ids, weights, w, spec)
    if w.shared_gate_up is None:
        return out
    shared = ops.linear(ops.act_mul(ops.linear(h, w.shared_gate_up), "silu"), w.shared_down)
    gate = rowwise_sigmoid(ops.linear(h, w.shared_gate, None, torch.float32))  # (T, 1) float32
    return (out.float() + gate * shared.float()).to(h.dtype)


SIGMOID_WIDTH = 16   # floats per row of rowwise_sigmoid's input: whole AVX-512 (and AVX2) vectors


def rowwise_sigmoid(g: torch.Tensor) -> torch.Tensor:
    """sigmoid of a (T, 1) float32 column with each row's bits independent of T. torch's CPU sigmoid runs
    vector lanes over the contiguous elements and a scalar loop over the tail, and the two differ in the last
    bit: a (T, 1) column puts a row in the tail or not by its place in the batch (seen: Qwen2-MoE's shared
    expert gate, 1e-6 apart alone and batched). Each row is widened to SIGMOID_WIDTH copies, so every
    element sits in a whole vector."""
    return torch.sigmoid(g.expand(-1, SIGMOID_WIDTH).contiguous())[:, :1]


def combine_ranks(outs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_k weights[:, k] * outs[:, k] in float32, added in rank order k = 0, 1, ... (never by expert or by
    arrival), rounded once to `dtype`. outs: (T, K, hidden) the experts' outputs; weights (T, K) float32."""
    acc = outs[:, 0].float() * weights[:, :1]
    for k in range(1, outs.shape[1]):
        acc = acc + outs[:, k].float() * weights[:, k:k + 1]
    return acc.to(dtype)


def expert_activation(spec: MoeSpec | None, act_mul, clamped_swiglu):
    """The experts' activation as a function of gate_up (T, 2I) -> (T, I), from a backend's ops: silu * up, or
    gpt-oss's clamped SwiGLU with the spec's alpha and limit (spec.MoeSpec.activation)."""
    if spec is None or spec.activation == "silu":
        return lambda gate_up: act_mul(gate_up, "silu")
    return lambda gate_up: clamped_swiglu(gate_up, spec.swiglu_alpha, spec.swiglu_limit)


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: MoeWeights, linear,
                    act_mul, activate=None) -> torch.Tensor:
    """The routed experts with a backend's `linear` and `act_mul`: the (token, rank) pairs grouped by expert (a
    stable sort, so an expert's rows keep token order), each expert that has rows one gate_up linear, silu * up
    (or `activate(gate_up)`: expert_activation) and one down linear over them, with the expert's biases where w
    has them (its output in x's dtype, as transformers' experts round it), the outputs put back at their (token,
    rank) and combined per token in rank order (combine_ranks). An expert no token chose is never read.
    x: (T, hidden); ids, weights: (T, K) from route() -> (T, hidden) in x's dtype."""
    activate = activate or (lambda gate_up: act_mul(gate_up, "silu"))
    gate_up_bias = w.gate_up_bias or [None] * len(w.gate_up)
    down_bias = w.down_bias or [None] * len(w.gate_up)
    num_tokens, top_k = ids.shape
    outs = x.new_zeros(num_tokens * top_k, x.shape[1])
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(w.gate_up)).tolist()     # host sync: which experts run, how many rows
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        act = activate(linear(x.index_select(0, pairs // top_k), w.gate_up[e], gate_up_bias[e]))
        outs.index_copy_(0, pairs, linear(act, w.down[e], down_bias[e]))
    return combine_ranks(outs.view(num_tokens, top_k, -1), weights, x.dtype)
