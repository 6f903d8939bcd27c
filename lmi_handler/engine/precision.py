"""Which dtype a model runs in and whether its weights are quantized: option.dtype and option.quantize
turned into one decision, with the sentence the engine logs about it.

Owns the rules (vLLM's where users expect them), reading the checkpoint's dtype, and the device and
precision an EngineConfig gets (pick_device, pick_precision: engine.py and parallel/launch.py both take
them from here); leaves the kernels to model/ and building the runner to engine.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lmi_handler.config import ConfigError, EngineConfig

# option.quantize values the engine serves (None: the checkpoint's weights): int8 / int4 quantize at load; the
# others name a pre-quantized checkpoint's method (LMI's spelling; engine/model/quant checks it against config.json)
QUANTIZE_KINDS = ("int8", "int4", "gptq", "awq", "compressed-tensors", "fp8")
_QUANTIZE_WORDS = {"int8": "int8 (per output channel, quantized at load)",
                   "int4": "int4 (a scale and zero point per 32 inputs, quantized at load)",
                   "fp8": "fp8 (e4m3: the checkpoint's, or a float checkpoint's rounded at load per output channel)"}


@dataclass(frozen=True)
class Precision:
    """The decision: activations and KV cache in `dtype`, weights per `quantize` (None = in `dtype`)."""

    dtype: torch.dtype
    quantize: str | None
    reason: str            # one sentence for the log: what was chosen and why
    warn: bool = False     # the user should know (slower path, or a dtype not honoured as written)


def checkpoint_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The dtype the checkpoint's floating-point weights are stored in (the most common one among the
    safetensors tensors; the header alone is read), else config.json's `dtype` / `torch_dtype`, else None."""
    from safetensors import safe_open

    from lmi_handler.engine.model.loader import safetensors_files

    model_dir = Path(model_dir)
    counts: dict[str, int] = {}
    for name in safetensors_files(model_dir):
        with safe_open(model_dir / name, framework="pt") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                counts[dtype] = counts.get(dtype, 0) + 1
    floats = {k: v for k, v in counts.items() if k in _SAFETENSORS_FLOATS}
    if floats:
        return _SAFETENSORS_FLOATS[max(floats, key=floats.get)]
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype) else None


_SAFETENSORS_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def resolve_precision(requested: str, quantize: str | None, checkpoint: torch.dtype | None, device: torch.device,
                      native_bf16: bool, kernels_built: Callable[[], bool]) -> Precision:
    """Turn option.dtype (`requested`: auto | float32 | bfloat16 | float16, as config/model.py normalizes it) and
    option.quantize into a Precision.

    CPU: auto follows the checkpoint: a bf16 or fp16 checkpoint runs in bf16 where the CPU has native bf16
    dot products (`native_bf16`: AVX512_BF16 / AMX) and the C++ kernels built, else in float32; a float32
    one in float32. An explicit float32 or bfloat16 is obeyed (bf16 without native support or without the
    kernels warns: slower). float16 runs as bfloat16 with a warning (vLLM's CPU backend does the same).
    CUDA: auto is the checkpoint's dtype when it is fp16 or bf16, else bf16; an explicit dtype is obeyed.
    quantize="int8" needs the C++ CPU kernels (`kernels_built()`, called only then).
    Raises: ConfigError naming option.quantize for a value or device the engine cannot serve.
    """
    if quantize is not None and quantize not in QUANTIZE_KINDS:
        raise ConfigError(f"option.quantize={quantize!r}: the engine serves {list(QUANTIZE_KINDS)} (or none)")
    if device.type != "cpu":
        if quantize is not None:
            raise ConfigError(f"option.quantize={quantize!r} runs on CPU only (the C++ int8 kernels); the device "
                              f"is {device} (drop option.quantize, or hide the GPUs with CUDA_VISIBLE_DEVICES= to "
                              "serve on the CPU)")
        return _cuda_dtype(requested, checkpoint)
    if quantize is not None and not kernels_built():
        raise ConfigError(f"option.quantize={quantize!r} needs the C++ CPU kernels, which did not build here "
                          "(see the warning above: a C++ compiler and ninja are needed)")
    precision = _cpu_dtype(requested, checkpoint, native_bf16, kernels_built)
    if quantize is None:
        return precision
    words = _QUANTIZE_WORDS.get(quantize, f"as the {quantize} checkpoint stores them")
    return Precision(precision.dtype, quantize, f"{precision.reason}; weights {words}", precision.warn)


