"""The LoRA part of the settings: whether adapters are served, their limits, and where they may come from.

Owns option.enable_lora and the lora_* / max_*lora* options and the engine's LoraConfig slice of them;
loading and applying adapters is engine/model/lora/'s.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator

from lmi_handler.config.base import Options, split_keys
from lmi_handler.config.slices import LoraConfig

# The projections a LoRA adapter may change (option.lora_target_modules); Phi-3 fuses qkv and gate_up
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj")


class LoraOptions(Options):
    """LoRA adapters: served on the base model, chosen per request."""

    enable_lora: bool = False
    """Serve LoRA adapters on the base model (PEFT format; docs/lora.md): from `<model>/adapters/<name>/` and
    lora_modules at start-up, the adapter APIs at run time, chosen per request (`adapters`, the
    X-Amzn-SageMaker-Adapter-Identifier header, OpenAI `model`, TGI `adapter_id`). false: adapter requests and
    the adapter APIs answer 400."""
    max_loras: int = Field(4, ge=1, le=256)
    """Distinct adapters in one step, [1, 256]; a request of another adapter waits until one of theirs ends."""
    max_lora_rank: int = Field(16, ge=1, le=512)
    """Largest adapter rank accepted, [1, 512]; a higher-rank adapter is refused at load (400)."""
    max_cpu_loras: int | None = Field(None, ge=1, le=4096)
    """Adapters kept loaded, [max_loras, 4096]; unset = max_loras. Loading one more evicts the least recently
    used adapter that no running request holds (vLLM's --max-cpu-loras)."""
    lora_target_modules: str | None = None
    """Comma-separated projections adapters may change (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj; Phi-3: qkv_proj, gate_up_proj); an adapter touching another is refused. Unset: all of them."""
    lora_modules: str | None = None
    """Adapters loaded at start-up, vLLM's `name=path,name=path` (paths absolute or relative to model_dir)."""
    lora_adapter_roots: str | None = None
    """Comma-separated directories the run-time adapter APIs may load from, besides `<model>/adapters`; a path
    outside them (symbolic links resolved) answers 400. Start-up sources are the operator's and not checked."""

    @field_validator("lora_target_modules")
    @classmethod
    def _known_modules(cls, value: str | None) -> str | None:
        names = split_keys(value or "")
        unknown = sorted(set(names) - set(LORA_MODULES))
        if value is not None and (unknown or not names):
            raise ValueError(f"must name projections among {', '.join(LORA_MODULES)}, got {value!r}")
        return value

    @field_validator("lora_modules")
    @classmethod
    def _name_path_pairs(cls, value: str | None) -> str | None:
        for pair in split_keys(value or ""):
            name, sep, path = pair.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"must be name=path pairs separated by commas, got {pair!r}")
        return value

    @field_validator("max_cpu_loras")
    @classmethod
    def _cpu_loras_hold_a_step(cls, value: int | None, info: ValidationInfo) -> int | None:
        max_loras = info.data.get("max_loras")
        if value is not None and max_loras is not None and value < max_loras:
            raise ValueError(f"must be >= max_loras ({max_loras}): the adapters of one step stay loaded")
        return value

    @property
    def lora_modules_list(self) -> tuple[tuple[str, Path], ...]:
        """option.lora_modules as (name, path) pairs, relative paths from model_dir."""
        pairs = (pair.partition("=") for pair in split_keys(self.lora_modules or ""))
        return tuple((name.strip(), Path(self.model_dir) / path.strip()) for name, _, path in pairs)

    def lora_config(self, model_path: Path) -> LoraConfig | None:
        """The engine's LoRA slice (`model_path`: the model's directory, whose adapters/ is always a root); None
        when enable_lora is off."""
        if not self.enable_lora:
            return None
        roots = (model_path / "adapters",) + tuple(Path(self.model_dir) / r
                                                   for r in split_keys(self.lora_adapter_roots or ""))
        targets = split_keys(self.lora_target_modules) if self.lora_target_modules else None
        return LoraConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras or self.max_loras, target_modules=targets,
                          adapter_roots=roots)
