"""The decode-graph step's check, shared by the PyTorch-reference test (tests/engine/test_cuda_graphs.py) and the
Triton one under the interpreter (tests/engine/triton/test_cuda_graphs.py): the step that CUDA graphs record,
run eagerly on CPU over its static buffers with a padding row, against the runner's unpadded step."""
from __future__ import annotations

import torch

from lmi_handler.engine.cuda_graphs import DecodeGraphs
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.scheduler import SchedulerOutput
from tests.engine.device_syncs import DeviceSyncs, Sync
from tests.engine.helpers import make_seq

PROMPTS = [[1, 17, 300, 45, 9], [1, 250], [1, 5, 6, 7, 8, 9, 10, 11, 12]]


def decode_graphs(runner, max_num_seqs: int) -> DecodeGraphs:
    """The runner's DecodeGraphs on CPU: nothing captured, so run() calls the step eagerly."""
    return DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, max_num_seqs, runner.num_blocks,
                        runner.config.vocab_size, runner.device)


def prefilled(runner, allocator: BlockAllocator, prompts: list[list[int]]):
    """Sequences whose prompts are in the KV cache, each with one greedy token appended: the next step of
    each is a decode."""
    seqs = [make_seq(p, allocator, len(p) + 4, f"r{i}") for i, p in enumerate(prompts)]
    out = runner.execute(runner.prepare(SchedulerOutput(seqs=seqs, num_scheduled_tokens=[len(p) for p in prompts])))
    for row, seq in enumerate(seqs):
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.output_token_ids.append(int(out.logits[row].argmax()))
    return seqs


def assert_padded_step_equals_unpadded(runner, allocator: BlockAllocator, probe: DeviceSyncs | None = None
                                       ) -> list[Sync]:
    """A decode step of 3 sequences through DecodeGraphs (padded to its 4-row size, the buffers' padding row
    left dirty by an earlier step of 4) gives the unpadded step's logits and tokens bit for bit and writes the
    same KV cache: the padding row writes nothing. Returns what the padded step would make the host wait for,
    as `probe` (the active DeviceSyncs mode, when given) saw it."""
    seqs = prefilled(runner, allocator, PROMPTS)
    model_input = runner.prepare(SchedulerOutput(seqs=seqs, num_scheduled_tokens=[1, 1, 1]))
    graphs = decode_graphs(runner, max_num_seqs=4)
    assert graphs.takes(model_input) and graphs.size_for(3) == 4
    spare = allocator.allocate(1)[0]                  # a block no sequence uses: a stale padding slot points at it
    graphs.input_ids[3], graphs.positions[3] = 7, 2
    graphs.slot_mapping[3], graphs.context_lens[3] = spare * runner.block_size + 1, 3

    before = runner.kv_cache.clone()
    unpadded = runner.execute(model_input).logits.clone()
    cache_unpadded = runner.kv_cache.clone()
    assert not torch.equal(cache_unpadded, before)    # the step wrote its rows' K/V
    runner.kv_cache.copy_(before)
    seen = len(probe.syncs) if probe is not None else 0
    padded = graphs.run(model_input).clone()
    syncs = probe.syncs[seen:] if probe is not None else []

    assert padded.shape == unpadded.shape == (3, runner.config.vocab_size)
    assert torch.equal(padded, unpadded), f"max abs diff {(padded - unpadded).abs().max().item()}"
    assert torch.equal(padded.argmax(-1), unpadded.argmax(-1))
    assert torch.equal(runner.kv_cache, cache_unpadded)
    assert graphs.slot_mapping[3].item() == -1 and graphs.context_lens[3].item() == 0
    return syncs
