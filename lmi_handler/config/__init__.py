"""Settings: serving.properties + OPTION_* environment -> one validated, frozen settings object.

Owns every configuration key and the only reads of the environment (environment.py); each part of the engine gets
its slice (EngineConfig, slices.py) as an argument. Per-request knobs are protocol/params.py's. The options
live in one module per part (model.py, engine.py, lora.py, serving.py, chat.py, batch.py, pooling.py), each a
pydantic model; settings.py composes them into Settings. Import from here: the modules' split is not an interface.
"""
from lmi_handler.config.base import ConfigError, Options
from lmi_handler.config.batch import BatchOptions
from lmi_handler.config.chat import ChatOptions
from lmi_handler.config.engine import EngineOptions
from lmi_handler.config.environment import (
    ENVIRONMENT_SWITCHES,
    RAY_LOOPBACK_SWITCH,
    REPLICA_LOOPBACK_ENV,
    keep_ray_on_loopback,
    process_environment,
    read_mpi_launch,
    read_serving_properties,
    triton_interpreted,
)
from lmi_handler.config.lora import LORA_MODULES, LoraOptions
from lmi_handler.config.model import DTYPES, ModelOptions
from lmi_handler.config.multimodal import MultimodalOptions
from lmi_handler.config.pooling import POOLING_MODES, POOLING_TASKS, TASKS, PoolingOptions
from lmi_handler.config.serving import ServingOptions
from lmi_handler.config.settings import PARTS, SECRET_KEYS, Settings, check_option_names
from lmi_handler.config.slices import EngineConfig, LoraConfig, MpiLaunch, ParallelConfig, SpeculativeConfig

__all__ = [
    "DTYPES", "ENVIRONMENT_SWITCHES", "LORA_MODULES", "PARTS", "POOLING_MODES", "POOLING_TASKS", "TASKS", "RAY_LOOPBACK_SWITCH", "REPLICA_LOOPBACK_ENV",
    "SECRET_KEYS", "BatchOptions", "ChatOptions", "ConfigError", "EngineConfig", "EngineOptions", "LoraConfig",
    "LoraOptions", "ModelOptions", "MpiLaunch", "MultimodalOptions", "Options", "ParallelConfig", "PoolingOptions", "ServingOptions", "Settings",
    "SpeculativeConfig",
    "check_option_names", "keep_ray_on_loopback", "process_environment", "read_mpi_launch",
    "read_serving_properties", "triton_interpreted",
]
