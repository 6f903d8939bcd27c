"""ModelRunner: batched, chunked and mixed steps give transformers' greedy tokens, and a sequence's
logits are bitwise the same alone and in a batch (DESIGN §6)."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import SchedulerOutput
from tests.engine.conftest import PRECISIONS, build_tiny_llama, greedy_generate, make_seq
from tests.engine.test_llama import PROMPTS, hf_greedy

CPU = torch.device("cpu")


def run_step(runner: ModelRunner, seqs, counts):
    """One step through the contract: SchedulerOutput -> prepare -> ModelInput -> execute."""
    return runner.execute(runner.prepare(SchedulerOutput(seqs=list(seqs), num_scheduled_tokens=list(counts))))


def tiny_runner(model_dir, dtype=torch.float32, **kwargs) -> tuple[ModelRunner, BlockAllocator]:
    runner = ModelRunner(model_dir, dtype, CPU, block_size=4, num_blocks=128, **kwargs)
    return runner, BlockAllocator(runner.num_blocks, runner.block_size)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_batched_and_chunked_greedy_matches_transformers(tiny_model, batch_invariant):
    model_dir, hf_model = tiny_model
    runner, allocator = tiny_runner(model_dir, batch_invariant=batch_invariant)
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


def assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, target, others, n, chunks):
    """Run `target` alone, then first in a batch with `others` (their prompts chunked by `chunks`, so
    the target's prefill and decode steps share the batch with other prefills and decodes)."""
    alone_tokens, alone_logits = greedy_generate(runner, allocator, [target], n)
    batch_tokens, batch_logits = greedy_generate(runner, allocator, [target] + others, n,
                                                 chunk_sizes=[len(target)] + chunks)
    assert batch_tokens[0] == alone_tokens[0]
    diffs = [(a - b).abs().max().item() for a, b in zip(alone_logits[0], batch_logits[0])]
    assert all(torch.equal(a, b) for a, b in zip(alone_logits[0], batch_logits[0])), f"max abs diffs {diffs}"


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_logits_are_bitwise_identical_alone_and_in_batch(tiny_model_dir, precision):
    dtype, quantize = PRECISIONS[precision]
    runner, allocator = tiny_runner(tiny_model_dir, dtype, quantize=quantize)
    others = [list(range(3, 40)), [1, 2, 3], list(range(100, 117)), [7] * 9, [1, 400, 401]]
    for target in (PROMPTS[0], list(range(200, 230))):   # small-tile and large-tile (>= 16) prefill
        assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, target, others, 12,
                                                           chunks=[6, 3, 17, 9, 3])


def test_plain_gemm_path_shows_where_batch_invariance_breaks(tiny_model_dir):
    """Documents the non-invariant mode (batch_invariant=False: plain GEMMs, padded attention):
    on MKL a 1-row GEMM takes a GEMV kernel, so logits move in the last bits with the batch.
    Bound measured on the tiny model: < 1e-4 abs (float32 logits of magnitude ~1-10)."""
    runner, allocator = tiny_runner(tiny_model_dir, batch_invariant=False)
    _, alone = greedy_generate(runner, allocator, [PROMPTS[0]], 6)
    _, batched = greedy_generate(runner, allocator, [PROMPTS[0], list(range(3, 40)), [1, 2, 3]], 6,
                                 chunk_sizes=[5, 6, 3])
    diffs = [(a - b).abs().max().item() for a, b in zip(alone[0], batched[0])]
    assert max(diffs) < 1e-4, diffs


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


@pytest.mark.slow
def test_compiled_forward_gives_the_same_greedy_tokens_over_changing_shapes(tiny_model_dir):
    """option.compile: torch.compile (inductor, dynamic shapes) on the MLPs and norms. Batched, chunked and
    decode steps give shapes that change every step; the tokens must stay transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runner, allocator = tiny_runner(tiny_model_dir, compile=True)
    expected = [hf_greedy(hf_model, p, 8) for p in PROMPTS]
    chunked, _ = greedy_generate(runner, allocator, PROMPTS, 8, chunk_sizes=[2, 1, 7],
                                 stop_ids=runner.config.eos_token_ids)
    assert chunked == expected
