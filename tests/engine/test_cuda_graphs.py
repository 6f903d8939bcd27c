"""engine/cuda_graphs.py on CPU: the padded batch sizes, which steps and models the graphs take, and the step a
CUDA graph records, run eagerly over its static buffers with padding rows, against the unpadded step (tiny
random Llama on the PyTorch reference backend; the Triton backend's run is tests/engine/triton/test_cuda_graphs.py).
Capture and replay themselves need CUDA (benchmarks/gpu_check.sh)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lmi_handler.config import EngineConfig
from lmi_handler.engine.cuda_graphs import graph_batch_sizes, graph_unfit
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import SamplingParams
from tests.engine.device_syncs import DeviceSyncs
from tests.engine.graph_helpers import assert_padded_step_equals_unpadded, decode_graphs, prefilled
from tests.engine.helpers import build_tiny_llama, build_tiny_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_tiny_llama(path)
    return path


def _runner(path, backend: str = "torch") -> tuple[ModelRunner, BlockAllocator]:
    runner = ModelRunner(path, torch.float32, CPU, block_size=4, num_blocks=48, kernel_backend=backend)
    return runner, BlockAllocator(runner.num_blocks, runner.block_size)


def test_graph_batch_sizes_are_powers_of_two_to_8_then_steps_of_8_then_16_ending_at_the_limit():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-3:] == [224, 240, 256]
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]) if b <= 128)
    assert all(b - a == 16 for a, b in zip(sizes, sizes[1:]) if a >= 128)


def test_only_the_triton_backend_on_cuda_is_captured_and_the_reason_is_given_otherwise(tiny_llama):
    runner, _ = _runner(tiny_llama)
    assert "not CUDA" in graph_unfit(runner.model, CPU)
    assert "kernel_backend=torch" in graph_unfit(runner.model, torch.device("cuda"))
    runner.model.kernel_backend = "triton"
    assert graph_unfit(runner.model, torch.device("cuda")) == ""
    assert runner.graphs is None           # a CPU runner never builds graphs: its steps run as before


def test_the_graph_step_runs_eagerly_on_cpu_with_padding_and_equals_the_unpadded_step(tiny_llama):
    """...and what that step would make a GPU wait for is the PyTorch reference's own doing (its per-sequence
    loops size tensors by the lengths' values), which is why graph_unfit keeps graphs to the Triton backend."""
    with DeviceSyncs(CPU) as probe:
        runner, allocator = _runner(tiny_llama)
        syncs = assert_padded_step_equals_unpadded(runner, allocator, probe)
    assert syncs and {s.file for s in syncs} == {"engine/model/backends/torch_ref.py"}


def test_the_graphs_take_only_decode_steps_that_fit_their_buffers(tiny_llama):
    runner, allocator = _runner(tiny_llama)
    seqs = prefilled(runner, allocator, [[1, 2, 3], [1, 4, 5, 6, 7, 8, 9, 10, 11]])
    graphs = decode_graphs(runner, max_num_seqs=2)
    assert graphs.takes(runner.prepare(SchedulerOutput(seqs=seqs, num_scheduled_tokens=[1, 1])))
    fresh = prefilled(runner, allocator, [[1, 2]])[0]
    fresh.num_computed_tokens = 0                                                  # a prefill of 3 rows
    assert not graphs.takes(runner.prepare(SchedulerOutput(seqs=[fresh], num_scheduled_tokens=[3])))
    assert not decode_graphs(runner, max_num_seqs=1).takes(
        runner.prepare(SchedulerOutput(seqs=seqs, num_scheduled_tokens=[1, 1])))     # more rows than the buffers
    narrow = decode_graphs(runner, max_num_seqs=2)
    narrow.max_blocks = 1                                                          # block tables wider than it
    assert not narrow.takes(runner.prepare(SchedulerOutput(seqs=seqs, num_scheduled_tokens=[1, 1])))


def test_an_engine_whose_decode_steps_go_through_the_graph_step_gives_the_same_tokens_and_logprobs(tiny_llama):
    """The runner's execute() routes decode steps to DecodeGraphs.run (eager on CPU): batches shrinking from
    3 sequences to 1 move through the sizes 4, 2 and 1, sampled rows included."""
    def engine(graphs: bool) -> Engine:
        config = EngineConfig(model_path=tiny_llama, dtype="float32", device_id=-1, max_num_seqs=4,
                              max_num_batched_tokens=64, max_model_len=None, block_size=4, kv_cache_bytes=1 << 20,
                              kernel_backend="torch")
        built = Engine(config, tokenizer=build_tiny_tokenizer())
        if graphs:
            built.runner.graphs = step_graphs = decode_graphs(built.runner, max_num_seqs=4)
            eager_step = step_graphs.step
            step_graphs.step = lambda size: sizes.append(size) or eager_step(size)
        return built

    sizes: list[int] = []

    prompts = [[1, 17, 300, 45, 9], [1, 250], [1, 5, 6, 7, 8, 9, 10, 11, 12]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, top_n_tokens=2) for n in (6, 4, 2)]
    params[1] = dataclasses.replace(params[1], greedy=False, temperature=0.8, seed=11)

    def tokens(e: Engine):
        out = e.generate([(f"r{i}", p, dataclasses.replace(q)) for i, (p, q) in enumerate(zip(prompts, params))])
        return {rid: [(t.id, t.log_prob, t.top_tokens) for o in outs for t in o.new_tokens] for rid, outs in out.items()}

    eager = tokens(engine(False))
    assert tokens(engine(True)) == eager
    assert [len(v) for v in eager.values()] == [6, 4, 2]
    assert sizes == [4, 2, 2, 1, 1]        # decode steps of 3, 2, 2, 1 and 1 sequences (the first token: prefill)
