"""The C++ backend: the backend interface's ops on the C++ CPU kernels (engine/model/kernels) for
forward.DecoderModel, and its whole-stack operation (decoder_stack: the decoder layers one C++ call a step).

Owns the mapping of each op to its kernel, the packing of the linears' weights at load (pack_linear: one
PackedWeight of float32, bfloat16 or int8 panels per weight, made once) and the fused DecoderStack built
from a layer description it fits, each layer's weights by role; leaves the kernels to kernels/ (linear.h's
row-invariant packed linear, linear_quant.h's over 4-/8-bit codes, attention.h's paged attention with its window
and score cap, rowwise.h's norm and silu * up, decoder_stack.h's stack, families.h's offset norm, rope and
GELU-tanh * up, lora.h's adapter terms) and what to call when to forward.py. Every op computes a row from that row
alone, by construction of its kernel, so a sequence's bits do not depend on the rest of its step. Activations
float32 or bfloat16 on CPU.
"""
from __future__ import annotations

import torch

from lmi_handler.engine.model.attention import AttentionMetadata, attention_paged
from lmi_handler.engine.model.backends import torch_ref
from lmi_handler.engine.model.kernels import (
    PackedWeight,
    bf16_dot_form,
    cpu_kernels,
    pack_weight,
    packed_linear,
    row_argmax,
)
from lmi_handler.engine.model.lora import KERNEL_PROJECTIONS, LoraBatch
from lmi_handler.engine.model.moe import MoeWeights
from lmi_handler.engine.model.quant import QuantWeight, quant_linear
from lmi_handler.engine.model.quant.weight import FMTS
from lmi_handler.engine.model.spec import MoeSpec

NAME = "cpp"
PROJECTION_INDEX = {name: i for i, name in enumerate(KERNEL_PROJECTIONS)}   # LoraSet's projection numbers

store_kv = torch_ref.store_kv           # index copies: exact, nothing to gain in C++
log_softmax = torch_ref.log_softmax


