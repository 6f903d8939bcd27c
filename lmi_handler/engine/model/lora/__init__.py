"""LoRA adapters: PEFT checkpoints read and checked against the base model (`adapters`), the registry of loaded
ones (`registry`), and the batched low-rank product each projection adds for its rows' adapters (`batch`).

Which adapter a request names is the protocol's; adding the terms after each projection is the forward's
(`LoraBatch.add`, or the C++ stack itself).
"""
from lmi_handler.engine.model.lora.adapters import (
    CONFIG_FILE,
    FUSED,
    KERNEL_PROJECTIONS,
    WEIGHTS_FILE,
    LoraAdapter,
    LoraError,
    LoraLimits,
    base_module_shapes,
    load_adapter,
)
from lmi_handler.engine.model.lora.batch import (
    CUDA_TILES_PER_CALL,
    TILE,
    LoraBatch,
    TileLayout,
    linear_with_lora,
    lora_delta,
    tile_layout,
)
from lmi_handler.engine.model.lora.registry import AdapterRegistry

__all__ = ["AdapterRegistry", "CONFIG_FILE", "CUDA_TILES_PER_CALL", "FUSED", "KERNEL_PROJECTIONS", "LoraAdapter",
           "LoraBatch", "LoraError", "LoraLimits", "TILE", "TileLayout", "WEIGHTS_FILE", "base_module_shapes",
           "linear_with_lora", "load_adapter", "lora_delta", "tile_layout"]
