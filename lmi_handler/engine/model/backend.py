"""option.kernel_backend: which kernels run the model, chosen once at load and logged with why.

Owns the choice and its refusals; leaves the ops to backends/ (torch_ref.py, triton/) and to today's C++
Llama path (llama.py), which the "cpp" backend names.

auto: triton on CUDA (when its backend imports), the C++ kernels on CPU where they build and the spec is
one they implement (spec.cpp_misfits()), the PyTorch reference otherwise. Tensor-parallel shards run only on
the C++ Llama path (llama.py's collectives), so auto picks it for them, on any device. An explicit backend
that cannot run here is refused at start-up with the reason, never replaced.
"""
from __future__ import annotations

import importlib
import logging

import torch

from lmi_handler.config import ConfigError, triton_interpreted
from lmi_handler.engine.model.spec import ModelSpec

KERNEL_BACKENDS = ("auto", "cpp", "triton", "torch")
OPS = ("store_kv", "paged_attention", "linear", "rms_norm", "rope", "act_mul", "log_softmax", "greedy")

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
    """The ops module of a non-C++ backend ("torch" or "triton")."""
    if name == "torch":
        from lmi_handler.engine.model.backends import torch_ref

        return torch_ref
    module, why = triton_ops()
    if module is None:
        raise ConfigError(f"option.kernel_backend=triton: {why}")
    return module


def choose_backend(requested: str, spec: ModelSpec, device: torch.device, tensor_parallel: bool = False,
                   quantize: str | None = None) -> tuple[str, str]:
    """(backend, why) for option.kernel_backend=`requested`. Raises ConfigError naming the option for an
    unknown value, or an explicit backend (or a setting) that cannot run this spec on this device."""
    requested = (requested or "auto").strip().lower()
    if requested not in KERNEL_BACKENDS:
        raise ConfigError(f"option.kernel_backend={requested!r}: must be one of {list(KERNEL_BACKENDS)}")
    if tensor_parallel or quantize is not None:
        what = "tensor_parallel_degree > 1" if tensor_parallel else f"option.quantize={quantize}"
        if requested not in ("auto", "cpp"):
            raise ConfigError(f"option.kernel_backend={requested}: {what} runs only on the cpp backend")
        misfits = spec.cpp_misfits()
        if misfits or (tensor_parallel and spec.fused_qkv):
            why = ", ".join(misfits) if misfits else "fused qkv_proj / gate_up_proj tensors (no shard rule)"
            raise ConfigError(f"{what}: model_type={spec.model_type} needs the cpp backend's Llama path, which "
                              f"does not implement {why}")
        if tensor_parallel and requested == "auto":
            return "cpp", "tensor-parallel shards run on the C++ Llama path"
        if cpp_why := _cpp_unfit(spec, device):
            raise ConfigError(f"option.kernel_backend={requested} with {what}: {cpp_why}")
        return "cpp", f"{what} needs the C++ kernels"
    if requested == "cpp":
        if cpp_why := _cpp_unfit(spec, device):
            raise ConfigError(f"option.kernel_backend=cpp cannot run here: {cpp_why}")
        return "cpp", "asked for"
    if requested == "triton":
        _, why = triton_ops()
        if not why and device.type != "cuda" and not triton_interpreted():
            why = f"device {device} is not CUDA (set TRITON_INTERPRET=1 to run the kernels interpreted on CPU)"
        if why:
            raise ConfigError(f"option.kernel_backend=triton cannot run here: {why}")
        return "triton", "asked for"
    if requested == "torch":
        return "torch", "asked for"
    if device.type == "cuda":
        _, why = triton_ops()
        return ("triton", "auto: CUDA") if not why else ("torch", f"auto: CUDA, but {why}")
    if not (cpp_why := _cpp_unfit(spec, device)):
        return "cpp", "auto: CPU, the C++ kernels are built and implement this model"
    return "torch", f"auto: {cpp_why}"


def _cpp_unfit(spec: ModelSpec, device: torch.device) -> str:
    """Why the C++ Llama path cannot run `spec` on `device` ('' when it can)."""
    from lmi_handler.engine.model.kernels import cpu_kernels

    if device.type != "cpu":
        return f"the C++ kernels run on CPU, not {device}"
    misfits = spec.cpp_misfits()
    if misfits:
        return f"model_type={spec.model_type} has {', '.join(misfits)}, which the C++ kernels do not implement"
    if cpu_kernels() is None:
        return "the C++ kernels are not built (no working C++ compiler)"
    return ""


def log_choice(name: str, why: str, spec: ModelSpec) -> None:
    log.info("kernel_backend=%s for model_type=%s (%s)", name, spec.model_type, why)
