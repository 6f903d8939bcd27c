"""ModelRunner: batched, chunked and mixed steps give transformers' greedy tokens, and a sequence's
logits are bitwise the same alone and in a batch (DESIGN §6).

ModelInput, the step contract: built by ModelRunner.prepare from a hand-made SchedulerOutput, picklable,
shaped by the batch composition only, and its slot mapping equal to the per-token reference.
"""
from __future__ import annotations

import pickle
import random

import pytest
import torch

from lmi_handler.engine.kv_cache import BlockAllocator, build_slot_mapping
from lmi_handler.engine.model_runner import ModelInput, ModelRunner
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import SamplingParams, Sequence
from tests.engine.helpers import (
    PRECISIONS,
    assert_logits_bitwise_identical_alone_and_in_batch,
    build_tiny_llama,
    greedy_generate,
    hf_greedy,
    make_seq,
)
from tests.engine.helpers import RUNNER_PROMPTS as PROMPTS

CPU = torch.device("cpu")


def run_step(runner: ModelRunner, seqs, counts):
    """One step through the contract: SchedulerOutput -> prepare -> ModelInput -> execute."""
    return runner.execute(runner.prepare(SchedulerOutput(seqs=list(seqs), num_scheduled_tokens=list(counts))))


def tiny_runner(model_dir, dtype=torch.float32, **kwargs) -> tuple[ModelRunner, BlockAllocator]:
    runner = ModelRunner(model_dir, dtype, CPU, block_size=4, num_blocks=128, **kwargs)
    return runner, BlockAllocator(runner.num_blocks, runner.block_size)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_batched_and_chunked_greedy_matches_transformers(tiny_model, backend):
    model_dir, hf_model = tiny_model
    runner, allocator = tiny_runner(model_dir, kernel_backend=backend)
    stop = runner.config.eos_token_ids
    expected = [hf_greedy(hf_model, p, 10) for p in PROMPTS]
    batched, _ = greedy_generate(runner, allocator, PROMPTS, 10, stop_ids=stop)
    chunked, _ = greedy_generate(runner, allocator, PROMPTS, 10, chunk_sizes=[2, 1, 7], stop_ids=stop)
    assert batched == expected
    assert chunked == expected
    assert allocator.num_free_blocks == allocator.num_blocks


def test_execute_does_not_modify_sequences_and_returns_float32(tiny_model_dir):
    runner, allocator = tiny_runner(tiny_model_dir)
    seq = make_seq(PROMPTS[0], allocator, 8)
    before = (seq.num_computed_tokens, list(seq.output_token_ids), list(seq.block_table))
    out = run_step(runner, [seq], [3])
    assert (seq.num_computed_tokens, seq.output_token_ids, seq.block_table) == before
    assert out.logits.shape == (1, runner.config.vocab_size) and out.logits.dtype == torch.float32
    assert out.chunk_logits == {}


def test_chunk_logits_cover_prompt_chunks_only_for_prompt_logprobs(tiny_model_dir):
    runner, allocator = tiny_runner(tiny_model_dir)
    prompt = PROMPTS[2] + list(range(30, 40))                            # 28 tokens
    whole = make_seq(prompt, allocator, len(prompt), "whole", prompt_logprobs=True)
    full = run_step(runner, [whole], [len(prompt)]).chunk_logits[0]       # (len(prompt), vocab)
    plain = make_seq(prompt, allocator, len(prompt), "plain")
    chunked = make_seq(prompt, allocator, len(prompt), "chunked", prompt_logprobs=True)
    first = run_step(runner, [plain, chunked], [4, 4])                    # first chunk of both
    assert set(first.chunk_logits) == {1}
    torch.testing.assert_close(first.chunk_logits[1], full[:4], rtol=1e-5, atol=1e-5)
    plain.num_computed_tokens = chunked.num_computed_tokens = 4
    second = run_step(runner, [plain, chunked], [5, 24])     # the long chunk goes first inside execute
    assert set(second.chunk_logits) == {1} and second.chunk_logits[1].shape == (24, runner.config.vocab_size)
    torch.testing.assert_close(second.chunk_logits[1], full[4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second.logits, full[[8, -1]], rtol=1e-5, atol=1e-5)


def test_num_blocks_follow_kv_cache_bytes(tiny_model_dir):
    # tiny model: 2 layers * K,V * block 4 * 2 kv heads * head_dim 16 * 4 bytes = 2048 bytes a block
    runner = ModelRunner(tiny_model_dir, torch.float32, CPU, block_size=4, kv_cache_bytes=10 * 2048 + 5)
    assert runner.num_blocks == 10
    assert runner.kv_caches[0][0].shape == (10, 4, 2, 16)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    hf_model = build_tiny_llama(tmp_path, tie_word_embeddings=False)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / shard, metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    runner, allocator = tiny_runner(tmp_path)
    ours, _ = greedy_generate(runner, allocator, [PROMPTS[0]], 6, stop_ids=runner.config.eos_token_ids)
    assert ours[0] == hf_greedy(hf_model, PROMPTS[0], 6)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_logits_are_bitwise_identical_alone_and_in_batch(tiny_model_dir, precision):
    dtype, quantize = PRECISIONS[precision]
    runner, allocator = tiny_runner(tiny_model_dir, dtype, quantize=quantize)
    others = [list(range(3, 40)), [1, 2, 3], list(range(100, 117)), [7] * 9, [1, 400, 401]]
    for target in (PROMPTS[0], list(range(200, 230))):   # small-tile and large-tile (>= 16) prefill
        assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, target, others, 12,
                                                           chunks=[6, 3, 17, 9, 3])


