"""ModelInput, the step contract: built by ModelRunner.prepare from a hand-made SchedulerOutput, picklable,
shaped by the batch composition only, and its slot mapping equal to the per-token reference."""
from __future__ import annotations

import pickle
import random

import pytest
import torch

from lmi_handler.engine.kv_cache import BlockAllocator, build_slot_mapping
from lmi_handler.engine.model_runner import ModelInput, ModelRunner
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import SamplingParams, Sequence

BLOCK = 4


def reference_slot_mapping(tables: list[list[int]], starts: list[int], lengths: list[int]) -> list[int]:
    """The definition, one token at a time: position p lives in block table[p // B] at offset p % B."""
    return [table[p // BLOCK] * BLOCK + p % BLOCK
            for table, start, n in zip(tables, starts, lengths) for p in range(start, start + n)]


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(tiny_model_dir, torch.float32, torch.device("cpu"), block_size=BLOCK, num_blocks=64)


def seq(request_id: str, prompt: list[int], output: list[int], computed: int, blocks: list[int],
        prompt_logprobs: bool = False) -> Sequence:
    s = Sequence(request_id, prompt, SamplingParams(prompt_logprobs=prompt_logprobs), output_token_ids=output)
    s.num_computed_tokens, s.block_table = computed, blocks
    return s


def mixed_step() -> SchedulerOutput:
    """A decode, a short prompt-logprob chunk, a long (large-tile) chunk and a recompute spanning prompt and
    output (as after a preemption or a prefix-cache hit: num_computed_tokens > 0 at its first chunk)."""
    decode = seq("decode", [5, 6, 7], [8, 9], computed=4, blocks=[3, 11])
    short = seq("short", list(range(20, 30)), [], computed=4, blocks=[7, 1, 9], prompt_logprobs=True)
    long = seq("long", list(range(100, 120)), [], computed=0, blocks=[12, 13, 14, 15, 16])
    resumed = seq("resumed", [1, 2, 3, 4, 5, 6], [40, 41, 42], computed=4, blocks=[20, 21, 22])
    return SchedulerOutput(seqs=[decode, short, long, resumed], num_scheduled_tokens=[1, 5, 17, 4])


def test_prepare_flattens_a_mixed_step_in_the_scheduler_order(runner):
    sched = mixed_step()
    mi = runner.prepare(sched)
    decode, short, long, resumed = sched.seqs
    # the row-invariant kernels need no reordering: rows follow the scheduler's order
    assert mi.input_ids.tolist() == [9] + short.prompt_token_ids[4:9] + long.prompt_token_ids[:17] + [5, 6, 40, 41]
    assert mi.positions.tolist() == [4] + list(range(4, 9)) + list(range(17)) + [4, 5, 6, 7]
    assert mi.input_ids.dtype == mi.positions.dtype == torch.int64
    tables = [decode.block_table, short.block_table, long.block_table, resumed.block_table]
    starts, lengths = [4, 4, 0, 4], [1, 5, 17, 4]
    assert mi.attn.slot_mapping.tolist() == reference_slot_mapping(tables, starts, lengths)
    assert mi.attn.block_tables.tolist() == [t + [0] * (5 - len(t)) for t in tables]
    assert mi.attn.context_lens.tolist() == mi.attn.context_lens_host == [5, 9, 17, 8]
    assert mi.attn.cu_seqlens_q.tolist() == [0, 1, 6, 23, 27] and mi.attn.query_lens == lengths
    # lm_head rows: the prompt-logprob chunk (flat rows 1..5), then every sequence's last row
    assert mi.logit_rows.tolist() == [1, 2, 3, 4, 5] + [0, 5, 22, 26]
    assert mi.num_chunk_rows == 5 and mi.chunk_spans == {1: (0, 5)}


def test_plain_mode_builds_the_same_step(tiny_model_dir):
    plain = ModelRunner(tiny_model_dir, torch.float32, torch.device("cpu"), block_size=BLOCK, num_blocks=64,
                        batch_invariant=False)
    mi = plain.prepare(mixed_step())
    assert mi.positions.tolist()[:6] == [4, 4, 5, 6, 7, 8]
    assert mi.logit_rows.tolist() == [1, 2, 3, 4, 5] + [0, 5, 22, 26]


def test_model_input_is_picklable_and_runs_the_same_after_a_round_trip(runner):
    mi = runner.prepare(mixed_step())
    copy = pickle.loads(pickle.dumps(mi))
    assert isinstance(copy, ModelInput) and copy.chunk_spans == mi.chunk_spans
    first = runner.execute(mi)
    again = runner.execute(copy)      # same K/V rewritten at the same slots
    assert torch.equal(first.logits, again.logits)
    assert torch.equal(first.chunk_logits[1], again.chunk_logits[1])


def test_shapes_depend_only_on_the_batch_composition(runner):
    a = runner.prepare(mixed_step())
    other = mixed_step()
    for s in other.seqs:     # same counts and table lengths, different tokens and blocks
        s.prompt_token_ids = [t + 1 for t in s.prompt_token_ids]
        s.block_table = [b + 30 for b in s.block_table]
    b = runner.prepare(other)
    for name in ("input_ids", "positions", "logit_rows"):
        assert getattr(a, name).shape == getattr(b, name).shape
    for name in ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q"):
        assert getattr(a.attn, name).shape == getattr(b.attn, name).shape
        assert getattr(a.attn, name).dtype == getattr(b.attn, name).dtype


def test_prepare_rejects_short_block_tables_and_impossible_counts(runner):
    short_table = seq("s", [1, 2, 3, 4, 5, 6], [], computed=0, blocks=[1])
    with pytest.raises(IndexError):
        runner.prepare(SchedulerOutput(seqs=[short_table], num_scheduled_tokens=[6]))
    too_many = seq("t", [1, 2, 3], [], computed=1, blocks=[1])
    with pytest.raises(ValueError):
        runner.prepare(SchedulerOutput(seqs=[too_many], num_scheduled_tokens=[3]))


def test_vectorized_slot_mapping_equals_the_per_token_reference_on_random_batches():
    rng = random.Random(0)
    allocator = BlockAllocator(4096, BLOCK)
    for _ in range(50):
        lengths = [rng.choice([1, 1, 2, 5, 16, 33]) for _ in range(rng.randint(1, 9))]
        starts = [rng.randint(0, 40) for _ in lengths]
        tables = [allocator.allocate(-(-(s + n) // BLOCK) + rng.randint(0, 2)) for s, n in zip(starts, lengths)]
        slots = build_slot_mapping(tables, starts, lengths, BLOCK)
        assert slots.dtype == torch.int64 and slots.tolist() == reference_slot_mapping(tables, starts, lengths)
        for table in tables:
            allocator.free(table)
