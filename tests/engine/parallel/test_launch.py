"""Bringing up an engine's runner under option.tensor_parallel_degree (engine/parallel/launch.py): the degree is
resolved (`max`) and checked against the model before any process starts, and under LMI's MPI launch against
the launch's world size; each rank's KV capacity counts only its own KV heads."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lmi_handler.config import ConfigError, EngineConfig, MpiLaunch, ParallelConfig, Settings
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.parallel.executor import resolve_degree
from lmi_handler.engine.parallel.launch import ModelRunnerSpec
from lmi_handler.engine.precision import Precision


def tiny_config(model_dir, degree=1, mpi=None, **kwargs) -> EngineConfig:
    return EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=4, max_num_batched_tokens=64,
                        max_model_len=None, block_size=4, kv_cache_bytes=1 << 20,
                        parallel=ParallelConfig(degree, 5.0, mpi), **kwargs)


def test_max_is_every_cuda_device_and_1_on_a_cpu_only_host(tiny_model_dir, tiny_tokenizer):
    assert resolve_degree("max") == (torch.cuda.device_count() if torch.cuda.is_available() else 1)
    assert resolve_degree(3) == 3
    if not torch.cuda.is_available():
        engine = Engine(tiny_config(tiny_model_dir, "max"), tokenizer=tiny_tokenizer)
        assert isinstance(engine.runner, ModelRunner) and engine.runner.failure() is None


def test_a_degree_the_tiny_model_cannot_take_is_refused_at_engine_start(tiny_model_dir, tiny_tokenizer):
    # 4 query heads, 2 KV heads: 3 divides neither
    with pytest.raises(ConfigError, match=r"Total number of attention heads \(4\) must be divisible by tensor "
                                          r"parallel size \(3\)\..*Degrees this model takes: 1, 2, 4\."):
        Engine(tiny_config(tiny_model_dir, 3), tokenizer=tiny_tokenizer)


def test_under_mpi_the_degree_must_be_the_launchs_world_size(tiny_model_dir, tiny_tokenizer):
    mpi = MpiLaunch(rank=0, world_size=4, local_rank=0, master_addr="127.0.0.1", master_port=1)
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree=2 but the MPI launch has 4 ranks"):
        Engine(tiny_config(tiny_model_dir, 2, mpi), tokenizer=tiny_tokenizer)


def test_each_rank_sizes_its_kv_cache_by_its_own_kv_heads(tiny_model_dir):
    spec = ModelRunnerSpec(tiny_config(tiny_model_dir), Precision(torch.float32, None, "test"))
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4      # (K, V) x layers x block_size x kv heads x head_dim x fp32
    assert spec.num_blocks_fit(0, 1) == (1 << 20) // block_bytes
    assert spec.num_blocks_fit(1, 2) == (1 << 20) // (block_bytes // 2)       # 1 KV head per rank
    assert spec.num_blocks_fit(3, 4) == spec.num_blocks_fit(1, 2)             # replicated: still 1 per rank


@pytest.mark.slow
def test_handle_refuses_tensor_parallel_degree_2_on_the_demo_model_with_the_divisibility_message(model_dir):
    from lmi_handler.djl import OwnInput
    from lmi_handler.handler import Handler

    with pytest.raises(ConfigError, match=r"^option\.tensor_parallel_degree=2: Total number of attention heads \(9\) "
                                          r"must be divisible by tensor parallel size \(2\)\."):
        Handler().handle(OwnInput({"model_id": str(model_dir), "tensor_parallel_degree": "2"}))


@pytest.mark.slow
def test_a_sequences_logits_are_bitwise_the_same_alone_and_in_a_batch_at_degree_3(model_dir):
    """Batch invariance under TP: the all-reduce adds the ranks' partials in rank order, so at degree 3 on
    the demo model a sequence's logits alone and beside other prefills and decodes are bitwise equal."""
    from lmi_handler.engine.kv_cache import BlockAllocator
    from lmi_handler.engine.parallel.launch import start_runner
    from tests.engine.helpers import assert_logits_bitwise_identical_alone_and_in_batch

    config = dataclasses.replace(tiny_config(model_dir, 3), block_size=16, kv_cache_bytes=32 << 20)
    runner = start_runner(config, torch.device("cpu"), Precision(torch.float32, None, "test"))
    try:
        allocator = BlockAllocator(runner.num_blocks, runner.block_size)
        assert_logits_bitwise_identical_alone_and_in_batch(
            runner, allocator, [1, 504, 3250, 314, 260, 1123, 28], [list(range(100, 160)), [1, 42, 7]], 4, chunks=[16, 3])
    finally:
        runner.close()


def test_the_engine_config_keeps_its_parallel_slice():
    config = Settings.from_properties({"tensor_parallel_degree": "max", "tensor_parallel_timeout_s": "7"}).engine_config()
    assert config.parallel.tensor_parallel_degree == "max" and config.parallel.timeout_s == 7.0
    assert dataclasses.replace(config, parallel=ParallelConfig()).parallel.tensor_parallel_degree == 1
