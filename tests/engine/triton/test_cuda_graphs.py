"""The step a CUDA graph records (engine/cuda_graphs.py), on option.kernel_backend=triton, run eagerly over its
static buffers with a padding row: bitwise the unpadded step's logits, and the padding row writes nothing to
the KV cache (under Triton's interpreter here; compiled on a GPU). Capture and replay need CUDA."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.backends import triton as tb
from lmi_handler.engine.model_runner import ModelRunner
from tests.engine.device_syncs import DeviceSyncs
from tests.engine.graph_helpers import assert_padded_step_equals_unpadded
from tests.engine.helpers import build_tiny_llama

pytestmark = pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)")


def test_the_triton_graph_step_with_padding_equals_the_unpadded_step_and_never_waits_for_the_device(
        tmp_path, device):
    """...and, followed by DeviceSyncs from the model's load on, the step reads nothing back, sizes nothing by
    a device tensor's values and makes no blocking copy: what a CUDA graph's capture requires (a sync inside
    it fails the capture) and what lets a replayed step run ahead of the host."""
    build_tiny_llama(tmp_path, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    with DeviceSyncs(device) as probe:
        runner = ModelRunner(tmp_path, torch.float32, device, block_size=4, num_blocks=32, kernel_backend="triton")
        assert runner.model.ops is tb and runner.graphs is None      # enforce_eager by default when built directly
        syncs = assert_padded_step_equals_unpadded(runner, BlockAllocator(runner.num_blocks, runner.block_size), probe)
    assert syncs == []


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (gpu_check.sh runs it)")


@cuda_only
def test_on_cuda_a_replayed_decode_graph_gives_the_eager_steps_bits_and_cache(tmp_path):
    """Captured at start-up (sizes 1, 2, 4), replayed for a decode step of 3 sequences: the logits and the KV
    cache bitwise those of the same step run eagerly (graphs off)."""
    from lmi_handler.engine.scheduler import SchedulerOutput
    from tests.engine.graph_helpers import PROMPTS, prefilled

    build_tiny_llama(tmp_path, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    runner = ModelRunner(tmp_path, torch.float32, torch.device("cuda"), block_size=4, num_blocks=32,
                         kernel_backend="triton", enforce_eager=False, max_num_seqs=4)
    assert runner.graphs is not None and sorted(runner.graphs.graphs) == [1, 2, 4]
    seqs = prefilled(runner, BlockAllocator(runner.num_blocks, runner.block_size), PROMPTS)
    sched = SchedulerOutput(seqs=seqs, num_scheduled_tokens=[1, 1, 1])
    before = runner.kv_cache.clone()
    replayed = runner.execute(runner.prepare(sched)).logits.clone()
    cache_replayed = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    graphs, runner.graphs = runner.graphs, None
    eager = runner.execute(runner.prepare(sched)).logits
    runner.graphs = graphs
    assert torch.equal(replayed, eager) and torch.equal(runner.kv_cache, cache_replayed)


@cuda_only
def test_on_cuda_gpu_memory_utilization_sizes_the_kv_cache_and_too_little_is_refused(tmp_path):
    from lmi_handler.config import ConfigError

    build_tiny_llama(tmp_path, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    free, total = torch.cuda.mem_get_info()
    runner = ModelRunner(tmp_path, torch.float32, torch.device("cuda"), block_size=4, kernel_backend="triton",
                         gpu_memory_utilization=(total - free) / total + 0.05, enforce_eager=False, max_num_seqs=4)
    assert runner.num_blocks * runner.kv_cache[0, 0, 0].nbytes * runner.kv_cache.shape[0] * 2 < 0.05 * total
    assert runner.num_blocks > 1000
    del runner
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(ConfigError, match="option.gpu_memory_utilization"):
        ModelRunner(tmp_path, torch.float32, torch.device("cuda"), block_size=4, kernel_backend="triton",
                    gpu_memory_utilization=max((total - free) / total - 0.01, 0.001))


@cuda_only
def test_on_cuda_a_steady_decode_step_on_graphs_syncs_the_host_once_for_its_sampled_ids(tmp_path):
    """torch's sync debug mode counts the synchronizing CUDA calls of four decode steps of three sequences
    (graphs replayed, tokens picked by the Triton sampler, stop checks on the device): one each, the copy of
    the step's results to the host (output_processor._to_host)."""
    import warnings

    from lmi_handler.config import EngineConfig
    from lmi_handler.engine.engine import Engine
    from lmi_handler.engine.sequence import SamplingParams
    from tests.engine.graph_helpers import PROMPTS
    from tests.engine.helpers import build_tiny_tokenizer

    build_tiny_llama(tmp_path, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    config = EngineConfig(model_path=tmp_path, dtype="float32", device_id=0, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=None, block_size=4, kv_cache_bytes=1 << 20, kernel_backend="triton")
    engine = Engine(config, tokenizer=build_tiny_tokenizer())
    assert engine.runner.graphs is not None and engine.sampler.ops is tb
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for _ in range(3):                 # the prefill, then decode steps (the sampling tables built, then advanced)
        engine.step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(4):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 4, syncs