def _cuda_dtype(requested: str, checkpoint: torch.dtype | None) -> Precision:
    if requested != "auto":
        return Precision(getattr(torch, requested), None, f"dtype {requested} (option.dtype)")
    dtype = checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16
    return Precision(dtype, None, f"dtype {_name(dtype)} (option.dtype=auto on CUDA, checkpoint {_name(checkpoint)})")


def _cpu_dtype(requested: str, checkpoint: torch.dtype | None, native_bf16: bool,
               kernels_built: Callable[[], bool]) -> Precision:
    ckpt = _name(checkpoint)
    if requested == "float32":
        return Precision(torch.float32, None, f"dtype float32 (option.dtype, checkpoint {ckpt})")
    if requested == "auto":
        if checkpoint not in (torch.bfloat16, torch.float16):
            return Precision(torch.float32, None, f"dtype float32 (option.dtype=auto: checkpoint {ckpt})")
        if native_bf16 and kernels_built():
            return Precision(torch.bfloat16, None, f"dtype bfloat16 (option.dtype=auto: checkpoint {ckpt} and "
                             "this CPU has native bf16 dot products)")
        return Precision(torch.float32, None, f"dtype float32 (option.dtype=auto: checkpoint {ckpt}, but "
                         f"{_why_slow_bf16(native_bf16)}; "
                         "set option.dtype=bf16 to run it in bf16 anyway, slower)")
    note = " (option.dtype=fp16: CPUs run fp16 checkpoints in bf16, as vLLM does)" if requested == "float16" else ""
    asked = note or f" (option.dtype, checkpoint {ckpt})"
    if not native_bf16 or not kernels_built():
        return Precision(torch.bfloat16, None, f"dtype bfloat16{asked}, with {_why_slow_bf16(native_bf16)}: it runs, "
                         "slower than on a CPU with AVX512_BF16", warn=True)
    return Precision(torch.bfloat16, None, f"dtype bfloat16{asked}; this CPU has native bf16 dot products",
                     warn=bool(note))


def _why_slow_bf16(native_bf16: bool) -> str:
    """Why bf16 would be slow here: the CPU lacks native bf16 dot products, else the kernels did not build."""
    return ("no native bf16 dot products (AVX512_BF16 / AMX) on this CPU" if not native_bf16
            else "the C++ kernels did not build")


def _name(dtype: torch.dtype | None) -> str:
    return "of unknown dtype" if dtype is None else str(dtype).removeprefix("torch.")


def pick_device(device_id: int) -> torch.device:
    """cuda:device_id (cuda:0 for -1) when CUDA is present, else CPU. Raises ConfigError naming option.device_id
    for an index past the visible CUDA devices."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if device_id >= count:
            raise ConfigError(f"option.device_id={device_id}: {count} CUDA device(s) visible, so -1 or 0..{count - 1}")
        return torch.device(f"cuda:{max(device_id, 0)}")
    return torch.device("cpu")


def pick_precision(config: EngineConfig, device: torch.device) -> Precision:
    """option.dtype and option.quantize for this checkpoint on this device (precision.resolve_precision).
    Raises: ConfigError naming option.quantize when the engine cannot serve it."""
    from lmi_handler.engine.model.kernels import cpu_kernels
    from lmi_handler.engine.model.kernels.build import native_bf16_cpu

    return resolve_precision(config.dtype, config.quantize, checkpoint_dtype(config.model_path), device,
                             native_bf16=device.type == "cpu" and native_bf16_cpu(),
                             kernels_built=lambda: cpu_kernels() is not None)
