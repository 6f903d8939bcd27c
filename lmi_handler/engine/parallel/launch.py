"""How an engine's model runner comes up: one process (ModelRunner), or a tensor-parallel group whose rank 0
is this process (followers spawned here, or started by LMI's MPI launch).

Owns turning EngineConfig's parallel slice into a runner (start_runner), the RunnerSpec of our model
(ModelRunnerSpec) and the MPI follower entry (run_mpi_follower, from handle()'s init call on ranks > 0);
leaves the group mechanics to executor.py / worker.py and the shard's forward to the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmi_handler.config import ConfigError, EngineConfig
from lmi_handler.engine.host_memory import keep_freed_memory
from lmi_handler.engine.parallel.executor import (
    RankContext,
    WorkerArgs,
    resolve_degree,
    start_tensor_parallel,
    threads_per_rank,
)
from lmi_handler.engine.parallel.group import Rendezvous
from lmi_handler.engine.parallel.layout import ShardLayout, check_degree
from lmi_handler.engine.precision import Precision, pick_precision

CPU = torch.device("cpu")


@dataclass(frozen=True)
class ModelRunnerSpec:
    """Every rank's ModelRunner over its shard of config.model_path (RunnerSpec; picklable)."""

    config: EngineConfig
    precision: Precision      # rank 0's decision (precision.pick_precision), the same on every rank

    def _spec(self):
        from lmi_handler.engine.model.loader import read_config, spec_from_config

        return spec_from_config(read_config(self.config.model_path))

    def check(self, degree: int, device: torch.device = CPU) -> None:
        """Refuse a degree the model cannot be split by, or a kernel backend that cannot run on `device` (rank
        0's; every backend shards every family: forward.DecoderModel's walk, engine/model/backend.py), before
        any rank starts. Raises ConfigError."""
        from lmi_handler.engine.model.loader import read_config
        from lmi_handler.engine.model.model_impl import choose_impl

        impl = choose_impl(read_config(self.config.model_path), self.config.model_impl, self.config.trust_remote_code)
        if impl.fallback and degree > 1:
            raise ConfigError(f"option.tensor_parallel_degree={degree}: the transformers implementation ({impl.why}) "
                              "runs in one process; tensor parallelism runs the native families")
        spec = self._spec()
        check_degree(spec, degree)
        if degree > 1:
            from lmi_handler.engine.model.backend import choose_backend

            choose_backend(self.config.kernel_backend, spec, device, tensor_parallel=True,
                           quantize=self.precision.quantize)

    def num_blocks_fit(self, rank: int, degree: int) -> int:
        """kv_cache_bytes (per rank) over one block of this rank's KV heads (model_runner.kv_block_bytes)."""
        from lmi_handler.engine.model_runner import kv_block_bytes

        spec = self._spec()
        layout = ShardLayout.of(spec, rank, degree)
        return self.config.kv_cache_bytes // kv_block_bytes(spec.num_layers, self.config.block_size,
                                                            layout.num_kv_heads, spec.head_dim, self.precision.dtype)

    def build(self, context: RankContext, num_blocks: int):
        """This rank's ModelRunner: its shard of the checkpoint (loader.load_model(layout): forward.DecoderModel
        on the chosen backend), packed as the precision says, `num_blocks` KV blocks of its own KV heads, the
        group's collectives in its forward."""
        layout = ShardLayout.of(self._spec(), context.rank, context.degree)
        return model_runner(self.config, self.precision, context.device, num_blocks=num_blocks, layout=layout,
                            group=context.group)


def model_runner(config: EngineConfig, precision: Precision, device: torch.device, **size_and_shard):
    """A ModelRunner of config's model in `precision` on `device`, the options every rank shares applied;
    `size_and_shard`: kv_cache_bytes and gpu_memory_utilization (one process) or num_blocks, layout and group (a
    tensor-parallel rank). option.enforce_eager and the batch limits reach the runner's CUDA graphs.
    On CPU with option.malloc_tuning, this rank's process first fixes malloc's thresholds (host_memory);
    on CPU it sets the process's bf16 linear kernel to option.bf16_kernel (kernels.bf16_form.choose_bf16_dot)."""
    from lmi_handler.engine.model_runner import ModelRunner

    if device.type == "cpu" and config.malloc_tuning:
        keep_freed_memory(config.huge_pages)
    if device.type == "cpu":
        from lmi_handler.engine.model.kernels import choose_bf16_dot

        choose_bf16_dot(config.bf16_kernel)

    return ModelRunner(config.model_path, precision.dtype, device, block_size=config.block_size,
                       huge_pages=config.huge_pages,
                       quantize=precision.quantize, kernel_backend=config.kernel_backend,
                       model_impl=config.model_impl, trust_remote_code=config.trust_remote_code,
                       enforce_eager=config.enforce_eager, max_num_seqs=config.max_num_seqs,
                       max_num_batched_tokens=config.max_num_batched_tokens, **size_and_shard)


def _degree(config: EngineConfig) -> int:
    """The resolved degree; under MPI it must equal the launch's world size. Raises ConfigError."""
    parallel = config.parallel
    degree = resolve_degree(parallel.tensor_parallel_degree)
    if parallel.mpi is not None and parallel.mpi.world_size != degree:
        raise ConfigError(f"option.tensor_parallel_degree={parallel.tensor_parallel_degree} but the MPI launch has "
                          f"{parallel.mpi.world_size} ranks (OMPI_COMM_WORLD_SIZE); they must be equal")
    return degree


def start_runner(config: EngineConfig, device: torch.device, precision: Precision):
    """The engine's runner: a ModelRunner at degree 1, else a TensorParallelExecutor (rank 0 of the group:
    start-up checks, followers spawned unless MPI launched them, shards loaded).

    Raises: ConfigError (degree refused by the model's shape, or not the MPI world size), RankFailed.
    """
    degree = _degree(config)
    if degree == 1:
        return model_runner(config, precision, device, kv_cache_bytes=config.kv_cache_bytes,
                            gpu_memory_utilization=config.gpu_memory_utilization)
    return start_tensor_parallel(ModelRunnerSpec(config, precision), degree, device, config.parallel.timeout_s,
                                 num_threads=config.num_threads, mpi=config.parallel.mpi)


def run_mpi_follower(config: EngineConfig) -> None:
    """Rank > 0 of LMI's MPI launch (from handle()'s init call): join rank 0 at MASTER_ADDR:MASTER_PORT,
    load this rank's shard, replay rank 0's steps; returns when rank 0 shuts down.

    Raises: ConfigError as start_runner; SystemExit(1) when loading or a step fails (worker.run_follower).
    """
    from lmi_handler.engine.parallel.executor import START_TIMEOUT_S
    from lmi_handler.engine.parallel.worker import run_follower

    mpi, degree = config.parallel.mpi, _degree(config)
    device = torch.device("cuda", mpi.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    precision = pick_precision(config, device)
    rendezvous = Rendezvous(mpi.master_addr, mpi.master_port, degree, config.parallel.timeout_s, START_TIMEOUT_S)
    run_follower(WorkerArgs(mpi.rank, rendezvous, ModelRunnerSpec(config, precision), str(device),
                            threads_per_rank(degree, config.num_threads)))


