"""The engine part of the settings: batch limits, the KV cache, devices and parallelism, kernels, memory.

Owns the options the decode loop runs by; settings.py turns them, with the model part's, into the
EngineConfig slice (slices.py) the engine receives.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from lmi_handler.config.base import Options
from lmi_handler.config.slices import SpeculativeConfig
from lmi_handler.model_source import local_model_dir


class EngineOptions(Options):
    """Engine: the continuous-batching decode loop, its KV cache, devices, kernels and memory."""

    max_rolling_batch_size: int = Field(32, ge=1, le=1024)
    """Most requests decoded together (vLLM max_num_seqs)."""
    max_rolling_batch_prefill_tokens: int = Field(1024, ge=16, le=1 << 20)
    """Token budget of one step (vLLM max_num_batched_tokens), in tokens; long prompts are prefilled in chunks of
    about this size, so a request arriving during a long prefill waits about one chunk's step for its first token."""
    max_model_len: int | None = Field(None, ge=16)
    """Context limit in tokens; default: the model's max_position_embeddings."""
    bf16_kernel: Literal["auto", "amx", "native", "fma"] = "auto"
    """CPU, bf16 weights: how the C++ linears multiply them (engine/model/kernels/bf16_form.py, bf16_dot_form).
    auto: AMX tiles where the CPU and the OS have them (the fastest at many sequences), else VDPBF16PS where
    it times faster, else the FMA form; amx / native: those where available; fma: two FMAs per pair. Each
    is batch-invariant on its own, but their last bits differ, so one is used at every batch size. Measured
    on a 2-core Intel Xeon with AMX: a batch-1 bf16 decode step 17-22 ms with fma against 22-26 with amx,
    a 64-row step's linears 133 ms against 33: fma suits one stream at a time. One choice per process
    (every engine started in it sets it; tensor-parallel ranks apply the same)."""
    device_id: int = -1
    """CUDA device index; -1 = cuda:0 when CUDA is present, else CPU."""
    tensor_parallel_degree: int | Literal["max"] = 1
    """Ranks the model is sharded over (tensor parallelism: one process per rank, each holding 1/degree of
    the weights and of the KV heads); `max` = every visible CUDA device, 1 on a CPU-only host (LMI). The env
    TENSOR_PARALLEL_DEGREE gives it when serving.properties does not (DJL). The model must divide by it
    (engine/parallel/layout.py, vLLM's rules), checked at start-up."""
    pipeline_parallel_degree: int = 1
    """Only 1: pipeline parallelism is not implemented (refused at start-up, naming this key)."""
    tensor_parallel_timeout_s: float = Field(60.0, gt=0)
    """Seconds one collective of a tensor-parallel step may wait for the other ranks; past it (a rank hung)
    the engine fails with RankFailed instead of hanging. A rank that dies is seen at once."""
    num_threads: int | Literal["auto"] = "auto"
    """CPU threads the engine computes with (torch's and the C++ kernels'), fixed when a number (1-1024). auto (or
    0): the cores of the process's affinity mask, no more than its cgroup's cpu.max quota in whole cores, then
    adapted while it runs: one thread fewer when its threads wait for a core more than a quarter of their runnable
    time (another process on the CPU), down to 1, and one more tried now and then, kept when faster; each change is
    logged (engine/threads.py)."""
    kernel_backend: Literal["auto", "cpp", "triton", "torch"] = "auto"
    """Which kernels run the model, chosen once at load and logged with why (engine/model/backend.py): cpp =
    the C++ CPU kernels, every family (Llama-shaped models, with RMSNorm pre-norm, SiLU and no window, cap or
    q/k norm, on the fused decoder stack; the others and tensor-parallel shards through the C++ ops one by one); triton = the Triton
    kernels (CUDA; CPU tensors under TRITON_INTERPRET=1); torch = the pure-PyTorch reference (any model, any
    device). auto: triton on CUDA, cpp on CPU where the kernels build, torch otherwise. An explicit choice that
    cannot run is refused at start-up, never replaced."""
    huge_pages: bool = True
    """CPU: packed weights and the KV cache in 2 MiB-aligned memory marked for transparent huge pages
    (engine/model/kernels.empty_huge). false turns it off; so does the environment variable LMI_HUGE_PAGES=0
    when the properties do not set it."""
    malloc_tuning: bool = True
    """CPU: fix glibc malloc's mmap and trim thresholds (32 MiB, 1 GiB) at engine start so the memory a step
    frees is reused by the next instead of being returned and faulted in again (engine/host_memory.py;
    measured: 9,184 page faults a 64-sequence bf16 decode step without it, none with it). Up to 1 GiB of
    freed memory may stay resident; false leaves malloc's own adaptive thresholds. A no-op under another
    malloc (e.g. tcmalloc in LD_PRELOAD). With huge_pages also on, `lmi-handler serve` / `batch` restart
    once with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (malloc's heap on huge pages; host_memory.py)."""
    block_size: int = Field(16, ge=1, le=256)
    """Tokens per KV-cache block."""
    enable_prefix_caching: bool = True
    """Share the KV blocks of a common prompt prefix (system prompt, chat template) between requests:
    full blocks keyed by a hash of their tokens and all before them, kept after their requests end and
    evicted least recently used when blocks run out. Outputs are unchanged by it; requests with
    decoder_input_details compute their whole prompt (vLLM: prompt log probs skip the cache)."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """Which waiting request runs next (vLLM's and LMI's option). fcfs: first come, first served; a request's
    `priority` other than 0 answers 400. priority: each request's `priority` (an integer, lower first, default
    0; OpenAI bodies and batch lines: `priority`, LMI and TGI bodies: `parameters.priority`) orders the server's
    waiting queue and the engine's by (priority, arrival); a waiting request of a better priority than one in a
    full batch joins it anyway, and when the KV cache or the batch is full a running request of a lower priority
    is preempted (recomputed later: its tokens do not change) for a waiting one of a higher priority.
    docs/serving.md#request-priority."""
    kv_cache_bytes: int = Field(1 << 30, ge=1 << 20)
    """KV-cache size in bytes (all layers, K and V). On CUDA gpu_memory_utilization sizes the cache instead,
    unless this is set and that is not."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, allow_inf_nan=False)
    """CUDA: the fraction of the GPU's memory this engine may use, in (0, 1] (vLLM's and LMI's option). The KV
    cache gets what is left of it after the weights, the CUDA graphs and a profiling forward of the largest
    step (engine/gpu_memory.py); too little left refuses the start naming the bytes. CPU: ignored
    (kv_cache_bytes)."""
    enforce_eager: bool = False
    """CUDA: run every step eagerly. false (default): decode steps replay CUDA graphs captured at start-up, one
    per padded batch size up to max_rolling_batch_size (engine/cuda_graphs.py); prefill and mixed steps run
    eagerly either way. CPU: ignored (no graphs)."""
    structured_output_compile_timeout_s: float = Field(30.0, gt=0.0, le=3600.0, allow_inf_nan=False)
    """Seconds a request's grammar (JSON schema, regex, choice, Lark) may take to compile, off the engine
    loop, before that request alone fails with an error; (0, 3600]."""
    fault_injection: str | None = None
    """Tests only: a rule making the engine step fail for chosen sequences (see engine/faults.py)."""

    # ---- speculative decoding (engine/speculative/; docs/speculative.md) --------------------------------------
    speculative_config: str | None = None
    """Speculative decoding, vLLM's JSON (docs/speculative.md): `method` ngram (prompt lookup over the prompt and
    the tokens so far) or draft_model (`model`: a checkpoint directory, absolute or relative to model_dir, sharing
    the target's tokenizer and vocabulary; a `model` without `method` means draft_model), `num_speculative_tokens`
    (tokens drafted per step, [1, 16], required), `prompt_lookup_min` / `prompt_lookup_max` (ngram lengths tried,
    longest first; one unset takes the other's value, both unset 5), `disable_by_batch_size` (above this many
    running sequences the step decodes plainly). The output is bitwise the plain decode's, tokens and log
    probs: speculation changes only the speed. Unset: no speculation."""
    speculative_draft_model: str | None = None
    """LMI's (lmi-dist) draft model option: a checkpoint directory (absolute or relative to model_dir) drafting
    speculative_length tokens per step; the same as speculative_config {"method": "draft_model", "model": ...}.
    Set one of the two."""
    speculative_length: int = Field(5, ge=1, le=16, validate_default=True)
    """LMI's: tokens the speculative_draft_model drafts per step, [1, 16] (with speculative_config, its
    num_speculative_tokens instead)."""

    @field_validator("speculative_config")
    @classmethod
    def _speculative_json(cls, value: str | None) -> str | None:
        if value is not None:
            parse_speculative_config(value)
        return value

    @field_validator("speculative_length")
    @classmethod
    def _one_speculation_source(cls, value: int, info: ValidationInfo) -> int:
        if info.data.get("speculative_config") is not None and info.data.get("speculative_draft_model") is not None:
            raise ValueError("set option.speculative_config or option.speculative_draft_model, not both")
        return value

    def speculative(self) -> SpeculativeConfig | None:
        """The engine's speculative slice (None: no speculation); relative draft paths resolved from model_dir."""
        if self.speculative_draft_model is not None:
            fields = {"method": "draft_model", "model": self.speculative_draft_model,
                      "num_speculative_tokens": self.speculative_length}
        elif self.speculative_config is not None:
            fields = parse_speculative_config(self.speculative_config)
        else:
            return None
        model = fields.pop("model", None)
        draft = local_model_dir(model, self.model_dir) if fields["method"] == "draft_model" else None
        return SpeculativeConfig(draft_model=draft, **fields)

    @field_validator("num_threads")
    @classmethod
    def _num_threads_range(cls, value):
        if isinstance(value, int) and not 0 <= value <= 1024:
            raise ValueError("num_threads must be auto or 0-1024")
        return value

    @field_validator("tensor_parallel_degree", mode="before")
    @classmethod
    def _degree(cls, value):
        if isinstance(value, str) and value.strip().lower() == "max":
            return "max"
        if isinstance(value, bool) or not str(value).strip().isdigit() or int(value) < 1:
            raise ValueError(f"tensor_parallel_degree must be a whole number >= 1 or max, got {value!r}")
        return int(value)

    @field_validator("pipeline_parallel_degree", mode="before")
    @classmethod
    def _no_pipeline(cls, value):
        if str(value).strip() != "1":
            raise ValueError(f"pipeline_parallel_degree={value!r} is not supported: only 1 (pipeline parallelism is "
                             "not implemented; shard the model with tensor_parallel_degree)")
        return 1

    @field_validator("gpu_memory_utilization", mode="before")
    @classmethod
    def _fraction(cls, value):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if isinstance(value, bool) or number is None or not 0.0 < number <= 1.0:
            raise ValueError(f"must be a fraction of the GPU's memory in (0, 1], got {value!r}")
        return number

    @field_validator("kernel_backend", "bf16_kernel", mode="before")
    @classmethod
    def _lower_choice(cls, value):
        return value.strip().lower() if isinstance(value, str) else value

    def _utilization(self) -> float | None:
        """gpu_memory_utilization, or None where kv_cache_bytes is set and it is not (that size then holds on CUDA)."""
        explicit = self.model_fields_set
        if "kv_cache_bytes" in explicit and "gpu_memory_utilization" not in explicit:
            return None
        return self.gpu_memory_utilization


SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size", "draft_tensor_parallel_size")


def parse_speculative_config(text: str) -> dict[str, Any]:
    """option.speculative_config (vLLM's JSON) as SpeculativeConfig's fields, `model` kept as written (a path).

    vLLM's rules: a `model` without `method` is a draft model ("ngram" / "[ngram]" as the model means ngram);
    ngram's prompt_lookup_min / _max default to each other, both unset to 5. Raises ValueError naming the key
    and what is allowed (pydantic turns it into ConfigError naming option.speculative_config)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"must be a JSON object (vLLM's speculative_config), got invalid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"must be a JSON object (vLLM's speculative_config), got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(_SPECULATIVE_KEYS)}")
    model, method = raw.get("model"), raw.get("method")
    if method is None and model in ("ngram", "[ngram]"):
        method, model = "ngram", None
    elif method is None and model is not None:
        method = "draft_model"
    if method not in SPECULATIVE_METHODS:
        shown = "no method (and no model)" if method is None else f"method {method!r}"
        raise ValueError(f"{shown}: served methods are {', '.join(SPECULATIVE_METHODS)} (eagle, eagle3, mtp, "
                         "medusa and suffix are not served here)")
    if method == "draft_model" and not (isinstance(model, str) and model.strip()):
        raise ValueError("method draft_model needs `model`: the draft checkpoint's directory")
    fields: dict[str, Any] = {"method": method, "model": model,
                              "num_speculative_tokens": _whole(raw, "num_speculative_tokens", 1, 16, required=True),
                              "disable_by_batch_size": _whole(raw, "disable_by_batch_size", 1, 1 << 20)}
    _whole(raw, "draft_tensor_parallel_size", 1, 1)      # the draft runs in this process, unsharded
    if method == "ngram":
        low, high = _whole(raw, "prompt_lookup_min", 1, 64), _whole(raw, "prompt_lookup_max", 1, 64)
        low, high = low or high or 5, high or low or 5
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        fields.update(prompt_lookup_min=low, prompt_lookup_max=high)
    return fields


def _whole(raw: dict[str, Any], key: str, low: int, high: int, required: bool = False) -> int | None:
    """raw[key] as a whole number in [low, high] (None when absent and not required). Raises ValueError."""
    value = raw.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key} must be a whole number in [{low}, {high}], got {value!r}")
    return value
