"""option.gpu_memory_utilization: the KV-cache arithmetic (engine/gpu_memory.py) as a pure function of byte
counts, its edge cases, the profiling forward it measures (run on CPU here: it must write nothing), and the
option's refusals and defaults (config.py)."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.config import ConfigError, Settings
from lmi_handler.engine.gpu_memory import kv_cache_blocks_for_gpu, profile_step, sampler_scratch_bytes
from lmi_handler.engine.model_runner import ModelRunner
from tests.engine.helpers import TINY_VOCAB, build_tiny_llama

GiB = 1 << 30
BLOCK = 1_572_864      # the demo model's block in bf16: 2 x 30 layers x 16 tokens x 3 KV heads x 64 x 2 bytes


def test_the_kv_cache_gets_the_utilization_share_less_what_is_in_use_the_activations_and_the_graphs():
    # an 80 GiB GPU, 1 GiB in use after the weights (and context), 2 GiB of activations, 0.5 GiB of graphs
    blocks = kv_cache_blocks_for_gpu(80 * GiB, 79 * GiB, 2 * GiB, GiB // 2, 0.9, BLOCK)
    assert blocks == (int(0.9 * 80 * GiB) - GiB - 2 * GiB - GiB // 2) // BLOCK
    # other processes' memory counts as in use: the same GPU half taken by someone else
    assert kv_cache_blocks_for_gpu(80 * GiB, 39 * GiB, 2 * GiB, GiB // 2, 0.9, BLOCK) == \
        (int(0.9 * 80 * GiB) - 41 * GiB - 2 * GiB - GiB // 2) // BLOCK
    # utilization 1.0: everything free goes to the cache after the activations and graphs
    assert kv_cache_blocks_for_gpu(80 * GiB, 79 * GiB, 0, 0, 1.0, BLOCK) == 79 * GiB // BLOCK


def test_exactly_one_block_left_is_one_block_and_one_byte_less_is_refused_naming_the_option_and_the_bytes():
    total, in_use, activations = 10_000_000, 2_000_000, 1_000_000
    allowed = int(0.5 * total)
    free = total - in_use
    exact = allowed - in_use - activations            # 2,000,000 bytes left
    assert kv_cache_blocks_for_gpu(total, free, activations, 0, 0.5, exact) == 1
    with pytest.raises(ConfigError) as err:
        kv_cache_blocks_for_gpu(total, free, activations, 0, 0.5, exact + 1)
    message = str(err.value)
    assert "option.gpu_memory_utilization=0.5" in message
    for number in (allowed, total, in_use, activations, exact, exact + 1):
        assert str(number) in message


def test_a_gpu_already_fuller_than_the_utilization_is_refused_with_a_negative_remainder():
    with pytest.raises(ConfigError, match=r"option.gpu_memory_utilization=0.3 .* leaves -"):
        kv_cache_blocks_for_gpu(80 * GiB, 40 * GiB, GiB, 0, 0.3, BLOCK)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_the_arithmetic_refuses_a_utilization_outside_zero_to_one(utilization):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kv_cache_blocks_for_gpu(80 * GiB, 79 * GiB, 0, 0, utilization, BLOCK)


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "nan", "inf", "most"])
def test_an_out_of_range_gpu_memory_utilization_is_refused_naming_the_option_and_its_range(value):
    with pytest.raises(ConfigError) as err:
        Settings.from_properties({"gpu_memory_utilization": value})
    assert str(err.value).startswith(f"option.gpu_memory_utilization='{value}'")
    assert "(0, 1]" in str(err.value)


def test_gpu_memory_utilization_defaults_to_0_9_and_an_explicit_kv_cache_bytes_alone_keeps_its_size_on_cuda():
    default = Settings.from_properties({})
    assert default.gpu_memory_utilization == 0.9 and default.engine_config().gpu_memory_utilization == 0.9
    assert default.engine_config().enforce_eager is False
    sized = Settings.from_properties({"kv_cache_bytes": str(64 << 20)}).engine_config()
    assert sized.gpu_memory_utilization is None and sized.kv_cache_bytes == 64 << 20
    both = Settings.from_properties({"kv_cache_bytes": str(64 << 20), "gpu_memory_utilization": "1"})
    assert both.engine_config().gpu_memory_utilization == 1.0
    assert Settings.from_properties({"enforce_eager": "true"}).engine_config().enforce_eager is True


def test_the_sampler_scratch_is_eight_float32_rows_of_the_vocabulary_per_sequence():
    assert sampler_scratch_bytes(256, 49152) == 8 * 256 * 49152 * 4


def test_the_profiling_forward_runs_the_largest_step_over_a_one_block_cache_and_writes_nothing(tmp_path):
    build_tiny_llama(tmp_path)
    runner = ModelRunner(tmp_path, torch.float32, torch.device("cpu"), block_size=4, num_blocks=1,
                         kernel_backend="torch")
    cache = torch.randn_like(runner.kv_cache)
    before = cache.clone()
    caches = [(layer[0], layer[1]) for layer in cache]
    prefill = profile_step(runner, caches, 1, 37)          # 37 rows attend over 10 blocks' worth of block 0
    decode = profile_step(runner, caches, 5, 1)
    assert prefill.shape == (37, TINY_VOCAB) and decode.shape == (5, TINY_VOCAB)
    assert torch.isfinite(prefill).all() and torch.isfinite(decode).all()
    assert torch.equal(cache, before)
