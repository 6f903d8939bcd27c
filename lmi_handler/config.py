"""Settings: serving.properties + OPTION_* environment -> one validated, frozen settings object.

Owns every configuration key and the only reads of os.environ; each part gets its slice
(EngineConfig) as an argument. Per-request knobs are protocol/params.py's.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal, Mapping

import javaproperties
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, field_validator

from lmi_handler.model_source import ModelSourceError, hub_repo_id, local_model_dir, resolve_model
from lmi_handler.option_names import Kind, sort_key

DTYPES = {"auto": "auto", "fp32": "float32", "float32": "float32", "fp16": "float16",
          "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


logger = logging.getLogger(__name__)

# Settings keys an environment variable of their own gives when the properties do not (OPTION_* work for every key)
ENVIRONMENT_SWITCHES = {"huge_pages": "LMI_HUGE_PAGES", "api_key": "LMI_API_KEY", "model_id": "HF_MODEL_ID"}
# Keys whose values are never echoed (a bad value's error message names the key only)
SECRET_KEYS = ("api_key",)
# The projections a LoRA adapter may change (option.lora_target_modules); Phi-3 fuses qkv and gate_up
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj")


class ConfigError(ValueError):
    """A configuration key has a bad value; the message names the key and the allowed range."""


class Settings(BaseModel):
    """The model's properties as handle() receives them (serving.properties `option.*` keys, no prefix)."""

    # use_attribute_docstrings: each field's docstring is its description (docs/configuration.md's table)
    model_config = ConfigDict(frozen=True, extra="ignore", use_attribute_docstrings=True)

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
    model_dir: str = "."
    """Directory of serving.properties; relative model_id paths start here."""
    rolling_batch: str = "lmi_handler"
    """`disable` = dynamic batch; any other value = rolling batch on our engine."""
    max_rolling_batch_size: int = Field(32, ge=1, le=1024)
    """Most requests decoded together (vLLM max_num_seqs)."""
    max_rolling_batch_prefill_tokens: int = Field(1024, ge=16, le=1 << 20)
    """Token budget of one step (vLLM max_num_batched_tokens), in tokens; long prompts are prefilled in chunks of
    about this size, so a request arriving during a long prefill waits about one chunk's step for its first token."""
    max_model_len: int | None = Field(None, ge=16)
    """Context limit in tokens; default: the model's max_position_embeddings."""
    dtype: str = "auto"
    """auto | fp32 | fp16 | bf16 (also float32, float16, bfloat16). auto follows the checkpoint: on CPU a
    bf16/fp16 checkpoint runs in bf16 where the CPU has native bf16 dot products (AVX512_BF16 / AMX), else
    fp32; fp16 runs as bf16 on CPU; on CUDA auto is the checkpoint's fp16/bf16, else bf16
    (engine/precision.py)."""
    quantize: Literal["int8"] | None = None
    """Weight-only quantization at load: int8 = per-output-channel symmetric int8 weights, dequantized in
    the C++ CPU kernels (activations stay in `dtype`); CPU only. Unset or `none`: the checkpoint's weights."""
    bf16_kernel: Literal["auto", "amx", "native", "fma"] = "auto"
    """CPU, bf16 weights: how the C++ linears multiply them (engine/model/kernels/build.py, bf16_dot_form).
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
    num_threads: int = Field(0, ge=0, le=1024)
    """CPU threads for PyTorch (torch.set_num_threads); 0 = PyTorch's default. On a shared CPU, 1 avoids
    threads waiting on each other."""
    kernel_backend: Literal["auto", "cpp", "triton", "torch"] = "auto"
    """Which kernels run the model, chosen once at load and logged with why (engine/model/backend.py): cpp =
    the C++ CPU kernels, every family (Llama-shaped models, with RMSNorm pre-norm, SiLU and no window, cap or
    q/k norm, on the fused decoder stack; the others through the C++ ops one by one); triton = the Triton
    kernels (CUDA; CPU tensors under TRITON_INTERPRET=1); torch = the pure-PyTorch reference (any model, any
    device). auto: triton on CUDA, cpp on CPU where the kernels build, torch otherwise. An explicit choice that
    cannot run is refused at start-up, never replaced."""
    batch_invariant: bool = True
    """Bitwise-identical logits for a sequence alone or in any batch (fixed GEMM row tiles, one attention
    call per sequence). false matters only where llama.py runs (Llama-shaped models on the cpp backend, tensor
    parallelism on CUDA): plain GEMMs and one padded attention call, faster at large batches; the backends
    walking the layer description (triton, torch, the C++ ops of other families) compute each row alone either way."""
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
    output_formatter: Literal["json", "jsonlines", "sse"] | None = None
    """Response format: json | jsonlines | sse. Unset: json, jsonlines when streaming (sse with tgi_compat)."""
    enable_streaming: bool = False
    """LMI schema: every /invocations answer streams. Dynamic batch: a request's list of inputs answers
    `application/jsonlines` lines of {"outputs": [new text per input]}, token by token; rolling batch: LMI
    text and chat stream as with stream=true. Other routes keep their own rule."""
    tgi_compat: bool = False
    """TGI compatibility: non-streaming answers wrapped in a list; SSE is the streaming default; OpenAI streams
    end without `data: [DONE]` (TGI's client cannot parse it)."""
    served_model_name: str | None = None
    """Names the model answers to, comma-separated (vLLM's --served-model-name): the first is the one
    responses carry, every one is valid in /predictions/{name}. Unset: the model directory's name."""
    strict_model_name: bool = False
    """The OpenAI routes answer 404 for a `model` that is not a served name, as vLLM does. Unset (false): any
    `model` is answered by the loaded model, as TGI and LMI do (Hugging Face's InferenceClient sends "tgi").
    Batch lines always take any `model` (the batch input format: the loaded model answers)."""
    batch_size: int = Field(4, ge=1, le=1024)
    """Dynamic batch: most requests per handle() call (top-level serving.properties key)."""
    max_batch_delay: int = Field(100, ge=0, le=60_000)
    """Dynamic batch: milliseconds to wait for a batch to fill."""
    batch_dir: str = "batches"
    """Where /v1/files and /v1/batches keep their SQLite state and files; relative paths start at model_dir
    (the directory of serving.properties)."""
    batch_max_file_bytes: int = Field(200 << 20, ge=1)
    """Largest /v1/files upload in bytes (OpenAI's batch input limit, 200 MB); larger answers 413."""
    job_queue_size: int = Field(1000, ge=1, le=1 << 20)
    """Accepted requests waiting for a batch slot, at most (top-level key, env SERVING_JOB_QUEUE_SIZE, as DJL);
    past it a new request answers 503 at once."""
    request_timeout_s: float | None = Field(None, gt=0)
    """Seconds a request may spend in the server (waiting + running) before it ends with finish_reason error;
    unset = no deadline. The `X-Request-Timeout` header overrides it per request."""
    batch_max_total_bytes: int | None = Field(None, ge=1)
    """Quota in bytes for everything under batch_dir (uploads, result files, the SQLite state); an upload
    that would pass it answers 413 naming the limit, a job whose results would pass it fails naming it.
    Unset: no quota (the disk's own size is the limit)."""
    shutdown_grace_s: float = Field(30.0, ge=0)
    """SIGTERM: seconds to finish the accepted requests before the server exits anyway."""
    engine_dead_exit_s: float = Field(5.0, ge=0)
    """Seconds between the engine found dead (engine/health.py: a sticky CUDA error, a lost tensor-parallel
    rank, every step failing even alone) and the bundled server's process exiting with status 3, so that its
    supervisor restarts it (vLLM shuts down the same way). Meanwhile /ping and /health answer 503 and new
    requests 503. 0 keeps the process up, unhealthy, for debugging. DJL's container: handle() raises instead."""
    api_key: SecretStr | None = None
    """API keys, comma-separated: every route but /ping, /health (and /metrics, see metrics_require_key) then
    requires `Authorization: Bearer <key>` and answers 401 without one (vLLM's --api-key). Also the
    environment variable LMI_API_KEY when the properties do not set it (vLLM: VLLM_API_KEY), the place for a
    secret. Unset: every route is open, and the server says so at start-up. Never logged."""
    metrics_require_key: bool = False
    """With an API key set: /metrics requires it too. Default false: Prometheus scrapes without one."""
    enable_auto_tool_choice: bool = False
    """tool_choice "auto" (also the default when a chat request sends tools): the model decides and
    tool_call_parser finds its calls in the text (vLLM's --enable-auto-tool-choice). Off: such requests answer
    400 naming this option; "required" and a named tool always work (decoded under the tools' JSON schemas)."""
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = Field(None, validate_default=True)
    """The model family's tool-call format for tool_choice "auto" (vLLM's --tool-call-parser names): hermes
    (Qwen2.5, Qwen3, Hermes: <tool_call> blocks), llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS]),
    pythonic (Llama 3.2/4: [f(a=1)]). Required by enable_auto_tool_choice (protocol/tool_parsers.py)."""
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    """Split a reasoning model's <think>...</think> text into message.reasoning_content (streamed:
    delta.reasoning_content) and its answer into content (vLLM's --reasoning-parser names): deepseek_r1
    (DeepSeek-R1 and its distills: the output starts inside the reasoning), qwen3 (Qwen3: <think> opens it).
    Unset: the text is all content (protocol/reasoning.py)."""
    chat_template: str | None = None
    """The chat template instead of the tokenizer's: a file (absolute or relative to model_dir) or the Jinja
    template itself (text with {{ or {%); read and syntax-checked at start-up (vLLM's --chat-template)."""
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
    fault_injection: str | None = None
    """Tests only: a rule making the engine step fail for chosen sequences (see engine/faults.py)."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value.lower() not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {value!r}")
        return DTYPES[value.lower()]

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

    @field_validator("quantize", mode="before")
    @classmethod
    def _no_quantize(cls, value):
        if value is None:
            return None
        text = str(value).strip().lower()
        if text in ("", "none"):
            return None
        if text != "int8":
            raise ValueError(f"must be 'int8' (per-output-channel int8 weights) or 'none' / empty / unset (no "
                             f"quantization), got {value!r}")
        return text

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

    @field_validator("kernel_backend", mode="before")
    @classmethod
    def _lower_backend(cls, value):
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("rolling_batch")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.strip().lower()

    @field_validator("lora_target_modules")
    @classmethod
    def _known_modules(cls, value: str | None) -> str | None:
        names = _split_keys(value or "")
        unknown = sorted(set(names) - set(LORA_MODULES))
        if value is not None and (unknown or not names):
            raise ValueError(f"must name projections among {', '.join(LORA_MODULES)}, got {value!r}")
        return value

    @field_validator("lora_modules")
    @classmethod
    def _name_path_pairs(cls, value: str | None) -> str | None:
        for pair in _split_keys(value or ""):
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

    @field_validator("bf16_kernel", mode="before")
    @classmethod
    def _lower_kernel(cls, value):
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("tool_call_parser", "reasoning_parser", mode="before")
    @classmethod
    def _parser_name(cls, value):
        text = value.strip().lower() if isinstance(value, str) else value
        return None if text in ("", "none") else text

    @field_validator("tool_call_parser")
    @classmethod
    def _auto_tools_need_a_parser(cls, value, info):
        if info.data.get("enable_auto_tool_choice") and value is None:
            raise ValueError("enable_auto_tool_choice=true needs a tool_call_parser (one of hermes, llama3_json, "
                             "mistral, pythonic): the format the model writes its calls in")
        return value

    def chat_template_text(self) -> str | None:
        """option.chat_template as template text: the file's text when it names a file, else the value itself
        (a value with {{ or {% is a template). None when unset. Raises ConfigError for a value that is neither
        a readable file nor a template, or a template whose Jinja does not parse."""
        if self.chat_template is None:
            return None
        text = self.chat_template
        if "{{" not in text and "{%" not in text:
            path = Path(text) if Path(text).is_absolute() else Path(self.model_dir) / text
            if not path.is_file():
                raise ConfigError(f"option.chat_template={text!r}: not a file (looked at {path}) and not a Jinja "
                                  "template (no {{ or {%)")
            text = path.read_text(encoding="utf-8")
        import jinja2

        try:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"option.chat_template: the Jinja template does not parse: {exc.message} "
                              f"(line {exc.lineno})") from None
        return text

    @field_validator("api_key")
    @classmethod
    def _some_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not _split_keys(value.get_secret_value()):
            raise ValueError("api_key holds no key (comma-separated keys, none empty); unset it to serve openly")
        return value

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys (option.api_key / LMI_API_KEY split at commas); () = every route open."""
        return () if self.api_key is None else _split_keys(self.api_key.get_secret_value())

    @property
    def is_rolling(self) -> bool:
        return self.rolling_batch != "disable"

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The served names, first the primary one; when none are set, a Hub id as given (vLLM), else the
        model directory's name."""
        names = tuple(n.strip() for n in (self.served_model_name or "").split(",") if n.strip())
        return names or (hub_repo_id(self.model_id, self.model_dir)
                         or local_model_dir(self.model_id, self.model_dir).resolve().name,)

    @cached_property
    def model_path(self) -> Path:
        """The model's local directory, found once (model_source.resolve_model: a Hub id is downloaded into, or
        read from, the Hub cache on first use). Raises ConfigError naming option.model_id."""
        try:
            return resolve_model(self.model_id, self.model_dir, self.revision)
        except ModelSourceError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def lora_modules_list(self) -> tuple[tuple[str, Path], ...]:
        """option.lora_modules as (name, path) pairs, relative paths from model_dir."""
        pairs = (pair.partition("=") for pair in _split_keys(self.lora_modules or ""))
        return tuple((name.strip(), Path(self.model_dir) / path.strip()) for name, _, path in pairs)

    def lora_config(self) -> "LoraConfig | None":
        """The engine's LoRA slice; None when enable_lora is off."""
        if not self.enable_lora:
            return None
        roots = (self.model_path / "adapters",) + tuple(Path(self.model_dir) / r
                                                        for r in _split_keys(self.lora_adapter_roots or ""))
        targets = _split_keys(self.lora_target_modules) if self.lora_target_modules else None
        return LoraConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras or self.max_loras, target_modules=targets,
                          adapter_roots=roots)

    @property
    def batch_path(self) -> Path:
        path = Path(self.batch_dir)
        return path if path.is_absolute() else Path(self.model_dir) / path

    def engine_config(self) -> "EngineConfig":
        return EngineConfig(model_path=self.model_path, dtype=self.dtype, device_id=self.device_id,
                            max_num_seqs=self.max_rolling_batch_size,
                            max_num_batched_tokens=max(self.max_rolling_batch_prefill_tokens,
                                                       self.max_rolling_batch_size),
                            max_model_len=self.max_model_len, block_size=self.block_size,
                            kv_cache_bytes=self.kv_cache_bytes, num_threads=self.num_threads,
                            batch_invariant=self.batch_invariant, huge_pages=self.huge_pages,
                            malloc_tuning=self.malloc_tuning,
                            enable_prefix_caching=self.enable_prefix_caching, quantize=self.quantize,
                            bf16_kernel=self.bf16_kernel, kernel_backend=self.kernel_backend,
                            gpu_memory_utilization=self._utilization(), enforce_eager=self.enforce_eager,
                            structured_output_compile_timeout_s=self.structured_output_compile_timeout_s,
                            lora=self.lora_config(),
                            parallel=ParallelConfig(self.tensor_parallel_degree, self.tensor_parallel_timeout_s,
                                                    read_mpi_launch()))

    def _utilization(self) -> float | None:
        """gpu_memory_utilization, or None where kv_cache_bytes is set and it is not (that size then holds on CUDA)."""
        explicit = self.model_fields_set
        if "kv_cache_bytes" in explicit and "gpu_memory_utilization" not in explicit:
            return None
        return self.gpu_memory_utilization

    @classmethod
    def from_properties(cls, properties: Mapping[str, str], environ: Mapping[str, str] | None = None) -> "Settings":
        """Validate handle()'s init properties (or a serving.properties dict). Raises ConfigError.

        `environ` (default os.environ) gives the environment switches the properties do not set:
        LMI_HUGE_PAGES (huge_pages), LMI_API_KEY (api_key).
        """
        data = {key.lower(): value for key, value in properties.items() if value is not None}
        environ = os.environ if environ is None else environ
        for key, name in ENVIRONMENT_SWITCHES.items():
            if key not in data and environ.get(name) is not None:
                data[key] = environ[name]
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
        elif kind is Kind.UNKNOWN:
            logger.warning("option.%s is not an option of this server: ignored%s", key,
                           f" (nearest known name: option.{name}, not served here either)" if name else "")


def _split_keys(text: str) -> tuple[str, ...]:
    return tuple(key.strip() for key in text.split(",") if key.strip())


@dataclass(frozen=True)
class MpiLaunch:
    """This process's place in LMI's MPI launch (mpirun -np <degree>: DJL starts one Python engine per rank
    and gives ranks above 0 only the init call; CUDA_VISIBLE_DEVICES names the ranks' GPUs)."""

    rank: int              # OMPI_COMM_WORLD_RANK
    world_size: int        # OMPI_COMM_WORLD_SIZE
    local_rank: int        # OMPI_COMM_WORLD_LOCAL_RANK: this rank's CUDA device index
    master_addr: str       # MASTER_ADDR (DJL: 127.0.0.1): where rank 0 hosts the ranks' rendezvous
    master_port: int       # MASTER_PORT (DJL sets it)


def read_mpi_launch(environ: Mapping[str, str] | None = None) -> MpiLaunch | None:
    """The MPI launch this process is part of (OMPI_COMM_WORLD_RANK set), else None.

    Raises ConfigError when MASTER_PORT is missing or an OMPI_/MASTER_ value is not a number.
    """
    environ = os.environ if environ is None else environ
    if "OMPI_COMM_WORLD_RANK" not in environ:
        return None
    try:
        rank = int(environ["OMPI_COMM_WORLD_RANK"])
        return MpiLaunch(rank=rank, world_size=int(environ.get("OMPI_COMM_WORLD_SIZE", "1")),
                         local_rank=int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", str(rank))),
                         master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=int(environ["MASTER_PORT"]))
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"MPI launch (OMPI_COMM_WORLD_RANK={environ['OMPI_COMM_WORLD_RANK']!r}): needs numeric "
                          f"OMPI_COMM_WORLD_SIZE and MASTER_PORT ({exc})") from None


@dataclass(frozen=True)
class ParallelConfig:
    """The engine's tensor-parallel slice: the degree (`max` resolved at start-up), the step timeout, the launch."""

    tensor_parallel_degree: int | str = 1
    timeout_s: float = 60.0
    mpi: MpiLaunch | None = None


@dataclass(frozen=True)
class LoraConfig:
    """The engine's LoRA slice (option.enable_lora on): limits and where run-time loads may come from."""

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 4
    target_modules: tuple[str, ...] | None = None
    adapter_roots: tuple[Path, ...] = ()


@dataclass(frozen=True)
class EngineConfig:
    """The engine's slice of the settings."""

    model_path: Path
    dtype: str
    device_id: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    block_size: int
    kv_cache_bytes: int
    num_threads: int = 0
    batch_invariant: bool = True
    enable_prefix_caching: bool = True
    huge_pages: bool = True
    malloc_tuning: bool = True
    quantize: str | None = None
    bf16_kernel: str = "auto"
    kernel_backend: str = "auto"
    gpu_memory_utilization: float | None = None   # CUDA: size the KV cache by it (None: kv_cache_bytes)
    enforce_eager: bool = False                   # CUDA: no decode graphs
    structured_output_compile_timeout_s: float = 30.0
    lora: LoraConfig | None = None
    parallel: ParallelConfig = ParallelConfig()


# Ray on the loopback only (batch/cluster.py). Ray picks a node's address from its routes, and even turns an
# explicit 127.0.0.1 into the machine's outward address, unless this switch of Ray's is off; it is read when
# `ray` is first imported. The replicas' own tensor-parallel groups (gloo) rendezvous on the loopback too.
RAY_LOOPBACK_SWITCH = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
REPLICA_LOOPBACK_ENV = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}


def keep_ray_on_loopback() -> None:
    """Set Ray's switch (RAY_LOOPBACK_SWITCH) in this process before `ray` is imported, so a local cluster
    started here takes 127.0.0.1 as its node address and listens there only (the cluster's processes inherit
    it). The one environment write of the package; cluster.py checks the node address it got."""
    os.environ.update(RAY_LOOPBACK_SWITCH)


def triton_interpreted() -> bool:
    """TRITON_INTERPRET=1 (Triton's own switch): Triton kernels run in its interpreter, on CPU tensors too
    (tests). engine/model/backend.py lets option.kernel_backend=triton run on CPU only then."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def process_environment() -> dict[str, str]:
    """A copy of this process's environment variables, for what is not a setting: the GLIBC_TUNABLES that
    glibc reads at process start (engine/host_memory.py restarts a command with one added)."""
    return dict(os.environ)


def read_serving_properties(path: str | Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Read serving.properties and apply OPTION_* overrides, as the LMI container does.

    The file is Java's .properties format (DJL reads it with java.util.Properties): `key=value`,
    `key: value` and `key value` are all legal, as are `#`/`!` comments, backslash line
    continuations and \\uXXXX escapes. Values lose trailing whitespace. `option.foo=bar` becomes
    {"foo": "bar"}; top-level keys (batch_size, max_batch_delay, engine) are kept as they are; an
    environment variable OPTION_FOO=baz overrides option.foo (LMI: OPTION_<KEY> in upper case);
    SERVING_JOB_QUEUE_SIZE gives job_queue_size, and TENSOR_PARALLEL_DEGREE tensor_parallel_degree, when
    neither the file nor OPTION_* does (DJL's global settings).
    `model_dir` is set to the file's directory. A missing file gives just the environment overrides.
    Raises javaproperties.InvalidUEscapeError for a malformed \\u escape.
    """
    path = Path(path)
    props: dict[str, str] = {}
    if path.is_file():
        for key, value in javaproperties.loads(path.read_text(encoding="utf-8")).items():
            props[key[len("option."):] if key.startswith("option.") else key] = value.rstrip()
    environ = os.environ if environ is None else environ
    for key, value in environ.items():
        if key.startswith("OPTION_"):
            props[key[len("OPTION_"):].lower()] = value
    if "SERVING_JOB_QUEUE_SIZE" in environ:  # DJL's global default; a serving.properties key wins
        props.setdefault("job_queue_size", environ["SERVING_JOB_QUEUE_SIZE"])
    if "TENSOR_PARALLEL_DEGREE" in environ:  # DJL: used when option.tensor_parallel_degree is not set
        props.setdefault("tensor_parallel_degree", environ["TENSOR_PARALLEL_DEGREE"])
    props.setdefault("model_dir", str(path.parent.resolve()))
    return props
