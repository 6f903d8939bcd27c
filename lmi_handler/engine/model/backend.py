"""option.kernel_backend: which kernels run the model, chosen once at load and logged with why.

Owns the choice and its refusals; leaves the ops to backends/ (torch_ref.py, cpp.py, triton/) and the one
forward that calls them to forward.DecoderModel.

"cpp" is the C++ CPU kernels, for every family: where spec.cpp_misfits() is [] (a plain Llama-shaped spec)
and the model is whole, DecoderModel hands each step to the cpp backend's whole-stack operation (the fused
C++ decoder stack, one C++ call a step, the fast path); otherwise it walks the spec with the C++ ops (windows,
caps, norm offsets, q/k norms, GELU, partial and per-layer RoPE, multipliers, and every tensor-parallel
shard). It alone serves int8 weights (option.quantize=int8, int8 panels).

auto: triton on CUDA (when its backend imports), the C++ kernels on CPU where they build, the PyTorch
reference otherwise. Tensor-parallel shards run through the same walk on every backend (the same shard layout
and collectives: engine/parallel/layout.py, group.py; gloo on CPU, NCCL on CUDA), so the degree changes
nothing here; its own refusals (heads, KV heads, intermediate size, vocabulary not divisible) stay
layout.check_degree's. An explicit backend that cannot run here is refused at start-up with the reason, never
replaced.
"""
from __future__ import annotations

import importlib
import logging

import torch

from lmi_handler.config import ConfigError, triton_interpreted
from lmi_handler.engine.model.spec import ModelSpec

KERNEL_BACKENDS = ("auto", "cpp", "triton", "torch")
OPS = ("store_kv", "paged_attention", "linear", "rms_norm", "rope", "act_mul", "log_softmax", "greedy", "lora_add",
       "decoder_stack", "moe_experts")

log = logging.getLogger(__name__)


def triton_ops():
    """The Triton backend's module (backends/triton: the interface's ops), or the reason it cannot be used."""
    try:
        module = importlib.import_module("lmi_handler.engine.model.backends.triton")
    except ImportError as exc:
        return None, f"the Triton backend does not import ({exc})"
    missing = [op for op in OPS if not hasattr(module, op)]
    if missing:
        return None, f"the Triton backend lacks the ops {missing}"
    if not module.available():          # the package imports without triton; its kernels do not
        return None, "the triton package is not installed (pip install triton)"
    return module, ""


def backend_ops(name: str):
    """The ops module forward.DecoderModel calls for backend `name` ("torch", "cpp": the C++ ops, or "triton")."""
    if name == "torch":
        from lmi_handler.engine.model.backends import torch_ref

        return torch_ref
    if name == "cpp":
        from lmi_handler.engine.model.backends import cpp

        return cpp
    module, why = triton_ops()
    if module is None:
        raise ConfigError(f"option.kernel_backend=triton: {why}")
    return module


def choose_backend(requested: str, spec: ModelSpec, device: torch.device, tensor_parallel: bool = False,
                   quantize: str | None = None) -> tuple[str, str]:
    """(backend, why) for option.kernel_backend=`requested`. Raises ConfigError naming the option for an
    unknown value, or an explicit backend (or a setting) that cannot run this spec on this device.
    `tensor_parallel` only words the log line: every backend runs shards (forward.DecoderModel's walk)."""
    requested = (requested or "auto").strip().lower()
    if requested not in KERNEL_BACKENDS:
        raise ConfigError(f"option.kernel_backend={requested!r}: must be one of {list(KERNEL_BACKENDS)}")
    shards = "; tensor-parallel shards walk the spec op by op" if tensor_parallel else ""
    if quantize is not None:
        what = f"option.quantize={quantize}"
        if requested not in ("auto", "cpp"):
            raise ConfigError(f"option.kernel_backend={requested}: {what} runs only on the cpp backend")
        if cpp_why := _cpp_unfit(spec, device):
            raise ConfigError(f"option.kernel_backend={requested} with {what}: {cpp_why}")
        return "cpp", f"{what} needs the C++ kernels; {cpp_form(spec, tensor_parallel)}"
    if requested == "cpp":
        if cpp_why := _cpp_unfit(spec, device):
            raise ConfigError(f"option.kernel_backend=cpp cannot run here: {cpp_why}")
        return "cpp", f"asked for; {cpp_form(spec, tensor_parallel)}"
    if requested == "triton":
        _, why = triton_ops()
        if not why and device.type != "cuda" and not triton_interpreted():
            why = f"device {device} is not CUDA (set TRITON_INTERPRET=1 to run the kernels interpreted on CPU)"
        if why:
            raise ConfigError(f"option.kernel_backend=triton cannot run here: {why}")
        return "triton", "asked for" + shards
    if requested == "torch":
        return "torch", "asked for" + shards
    if device.type == "cuda":
        _, why = triton_ops()
        return ("triton", "auto: CUDA" + shards) if not why else ("torch", f"auto: CUDA, but {why}" + shards)
    if not (cpp_why := _cpp_unfit(spec, device)):
        return "cpp", f"auto: CPU, the C++ kernels are built; {cpp_form(spec, tensor_parallel)}"
    return "torch", f"auto: {cpp_why}" + shards


def cpp_form(spec: ModelSpec, tensor_parallel: bool = False) -> str:
    """How the cpp backend runs `spec`, in words for the log: the fused C++ decoder stack where
    spec.cpp_misfits() is [] and the model is whole, else the C++ ops one by one (and why)."""
    misfits = spec.cpp_misfits()
    if tensor_parallel:
        return "tensor-parallel shards walk the spec with the C++ ops (the reduce sits between them)"
    if not misfits:
        return "the fused C++ decoder stack (one C++ call a step)"
    return f"the C++ ops walking the layer description (model_type={spec.model_type} has {', '.join(misfits)})"


def _cpp_unfit(spec: ModelSpec, device: torch.device) -> str:
    """Why the C++ kernels cannot run `spec` on `device` ('' when they can: every spec, cpp_form)."""
    from lmi_handler.engine.model.kernels import cpu_kernels

    if device.type != "cpu":
        return f"the C++ kernels run on CPU, not {device}"
    if cpu_kernels() is None:
        return "the C++ kernels are not built (no working C++ compiler)"
    return ""


def log_choice(name: str, why: str, spec: ModelSpec) -> None:
    log.info("kernel_backend=%s for model_type=%s (%s)", name, spec.model_type, why)
