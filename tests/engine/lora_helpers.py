"""LoRA test helpers: random PEFT adapters written in PEFT's layout (adapter_config.json +
adapter_model.safetensors), and the base's weights with an adapter merged in, as PEFT's merge does."""
from __future__ import annotations

import json
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model.model.layers"
SUBLAYER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "qkv_proj": "self_attn",
            "gate_up_proj": "mlp"}


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a transformers config of a family we serve (Llama's q/k/v/o and
    gate/up/down names; Phi-3's checkpoints hold q/k/v and gate/up fused, as qkv_proj and gate_up_proj)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    shapes = {"o_proj": (q, hidden), "down_proj": (inter, hidden)}
    if config.model_type == "phi3":
        return shapes | {"qkv_proj": (hidden, q + 2 * kv), "gate_up_proj": (hidden, 2 * inter)}
    return shapes | {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                     "gate_proj": (hidden, inter), "up_proj": (hidden, inter)}


def write_peft_adapter(path: Path, config, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                       modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"), std: float = 0.1,
                       use_rslora: bool = False, extra: dict | None = None,
                       tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Write a random LoRA adapter for `config` (non-zero A and B) in PEFT's layout; return its tensors.
    `extra` adds adapter_config.json keys; `tensors` replaces the weights written (for bad adapters)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    if tensors is None:
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module in modules:
                in_features, out_features = shapes[module]
                base = f"{PEFT_PREFIX}.{layer}.{SUBLAYER[module]}.{module}"
                tensors[f"{base}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
                tensors[f"{base}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
                      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": use_rslora,
                      "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny"} | (extra or {})
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return tensors


def merge_adapter(hf_model, tensors: dict[str, torch.Tensor], scale: float) -> None:
    """W += scale * B @ A in every projection the adapter has (PEFT's merge_and_unload), in place."""
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            module_path = name[len("base_model.model."):].replace(".lora_A.weight", "")
            module = hf_model.get_submodule(module_path)
            module.weight += scale * (b.double() @ a.double()).to(module.weight.dtype)
