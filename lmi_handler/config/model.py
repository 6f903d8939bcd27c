"""The model part of the settings: which checkpoint is served, from where, in which dtype and quantization.

Owns option.model_id, revision, generation_config, dtype, quantize, model_impl, trust_remote_code (model_dir is
base.py's) and finding the model's directory; how the weights are then run is engine.py's part.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import field_validator

from lmi_handler.config.base import ConfigError, Options
from lmi_handler.model_source import ModelSourceError, resolve_model

QUANTIZE_VALUES = ("int8", "int4", "gptq", "awq", "compressed-tensors", "fp8")   # option.quantize (precision.py)
DTYPES = {"auto": "auto", "fp32": "float32", "float32": "float32", "fp16": "float16",
          "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


class ModelOptions(Options):
    """Model: what is served and how its weights are read."""

    model_id: str = "model"
    """The model: a directory (config.json + safetensors + tokenizer), absolute or relative to model_dir, or a
    Hugging Face Hub id (org/name) fetched with huggingface_hub into its cache (HF_HOME; with HF_HUB_OFFLINE=1
    only the cache is read). An existing directory wins over a Hub id of the same spelling. The environment
    variable HF_MODEL_ID gives it when the properties do not (LMI). docs/model-sources.md."""
    revision: str | None = None
    """Hub ids only: the branch, tag or commit to serve; unset: the repository's default branch (main)."""
    generation_config: Literal["auto", "vllm"] = "auto"
    """auto: the checkpoint's generation_config.json sampling values (temperature, top_p, top_k, min_p,
    repetition_penalty) stand in for those a request leaves out, by the rule of docs/model-sources.md (OpenAI
    routes: vLLM's; LMI, TGI and batch lines: only when the request samples). vllm: they are not read (vLLM's
    `--generation-config vllm`); the schema's own defaults apply."""
    dtype: str = "auto"
    """auto | fp32 | fp16 | bf16 (also float32, float16, bfloat16). auto follows the checkpoint: on CPU a
    bf16/fp16 checkpoint runs in bf16 where the CPU has native bf16 dot products (AVX512_BF16 / AMX), else
    fp32; fp16 runs as bf16 on CPU; on CUDA auto is the checkpoint's fp16/bf16, else bf16
    (engine/precision.py)."""
    quantize: Literal["int8", "int4", "gptq", "awq", "compressed-tensors", "fp8"] | None = None
    """Weight quantization: int8 = per-output-channel symmetric int8 weights, int4 = 4-bit codes with a scale and
    zero point per 32 inputs, each quantized at load and dequantized in the C++ CPU kernels (activations stay in
    `dtype`); CPU only. gptq, awq, compressed-tensors, fp8 (LMI's spelling) name a pre-quantized checkpoint's
    method, which must match its config.json quantization_config (fp8 also a compressed-tensors FP8 one, and on a
    float checkpoint rounds its layer linears to e4m3 at load; detected without it too: docs/quantization.md).
    Unset or `none`: the checkpoint's weights."""

    model_impl: Literal["auto", "native", "transformers"] = "auto"
    """Which implementation runs the model (vLLM's option; its `vllm` is `native` here). native: this engine's
    layer description, for the families of docs/models.md; transformers: transformers' own AutoModelForCausalLM
    with this engine's paged attention registered into its attention interface (the scheduler, paged KV cache,
    prefix caching, chunked prefill and sampler as for a native model; no int8, LoRA or tensor parallelism),
    for any decoder-only model whose attention goes through that interface; auto: native where the model_type
    has a layer description, else transformers. Which one runs, and why, is logged at start-up; a model neither
    serves is refused there naming its model_type (engine/model/model_impl.py)."""
    trust_remote_code: bool = False
    """Run modelling code that ships inside the checkpoint (config.json's auto_map) through the transformers
    implementation, for a model_type transformers does not know. Off: such a checkpoint is refused at start-up."""

    @field_validator("model_impl", mode="before")
    @classmethod
    def _lower_impl(cls, value):
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value.lower() not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {value!r}")
        return DTYPES[value.lower()]

    @field_validator("quantize", mode="before")
    @classmethod
    def _no_quantize(cls, value):
        if value is None:
            return None
        text = str(value).strip().lower()
        if text in ("", "none"):
            return None
        if text not in QUANTIZE_VALUES:
            raise ValueError(f"must be one of {list(QUANTIZE_VALUES)} (int8 / int4: quantized at load; the others "
                             f"name a pre-quantized checkpoint's method) or 'none' / empty / unset (no "
                             f"quantization), got {value!r}")
        return text

    @cached_property
    def model_path(self) -> Path:
        """The model's local directory, found once (model_source.resolve_model: a Hub id is downloaded into, or
        read from, the Hub cache on first use). Raises ConfigError naming option.model_id."""
        try:
            return resolve_model(self.model_id, self.model_dir, self.revision)
        except ModelSourceError as exc:
            raise ConfigError(str(exc)) from None