@pytest.fixture(scope="module")
def real_runner(model_dir):
    runner = ModelRunner(model_dir, torch.float32, CPU, block_size=16, num_blocks=128)
    return runner, BlockAllocator(runner.num_blocks, runner.block_size)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.slow
def test_real_model_greedy_matches_transformers(real_runner, model_dir, tokenizer, mt_bench_prompts):
    from transformers import AutoModelForCausalLM

    runner, allocator = real_runner
    prompts = [chat_ids(tokenizer, p) for p in mt_bench_prompts[:4]]
    ours, _ = greedy_generate(runner, allocator, prompts, 32, stop_ids=runner.config.eos_token_ids)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(hf_model, prompt, 32)


@pytest.mark.slow
def test_real_model_logits_are_bitwise_identical_alone_and_in_batch(real_runner, tokenizer, mt_bench_prompts):
    runner, allocator = real_runner
    prompts = [chat_ids(tokenizer, p) for p in mt_bench_prompts[:4]]
    assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, prompts[0], prompts[1:], 8,
                                                       chunks=[len(prompts[1]), 16, 1])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "int8", "int8_bf16"])
def test_real_model_logits_are_bitwise_identical_alone_and_in_batch_in_every_precision(
        model_dir, tokenizer, mt_bench_prompts, precision):
    dtype, quantize = PRECISIONS[precision]
    runner = ModelRunner(model_dir, dtype, CPU, block_size=16, num_blocks=128, quantize=quantize)
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    prompts = [chat_ids(tokenizer, p) for p in mt_bench_prompts[:4]]
    assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, prompts[0], prompts[1:], 8,
                                                       chunks=[len(prompts[1]), 16, 1])


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


def decode_step() -> SchedulerOutput:
    """Three decodes (one row each): the last prompt token, an output token at a block's first offset, and one
    deep in a longer table; no prompt-logprob chunk, no block copy."""
    first = seq("first", [5, 6, 7], [], computed=2, blocks=[9])
    edge = seq("edge", [1, 2, 3, 4, 5, 6], [40, 41, 42], computed=8, blocks=[20, 21, 4])
    deep = seq("deep", list(range(30)), [50, 51], computed=31, blocks=[1, 2, 3, 5, 6, 7, 8, 10, 11])
    return SchedulerOutput(seqs=[first, edge, deep], num_scheduled_tokens=[1, 1, 1])


def test_a_decode_step_takes_the_list_path_with_the_general_paths_values(runner):
    """prepare_host builds a decode step (a row per sequence) from Python lists (_prepare_decode); every field
    must equal what the general path (_prepare_general, tensor ops) builds for the same step, dtypes included."""
    sched = decode_step()
    starts = [s.num_computed_tokens for s in sched.seqs]
    token_ids = [7, 42, 51]
    fast = runner.prepare_host(sched)
    general = runner._prepare_general(sched, starts, token_ids)
    assert fast.input_ids.tolist() == token_ids
    assert fast.attn.slot_mapping.tolist() == reference_slot_mapping([s.block_table for s in sched.seqs], starts, [1] * 3)
    for name in ("input_ids", "positions", "logit_rows"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q"):
        a, b = getattr(fast.attn, name), getattr(general.attn, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.attn.query_lens == general.attn.query_lens and fast.attn.context_lens_host == general.attn.context_lens_host
    assert (fast.num_chunk_rows, fast.chunk_spans, fast.blocks_to_copy) == (0, {}, None)
    assert (general.num_chunk_rows, general.chunk_spans, general.blocks_to_copy) == (0, {}, None)
    assert torch.equal(runner.execute(fast).logits, runner.execute(general).logits)


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
