"""The Triton backend: the ops of the backend interface as Triton kernels, for CUDA tensors (and for CPU
tensors under TRITON_INTERPRET=1, Triton's interpreter: slow, for tests).

Every op is row-wise or tiled so that a row's bits never depend on the rest of the step: attention walks
the KV in fixed tiles aligned to absolute positions, the matmul has a fixed K tile and no split-K, the norms
and softmaxes reduce one row per program in a fixed order, and the LoRA term (lora_add, on the stacks
lora_stack prepares once per adapter set) and the experts' grouped matmul (moe.py) keeps the matmul's tiles reduces each row against its own adapter in a fixed K order. `triton` is imported on the first call,
not here, so the package imports without it; `available()` says whether it can run.
"""
from __future__ import annotations

import importlib.util

import torch

__all__ = ["available", "store_kv", "paged_attention", "linear", "rms_norm", "rope", "act_mul",
           "log_softmax", "greedy", "seeded_sample", "lora_stack", "lora_add", "lora_rows",
           "decoder_stack", "moe_experts", "clamped_swiglu"]


def available() -> bool:
    """True when the triton package is installed (whether a device runs it is the caller's question)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):        # ValueError: sys.modules["triton"] is None (import blocked)
        return False


def _kernels(module: str):
    """The kernel module, imported on first use; a clear error when triton is missing or broken."""
    if not available():
        raise RuntimeError("kernel_backend 'triton' needs the triton package (pip install triton), "
                           "which is not installed here")
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        raise RuntimeError(f"kernel_backend 'triton': the triton package does not import here: {exc}") from exc


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    _kernels("attention").store_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                    window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _kernels("attention").paged_attention(q, k_cache, v_cache, meta, scale, window, softcap, sinks)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _kernels("matmul").linear(x, weight, bias, out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             weight_offset: float = 0.0, weight_in_float: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels("rowwise").rms_norm(x, weight, eps, residual, weight_offset, weight_in_float)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _kernels("rowwise").rope(x, cos, sin)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    return _kernels("rowwise").act_mul(gate_up, act)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w, spec=None) -> torch.Tensor:
    """The routed experts (torch_ref.moe_experts' contract) as the fused MoE kernel (moe.py: pairs sorted by
    expert, one grouped matmul per projection); gpt-oss's biased, clamped experts as moe.grouped_experts over
    this backend's linear and clamped_swiglu (the fused kernel has no biases or clamp yet)."""
    if w.gate_up_bias is not None or (spec is not None and spec.activation != "silu"):
        from lmi_handler.engine.model.moe import expert_activation, grouped_experts

        return grouped_experts(x, ids, weights, w, linear, act_mul, expert_activation(spec, act_mul, clamped_swiglu))
    return _kernels("moe").moe_experts(x, ids, weights, w)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return _kernels("rowwise").clamped_swiglu(gate_up, alpha, limit)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return _kernels("sampling").log_softmax(logits)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return _kernels("sampling").greedy(logits)


def seeded_sample(logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return _kernels("sampling").seeded_sample(logprobs, seeds, positions)


def lora_stack(a_stack: torch.Tensor, b_stack: torch.Tensor):
    """One projection's A (num_slots, r_max, in) and B (num_slots, out, r_max) as lora_add takes them (a
    LoraStack: checked and made contiguous once per adapter set)."""
    return _kernels("lora").lora_stack(a_stack, b_stack)


def lora_add(y: torch.Tensor, x: torch.Tensor, lora, layer: int, module: str, num_layers: int) -> torch.Tensor:
    """y += each row's LoRA term of projection `module` of `layer` (x A_s^T B_s^T * scale_s, s = the row's slot,
    -1 untouched), in place on y, a fresh projection output; returns y. The set's stacks are laid out once
    (LoraBatch.backend_stacks with lora_stack)."""
    stack = lora.backend_stacks(lora_stack).get((layer, module))
    return y if stack is None else lora_rows(y, x, lora.row_slot, stack, lora.scale)


def lora_rows(y: torch.Tensor, x: torch.Tensor, row_slot: torch.Tensor, stack, scale: torch.Tensor) -> torch.Tensor:
    """The kernel under lora_add: y += each row's term (x A_s^T B_s^T * scale_s, s = row_slot, -1 untouched),
    in place; returns y. stack: lora_stack(A, B) of the projection."""
    return _kernels("lora").lora_add(y, x, row_slot, stack, scale)


def decoder_stack(spec, layers, final_norm, num_heads: int, num_kv_heads: int) -> None:
    """No whole-stack operation here: forward.DecoderModel walks the layers op by op."""
    return None
