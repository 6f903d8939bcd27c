"""The slices of the settings each part of the engine receives as an argument: plain frozen dataclasses.

Owns their shapes only; settings.py fills them from the options (Settings.engine_config), and the MPI launch
comes from environment.py's read_mpi_launch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MpiLaunch:
    """This process's place in LMI's MPI launch (mpirun -np <degree>: DJL starts one Python engine per rank
    and gives ranks above 0 only the init call; CUDA_VISIBLE_DEVICES names the ranks' GPUs)."""

    rank: int              # OMPI_COMM_WORLD_RANK
    world_size: int        # OMPI_COMM_WORLD_SIZE
    local_rank: int        # OMPI_COMM_WORLD_LOCAL_RANK: this rank's CUDA device index
    master_addr: str       # MASTER_ADDR (DJL: 127.0.0.1): where rank 0 hosts the ranks' rendezvous
    master_port: int       # MASTER_PORT (DJL sets it)


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
class SpeculativeConfig:
    """The engine's speculative-decoding slice (option.speculative_config or speculative_draft_model)."""

    method: str                            # "ngram" | "draft_model"
    num_speculative_tokens: int            # k: tokens drafted (and verified) per step for a row
    prompt_lookup_min: int = 5             # ngram: shortest suffix looked up
    prompt_lookup_max: int = 5             # ngram: longest suffix looked up (tried first)
    draft_model: Path | None = None        # draft_model: the checkpoint's directory
    disable_by_batch_size: int | None = None   # above this many running sequences, plain decode


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
    num_threads: int = 0                           # 0: auto (engine/threads.py)
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"                # "fcfs" or "priority" (engine/scheduler.py)
    huge_pages: bool = True
    malloc_tuning: bool = True
    quantize: str | None = None
    bf16_kernel: str = "auto"
    kernel_backend: str = "auto"
    model_impl: str = "auto"                      # auto | native | transformers (engine/model/model_impl.py)
    trust_remote_code: bool = False
    gpu_memory_utilization: float | None = None   # CUDA: size the KV cache by it (None: kv_cache_bytes)
    enforce_eager: bool = False                   # CUDA: no decode graphs
    structured_output_compile_timeout_s: float = 30.0
    lora: LoraConfig | None = None
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig | None = None
