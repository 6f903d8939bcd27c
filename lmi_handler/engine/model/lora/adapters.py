"""LoRA adapter files: a PEFT checkpoint (adapter_config.json + adapter_model.safetensors) read and checked
against the base model's projections and the deployment's limits (rank, modules, shapes, allowed roots)."""
from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's names for a Llama-family model saved with save_pretrained (the adapter's own name removed)
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
# Fused projections of the base (Phi-3's checkpoints; our own forward's qkv and gate_up) and their parts
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# the projections the C++ decoder stack adds terms to, in LoraSet's order (kernels/lora.h)
KERNEL_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoraError(ValueError):
    """An adapter that cannot be loaded or used; `status_code` is the HTTP answer (400 bad adapter, 404 unknown
    name, 409 name taken, 503 no room), `field` the request field it names."""

    def __init__(self, message: str, status_code: int = 400, field: str = "adapter"):
        super().__init__(message)
        self.status_code, self.field = status_code, field


@dataclass(frozen=True)
class LoraLimits:
    """What an adapter may be: option.max_lora_rank, option.lora_target_modules (None = every projection the
    base has), option.max_cpu_loras, and the directories the run-time APIs may load from."""

    max_lora_rank: int = 16
    target_modules: tuple[str, ...] | None = None
    max_cpu_loras: int = 8
    allowed_roots: tuple[Path, ...] = ()


def base_module_shapes(config: Mapping) -> dict[str, tuple[int, int]]:
    """The base's LoRA-able projections from its config.json: name -> (in_features, out_features).

    Llama-family models have q/k/v/o and gate/up/down; Phi-3 stores q/k/v and gate/up fused (qkv_proj,
    gate_up_proj), so an adapter of it names those.
    """
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // num_heads
    q_out, kv_out = num_heads * head_dim, (config.get("num_key_value_heads") or num_heads) * head_dim
    shapes = {"o_proj": (q_out, hidden), "down_proj": (inter, hidden)}
    if config.get("model_type") == "phi3":
        return shapes | {"qkv_proj": (hidden, q_out + 2 * kv_out), "gate_up_proj": (hidden, 2 * inter)}
    return shapes | {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
                     "gate_proj": (hidden, inter), "up_proj": (hidden, inter)}


@dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter: per (layer, module) A (r, in) and B (out, r) float32 CPU tensors and its scale.

    `key` is unique to this load (never reused, even for the same name loaded again), so the prefix cache
    keyed on it never serves K/V computed under another adapter or an older copy of this one.
    """

    name: str
    path: Path
    rank: int
    scale: float                                    # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    key: bytes = field(default_factory=lambda: uuid.uuid4().bytes)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted({module for _, module in self.weights}))


def load_adapter(name: str, path: str | Path, config: Mapping, limits: LoraLimits,
                 check_root: bool = True, sparse_layers: frozenset[int] = frozenset()) -> LoraAdapter:
    """Read a PEFT LoRA adapter folder and check it against the base's `config` (config.json as a dict).

    `sparse_layers`: the base's mixture-of-experts layers (spec.layers[i].moe set), whose MLP is routed
    experts, not the one gate/up/down an adapter's MLP weights would change.

    Raises LoraError (400) naming what is wrong: a bad name, a path outside limits.allowed_roots (when
    `check_root`), missing files, a config that is not plain LoRA, a rank over limits.max_lora_rank, a module
    the base lacks or option.lora_target_modules leaves out, a layer past the base's, an MLP module on a
    sparse layer, a shape that does not match, an A without its B.
    """
    if not _ADAPTER_NAME.fullmatch(name or ""):
        raise LoraError(f"adapter name {name!r} is not 1-128 characters of [A-Za-z0-9._-] starting with a letter "
                        "or digit", field="name")
    folder = Path(path).expanduser().resolve()
    if check_root and not any(folder.is_relative_to(root.resolve()) for root in limits.allowed_roots):
        roots = ", ".join(str(r) for r in limits.allowed_roots) or "none"
        raise LoraError(f"adapter path {str(path)!r} is outside the allowed roots ({roots}; "
                        "option.lora_adapter_roots)", field="src")
    peft = _read_config(folder)
    rank, alpha = peft.get("r"), peft.get("lora_alpha", peft.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"{folder / CONFIG_FILE}: `r` must be a whole number >= 1 and `lora_alpha` a number, "
                        f"got r={rank!r}, lora_alpha={alpha!r}")
    if rank > limits.max_lora_rank:
        raise LoraError(f"adapter {name!r} has rank {rank}, over option.max_lora_rank={limits.max_lora_rank}")
    scale = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    weights = _read_weights(folder, name, rank, base_module_shapes(config), config["num_hidden_layers"], limits,
                            sparse_layers)
    return LoraAdapter(name, folder, rank, float(scale), weights)


def _read_config(folder: Path) -> dict:
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise LoraError(f"adapter folder {str(folder)!r} has no {needed.name} (PEFT's format: {CONFIG_FILE} "
                            f"+ {WEIGHTS_FILE})", field="src")
    try:
        peft = json.loads(config_path.read_text())
    except ValueError as exc:
        raise LoraError(f"{config_path} is not valid JSON: {exc}") from None
    refused = {"peft_type": peft.get("peft_type", "LORA") != "LORA", "use_dora": bool(peft.get("use_dora")),
               "fan_in_fan_out": bool(peft.get("fan_in_fan_out")), "bias": peft.get("bias", "none") != "none",
               "rank_pattern": bool(peft.get("rank_pattern")), "alpha_pattern": bool(peft.get("alpha_pattern")),
               "modules_to_save": bool(peft.get("modules_to_save"))}
    bad = [key for key, is_bad in refused.items() if is_bad]
    if bad:
        shown = ", ".join(f"{key}={peft.get(key)!r}" for key in bad)
        raise LoraError(f"{config_path}: only plain LoRA adapters are supported (peft_type LORA, no DoRA, "
                        f"fan_in_fan_out, bias, rank/alpha patterns or modules_to_save), got {shown}")
    return peft


def _read_weights(folder: Path, name: str, rank: int, shapes: dict[str, tuple[int, int]], num_layers: int,
                  limits: LoraLimits, sparse_layers: frozenset[int] = frozenset()
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise LoraError(f"{folder / WEIGHTS_FILE} cannot be read as safetensors: {exc}") from None
    allowed = set(shapes) if limits.target_modules is None else set(shapes) & set(limits.target_modules)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(tensor_name)
        if match is None:
            raise LoraError(f"adapter {name!r}: tensor {tensor_name!r} is not a LoRA A/B weight of a decoder "
                            "projection (PEFT names: base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight)")
        layer, module, half = int(match[1]), match[3], match[4]
        if module not in shapes:
            raise LoraError(f"adapter {name!r}: module {module!r} ({tensor_name}) is not one the base model has "
                            f"({', '.join(sorted(shapes))})")
        if module not in allowed:
            raise LoraError(f"adapter {name!r}: module {module!r} is not in option.lora_target_modules "
                            f"({', '.join(sorted(allowed))})")
        if layer >= num_layers:
            raise LoraError(f"adapter {name!r}: {tensor_name} names layer {layer}, the base has {num_layers}")
        if match[2] == "mlp" and layer in sparse_layers:
            raise LoraError(f"adapter {name!r}: {tensor_name} adapts the MLP of layer {layer}, a mixture-of-experts "
                            "layer in this base: LoRA on routed experts is not served (attention projections are, "
                            "and the MLPs of dense layers)")
        in_features, out_features = shapes[module]
        want = (rank, in_features) if half == "A" else (out_features, rank)
        if tuple(tensor.shape) != want:
            raise LoraError(f"adapter {name!r}: {tensor_name} has shape {tuple(tensor.shape)}, the base model "
                            f"needs {want} (rank {rank})")
        halves.setdefault((layer, module), {})[half] = tensor.float().contiguous()
    lonely = [f"layer {layer} {module}" for (layer, module), pair in halves.items() if len(pair) != 2]
    if lonely or not halves:
        raise LoraError(f"adapter {name!r}: " + (f"lora_A without lora_B or the reverse at {', '.join(lonely)}"
                                                 if lonely else "holds no LoRA weights"))
    return {key: (pair["A"], pair["B"]) for key, pair in sorted(halves.items())}