def pack_linear(weight: torch.Tensor, kind: str, out: torch.Tensor | None = None) -> PackedWeight:
    """The checkpoint's (out, in) weight as `kind` panels ("float32", "bfloat16" or "int8": quantized from the
    checkpoint's own values, per output channel), made once at load (loader.load_model) into `out` (a view of
    the model's panel arena, kernels.panel_arena) or new memory."""
    return pack_weight(weight, kind, out=out)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """attention.h's paged attention (keys walked block by block from the window's first block, online
    softmax in float32; bf16 rounds the softmax weights as torch's CPU flash attention does), with the window,
    Gemma 2's score cap and gpt-oss's sinks (H,) (the unmasked kernel where there are none: the fused stack's).
    q: (T, H, D) -> (T, H, D) in q's dtype."""
    if window is None and softcap is None and sinks is None:
        return attention_paged(q, k_cache, v_cache, meta, scale)
    return cpu_kernels().paged_attention_masked(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                meta.cu_seqlens_q, scale, window or 0, softcap or 0.0, sinks)


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (T, K) @ W.T (+ bias) over the packed panels (linear.h: one fixed chain of float32 operations per
    output whatever T is) -> (T, N) in `out_dtype` (default x's dtype), each value rounded once from its float32
    accumulator (float32: written as it is, the tensor-parallel partials and the logits). A quant.QuantWeight (4-bit
    or 8-bit codes) goes through kernels/linear_quant.h: the float32 chain over its dequantized values."""
    if isinstance(weight, QuantWeight):
        return quant_linear(x, weight, bias, out_dtype)
    return packed_linear(x.contiguous(), weight, bias, out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             weight_offset: float = 0.0, weight_in_float: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_ref.rms_norm's maths (the sums of squares in the kernels' order). weight_in_float False: rowwise.h's
    add_rmsnorm, the fused stack's norm, which adds `residual` into x in place (x must be contiguous; the
    walk owns it) and needs weight in x's dtype and no offset; else families.h's offset norm. Returns (out, h)."""
    if weight_in_float:
        return cpu_kernels().rms_norm_offset(x, residual, weight, eps, weight_offset)
    if weight_offset != 0.0:
        raise ValueError("the C++ LlamaRMSNorm has no weight offset (a spec with one weighs its norm in float32)")
    x = x.contiguous()
    return cpu_kernels().add_rmsnorm(x, residual, weight, eps), x


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos, sin (T, D), rotate-half (torch_ref.rope's operations and roundings)."""
    return cpu_kernels().rope(x, cos, sin)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> act(gate) * up; act "silu" (rowwise.h) or "gelu_tanh" (families.h)."""
    kernels = cpu_kernels()
    gate_up = gate_up.contiguous()
    return kernels.silu_mul(gate_up) if act == "silu" else kernels.gelu_tanh_mul(gate_up)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation (torch_ref.clamped_swiglu's operations and roundings; moe.cpp, row by row)."""
    return cpu_kernels().clamped_swiglu(gate_up, alpha, limit)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: MoeWeights,
                spec: MoeSpec | None = None) -> torch.Tensor:
    """The routed experts over their packed panels (torch_ref.moe_experts' contract), one C++ call (moe.cpp):
    the pairs grouped by expert, each chosen expert linear.h's linear_silu (gpt-oss: linear with its bias, then
    the clamped SwiGLU) and linear over its rows, the outputs combined per token in rank order; bitwise
    moe.grouped_experts with this module's ops. The panel lists are gathered once per layer (w.prepared).
    Quantized experts (MXFP4's e2m1 panels, quant.QuantWeight) the same over linear_quant.h's quant_linear
    (moe.cpp's moe_experts_quant)."""
    clamped = spec is not None and spec.activation == "clamped_swiglu"
    act = (clamped, spec.swiglu_alpha if clamped else 1.0, spec.swiglu_limit if clamped else 0.0)
    biases = (w.gate_up_bias or [], w.down_bias or [])
    first = w.gate_up[0]
    if isinstance(first, QuantWeight):
        if w.prepared is None:
            assert all(q.perm is None for q in w.gate_up + w.down), "experts have no act-order permutation"
            w.prepared = ([[q.panels, q.scales, q.zeros] for q in w.gate_up],
                          [[q.panels, q.scales, q.zeros] for q in w.down], first.out_features)
        gate_up, down, features = w.prepared
        return cpu_kernels().moe_experts_quant(x, ids, weights, gate_up, down, features, first.group_size, first.bits,
                                               FMTS[first.fmt], *biases, *act)
    if w.prepared is None:
        w.prepared = ([p.panels for p in w.gate_up], [p.scale for p in w.gate_up], [p.panels for p in w.down],
                      [p.scale for p in w.down], first.out_features)
    form = bf16_dot_form() if first.kind == "bfloat16" else 0
    return cpu_kernels().moe_experts(x, ids, weights, *w.prepared, form, *biases, *act)


def lora_add(y: torch.Tensor, x: torch.Tensor, lora: LoraBatch, layer: int, module: str,
             num_layers: int) -> torch.Tensor:
    """y + each row's LoRA term of projection `module` of `layer` (kernels/lora.h through the set's LoraSet,
    LoraBatch.kernel_set: row by row, the term the fused stack adds), in place on y, a fresh projection output."""
    return lora.kernel_set(cpu_kernels(), num_layers).add(y, x, lora.row_slot, layer, PROJECTION_INDEX[module])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(S, V) -> (S,) int64: the argmax, the lowest index on ties."""
    return row_argmax(logits.float())


STACK_NORMS = ("attn_pre", "mlp_pre")           # decoder_stack.h StackLayer's norms: forward.LayerWeights' roles
STACK_LINEARS = ("qkv", "o", "gate_up", "down")  # its linears, each with the role's <name>_bias


def stack_kind(weight) -> str | None:
    """The fused stack's kind of a linear (kernels/stack_linear.h: the kernel that runs it inside the stack):
    "panels" for a PackedWeight (linear.h), "codes" for a QuantWeight (linear_quant.h: 4-/8-bit integer codes or FP8
    bytes); None for a weight the stack has no kernel for (the model then walks the ops)."""
    if isinstance(weight, PackedWeight):
        return "panels"
    if isinstance(weight, QuantWeight):
        return "codes"
    return None


def stack_linear(ops, weight: PackedWeight | QuantWeight, bias: torch.Tensor | None):
    """One linear as kernel module `ops`' StackLinear (stack_kind's kind; the weight's tensors held, not copied)."""
    if stack_kind(weight) == "codes":
        return ops.StackLinear("codes", weight.panels, weight.out_features, scale=weight.scales, bias=bias,
                               zeros=weight.zeros, perm=weight.perm, group_size=weight.group_size, bits=weight.bits,
                               fmt=FMTS[weight.fmt])
    return ops.StackLinear("panels", weight.panels, weight.out_features, scale=weight.scale, bias=bias)


def stack_layer(ops, w):
    """A forward.LayerWeights as `ops`' StackLayer: each of the stack's roles (STACK_NORMS, STACK_LINEARS) passed
    by its name, so a role is one named field on both sides, never a position."""
    norms = {role: getattr(w, role) for role in STACK_NORMS}
    linears = {role: stack_linear(ops, getattr(w, role), getattr(w, f"{role}_bias")) for role in STACK_LINEARS}
    return ops.StackLayer(**norms, **linears)


def decoder_stack(spec, layers, final_norm: torch.Tensor, num_heads: int, num_kv_heads: int):
    """The whole-stack operation for `spec` (a DecoderStack), or None where the fused stack cannot run it
    (spec.cpp_misfits() not [], or a linear of a kind the stack has no kernel for: stack_kind): forward.DecoderModel
    then walks the layers with the ops above. The caller asks only for a whole model, never a tensor-parallel shard
    (the stack has no place for the reduce)."""
    if spec.cpp_misfits() or any(stack_kind(getattr(layer, role)) is None for layer in layers
                                 for role in STACK_LINEARS):
        return None
    return DecoderStack(spec, layers, final_norm, num_heads, num_kv_heads)


class DecoderStack:
    """kernels/decoder_stack.h's DecoderStack over a model's layers: the decoder layers and the final norm as one C++
    call a step, bitwise the ops above called one by one by forward.DecoderModel's walk (the same kernels chained
    without Python dispatch; its gate_up linear over packed panels applies silu * up in its store, the same bits as
    linear then silu_mul; every op's work is split over the kernels' pool, kernels/pool.h). Each layer's weights go
    in by role (stack_layer), each linear with the kind that picks its kernel (stack_kind: packed panels, or 4-/8-bit
    integer or FP8 codes). Built once at load (holding the weights' tensors, not copies). `kernel` is the C++ object."""

    def __init__(self, spec, layers, final_norm: torch.Tensor, num_heads: int, num_kv_heads: int):
        self.layers, self.final_norm = layers, final_norm
        self.num_layers = len(layers)
        self.bf16_panels = any(isinstance(w, PackedWeight) and w.kind == "bfloat16"
                               for layer in layers for w in (getattr(layer, role) for role in STACK_LINEARS))
        self._shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=spec.norm_eps, norm_eps=spec.norm_eps,
                           scale=spec.scale)
        self._build(cpu_kernels())

    def _build(self, ops) -> None:
        """The C++ object on kernel module `ops` (again when the process's module changes: benchmarks/ab.py
        swaps in another revision's kernels)."""
        layers = [stack_layer(ops, w) for w in self.layers]
        self.ops, self.kernel = ops, ops.DecoderStack(layers, self.final_norm, **self._shape)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                 lora: LoraBatch | None = None) -> torch.Tensor:
        """x: (T, hidden) float32 or bfloat16, the activations' (and KV cache's) dtype (not changed); cos, sin:
        (T, head_dim) in x's dtype. Returns the final-norm hidden states (T, hidden). `lora`: the step's
        adapters, added by the stack after each projection (forward_lora, kernels/lora.h: row by row)."""
        # the bf16 dot form matters to bf16 panels only (int8, float32 and code panels ignore it): asking for it
        # otherwise would run its start-up probe and log a choice that applies to nothing
        form = bf16_dot_form() if self.bf16_panels else 0
        if (ops := cpu_kernels()) is not self.ops:
            self._build(ops)
        # the caches as two lists: pybind converts them every call either way, so they are not cached
        args = (x, cos, sin, [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping,
                meta.block_tables, meta.context_lens, meta.cu_seqlens_q, form)
        if lora is None:
            return self.kernel.forward(*args)
        return self.kernel.forward_lora(*args, lora.kernel_set(self.ops, self.num_layers), lora.row_slot)
