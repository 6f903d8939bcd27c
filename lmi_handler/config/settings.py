"""Settings: every part of the options composed into one validated, frozen object, read from handle()'s
properties (serving.properties + OPTION_* environment).

Owns the composition, the validation of a whole set of properties (ConfigError naming the key) and the
slices built from several parts; each option itself is its part's (model.py, engine.py, lora.py, serving.py,
chat.py, batch.py, pooling.py).
"""
from __future__ import annotations

import logging
from typing import Mapping

from pydantic import ValidationError

from lmi_handler.config.base import ConfigError
from lmi_handler.config.batch import BatchOptions
from lmi_handler.config.chat import ChatOptions
from lmi_handler.config.engine import EngineOptions
from lmi_handler.config.environment import add_environment_switches, read_mpi_launch
from lmi_handler.config.lora import LoraOptions
from lmi_handler.config.model import ModelOptions
from lmi_handler.config.multimodal import MultimodalOptions
from lmi_handler.config.pooling import PoolingOptions
from lmi_handler.config.serving import ServingOptions
from lmi_handler.config.slices import EngineConfig, ParallelConfig
from lmi_handler.model_source import hub_repo_id, local_model_dir
from lmi_handler.option_names import Kind, sort_key

logger = logging.getLogger("lmi_handler.config")      # the name the package's log lines have always carried

# The parts, in the order of docs/configuration.md's tables; a key belongs to the first part that has it
PARTS = (ModelOptions, EngineOptions, LoraOptions, ServingOptions, ChatOptions, MultimodalOptions, BatchOptions,
         PoolingOptions)
# Keys whose values are never echoed (a bad value's error message names the key only)
SECRET_KEYS = ("api_key",)


# Python lists the fields of the last base first: the parts in reverse give the fields in PARTS' order
# (validation too: a validator reads only fields of its own part, declared before its field).
class Settings(PoolingOptions, BatchOptions, MultimodalOptions, ChatOptions, ServingOptions, LoraOptions, EngineOptions,
               ModelOptions):
    """The model's properties as handle() receives them (serving.properties `option.*` keys, no prefix)."""

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The served names, first the primary one; when none are set, a Hub id as given (vLLM), else the
        model directory's name."""
        names = tuple(n.strip() for n in (self.served_model_name or "").split(",") if n.strip())
        return names or (hub_repo_id(self.model_id, self.model_dir)
                         or local_model_dir(self.model_id, self.model_dir).resolve().name,)

    def engine_config(self) -> EngineConfig:
        """The engine's slice: the model part's checkpoint and dtype, the engine part's limits, the LoRA slice."""
        return EngineConfig(model_path=self.model_path, dtype=self.dtype, device_id=self.device_id,
                            max_num_seqs=self.max_rolling_batch_size,
                            max_num_batched_tokens=max(self.max_rolling_batch_prefill_tokens,
                                                       self.max_rolling_batch_size),
                            max_model_len=self.max_model_len, block_size=self.block_size,
                            kv_cache_bytes=self.kv_cache_bytes, num_threads=0 if self.num_threads == "auto" else self.num_threads,
                            huge_pages=self.huge_pages,
                            malloc_tuning=self.malloc_tuning,
                            enable_prefix_caching=self.enable_prefix_caching, quantize=self.quantize,
                            scheduling_policy=self.scheduling_policy,
                            bf16_kernel=self.bf16_kernel, kernel_backend=self.kernel_backend,
                            model_impl=self.model_impl, trust_remote_code=self.trust_remote_code,
                            gpu_memory_utilization=self._utilization(), enforce_eager=self.enforce_eager,
                            structured_output_compile_timeout_s=self.structured_output_compile_timeout_s,
                            lora=self.lora_config(self.model_path), speculative=self.speculative(),
                            parallel=ParallelConfig(self.tensor_parallel_degree, self.tensor_parallel_timeout_s,
                                                    read_mpi_launch()))

    @classmethod
    def from_properties(cls, properties: Mapping[str, str], environ: Mapping[str, str] | None = None) -> "Settings":
        """Validate handle()'s init properties (or a serving.properties dict). Raises ConfigError.

        `environ` (default: this process's environment) gives the environment switches the properties do not set:
        LMI_HUGE_PAGES (huge_pages), LMI_API_KEY (api_key).
        """
        data = add_environment_switches({key.lower(): value for key, value in properties.items()
                                         if value is not None}, environ)
        check_option_names(data, cls.model_fields)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            key = ".".join(str(p) for p in first["loc"])
            shown = "<secret>" if key in SECRET_KEYS else repr(first.get("input"))
            raise ConfigError(f"option.{key}={shown}: {first['msg']}") from None


def check_option_names(data: Mapping[str, str], ours) -> None:
    """Every key that is not a field of ours (`ours`): a misspelling of one raises ConfigError naming the
    nearest; another engine's option (LMI's, vLLM's) and a key nothing resembles are logged by name, never
    dropped in silence; DJL's own keys pass (option_names.py)."""
    for key in sorted(data):
        kind, name = sort_key(key, ours)
        if kind is Kind.MISSPELT:
            raise ConfigError(f"option.{key} is not an option: did you mean option.{name}?")
        if kind is Kind.FOREIGN:
            logger.warning("option.%s is not served here (an option of LMI's or vLLM's engines): ignored%s", key,
                           f"; option.{name} does its job here" if name else "")
        elif kind is Kind.RETIRED:
            logger.warning("option.%s is retired: %s; ignored", key, name)
        elif kind is Kind.UNKNOWN:
            logger.warning("option.%s is not an option of this server: ignored%s", key,
                           f" (nearest known name: option.{name}, not served here either)" if name else "")
