"""Prefix caching end to end: outputs are unchanged by it (greedy == HF generate, seeded draws, prompt
log probs), and a prompt's logits after a cache hit are bitwise those computed without the cache."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.config import EngineConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig
from lmi_handler.engine.sequence import SamplingParams, Sequence
from tests.engine.test_llama import hf_greedy

SYSTEM = [5, 17, 99, 3, 250, 8, 41, 77, 12, 300, 6, 9, 400, 11]        # 3 full blocks of 4 + 2
PROMPTS = [SYSTEM + [23, 57, 88, 91, 120, 33, 7], SYSTEM + [300, 200, 100], SYSTEM + [7] * 9,
           SYSTEM[:9] + [44, 45], [300, 200, 100, 50, 25]]
KV_BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 4  # tiny model: layers * (K, V) * kv_heads * head_dim * block_size * fp32

# A hit changes where the prompt's prefill chunks start, and two of today's batch-invariant kernels depend
# on the chunk's shape: GEMMs use 2-row tiles for chunks under 16 tokens and 16-row tiles otherwise (the
# two round differently), and attention is one SDPA call per sequence over its whole query chunk.
# Measured on the tiny model: with one 16-row tile for every row the whole-prompt case is bitwise equal,
# and with attention also computed one query row at a time the chunked case is too (about 1e-6 abs apart
# otherwise). Row-invariant kernels (issue 7, item 1) remove both dependences; then these must pass.
def make_engine(model_dir, tokenizer, caching: bool, max_num_batched_tokens=64, kv_cache_bytes=1 << 22,
                max_num_seqs=4, block_size=4) -> Engine:
    config = EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=None,
                          block_size=block_size, kv_cache_bytes=kv_cache_bytes, enable_prefix_caching=caching)
    return Engine(config, tokenizer=tokenizer)


def run(engine: Engine, prompts, params, tag="r") -> tuple[dict[str, list[int]], dict]:
    results = engine.generate([(f"{tag}{i}", p, params) for i, p in enumerate(prompts)])
    return {rid: [t.id for out in outs for t in out.new_tokens] for rid, outs in results.items()}, results


def count_preemptions(engine: Engine) -> list[str]:
    preempted: list[str] = []
    original = engine.scheduler._preempt

    def spy(seq):
        preempted.append(seq.request_id)
        return original(seq)

    engine.scheduler._preempt = spy
    return preempted


def test_greedy_tokens_equal_hf_generate_with_prefix_caching_chunked_prefill_and_preemption(
        tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    expected = {f"r{i}": hf_greedy(hf, p, 16) for i, p in enumerate(PROMPTS)}
    settings = {"roomy": {}, "chunked": dict(max_num_batched_tokens=10),
                "preempting": dict(max_num_batched_tokens=10, kv_cache_bytes=KV_BYTES_PER_BLOCK * 16)}
    for name, kwargs in settings.items():
        for caching in (True, False):
            engine = make_engine(tiny_model_dir, tokenizer, caching, **kwargs)
            preempted = count_preemptions(engine)
            for round_ in range(2 if caching else 1):     # the second round starts with a warm cache
                ours, _ = run(engine, PROMPTS, params)
                assert ours == expected, (name, caching, round_)
            stats = engine.allocator.prefix_cache_stats
            assert (stats.num_hit_tokens > 0) == caching, (name, stats)
            assert bool(preempted) == (name == "preempting"), (name, caching)
            assert engine.allocator.num_used_blocks == 0
            assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_seeded_sampled_requests_give_the_same_tokens_with_and_without_hits(tiny_model_dir, tokenizer):
    seeded = SamplingParams(greedy=False, temperature=0.9, top_p=0.95, seed=7, max_new_tokens=16, ignore_eos=True)
    cold, _ = run(make_engine(tiny_model_dir, tokenizer, caching=False), PROMPTS, seeded)
    engine = make_engine(tiny_model_dir, tokenizer, caching=True)
    first, _ = run(engine, PROMPTS, seeded)
    hits_before = engine.allocator.prefix_cache_stats.num_hit_tokens
    warm, _ = run(engine, PROMPTS, seeded)              # every prompt hits its own earlier blocks
    assert engine.allocator.prefix_cache_stats.num_hit_tokens - hits_before >= 4 * len(PROMPTS)
    assert first == cold and warm == cold


def test_prompt_log_probs_are_correct_with_prefix_caching_on(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = make_engine(tiny_model_dir, tokenizer, caching=True, max_num_batched_tokens=8)
    run(engine, PROMPTS[:2], SamplingParams(max_new_tokens=4), tag="warm")    # cache holds SYSTEM's blocks
    stats = engine.allocator.prefix_cache_stats
    hits, queries = stats.num_hit_tokens, stats.num_queries
    details = SamplingParams(max_new_tokens=4, prompt_logprobs=True)
    ours, results = run(engine, PROMPTS[:2], details)
    assert (stats.num_hit_tokens, stats.num_queries) == (hits, queries)       # whole prompts computed
    for i, prompt in enumerate(PROMPTS[:2]):
        prompt_tokens = next(out.prompt_tokens for out in results[f"r{i}"] if out.prompt_tokens)
        assert [t.id for t in prompt_tokens] == prompt and prompt_tokens[0].log_prob is None
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        expected = [logp[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]
        assert [t.log_prob for t in prompt_tokens[1:]] == pytest.approx(expected, abs=1e-4)
        assert ours[f"r{i}"] == hf_greedy(hf, prompt, 4)
    again, _ = run(engine, PROMPTS[:2], SamplingParams(max_new_tokens=4), tag="after")
    assert stats.num_hit_tokens > hits                     # the cache stays usable for other requests
    assert list(again.values()) == [ours["r0"], ours["r1"]]


def scheduled_greedy(runner: ModelRunner, sched: Scheduler, prompts: list[list[int]], n: int,
                     tag: str) -> tuple[list[Sequence], list[list[torch.Tensor]]]:
    """Greedy-decode `prompts` through the real scheduler (chunks, hits) for `n` tokens each;
    returns the sequences and the logits each sampled token was drawn from."""
    seqs = [Sequence(f"{tag}{i}", list(p), SamplingParams(max_new_tokens=n)) for i, p in enumerate(prompts)]
    logits: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in seqs}
    for seq in seqs:
        sched.add(seq)
    while sched.num_unfinished:
        out = sched.schedule()
        model_out = runner.execute(runner.prepare(out))
        sched.update_from_output(out)
        for row, seq in enumerate(out.seqs):
            if seq.num_computed_tokens == seq.num_tokens:
                logits[seq.request_id].append(model_out.logits[row].clone())
                seq.output_token_ids.append(int(model_out.logits[row].argmax()))  # sync: test loop
                if seq.num_output_tokens == n:
                    sched.finish(seq)
    return seqs, [logits[s.request_id] for s in seqs]


def assert_hit_logits_bitwise_equal(runner: ModelRunner, config: SchedulerConfig, target: list[int],
                                    warmers: list[list[int]], n: int) -> None:
    """`target` alone on an empty cache, then after `warmers` (sharing its prefix) filled the cache."""
    def fresh() -> Scheduler:
        return Scheduler(config, BlockAllocator(runner.num_blocks, runner.block_size))

    (cold,), (cold_logits,) = scheduled_greedy(runner, fresh(), [target], n, "cold")
    warm_sched = fresh()
    scheduled_greedy(runner, warm_sched, warmers, n, "warmer")
    (warm,), (warm_logits,) = scheduled_greedy(runner, warm_sched, [target], n, "warm")
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens > 0
    diffs = [(a - b).abs().max().item() for a, b in zip(cold_logits, warm_logits)]
    assert all(torch.equal(a, b) for a, b in zip(cold_logits, warm_logits)), f"max abs diffs {diffs}"
    assert warm.output_token_ids == cold.output_token_ids


def test_logits_after_a_prefix_hit_are_bitwise_those_computed_without_the_cache(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, torch.float32, torch.device("cpu"), block_size=4, num_blocks=128)
    for budget in (64, 12):                  # whole prompts in one chunk; chunked prefill
        assert_hit_logits_bitwise_equal(runner, SchedulerConfig(4, budget), PROMPTS[0], [PROMPTS[1]], 8)


# ---- the demo model ----------------------------------------------------------------------------------

def chat_prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """MT-bench questions through the chat template: all share its system-prompt prefix (24 tokens)."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False) for text in texts]
    return [tokenizer.encode(p, add_special_tokens=False) for p in prompts]


@pytest.fixture(scope="module")
def demo_prompts_and_hf_tokens(model_dir, tokenizer, mt_bench_prompts):
    """16 MT-bench prompts through the chat template, and HF generate()'s 16 greedy tokens for each."""
    from transformers import AutoModelForCausalLM

    ids = chat_prompt_ids(tokenizer, mt_bench_prompts[:16])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return ids, {f"r{i}": hf_greedy(hf, p, 16) for i, p in enumerate(ids)}


@pytest.mark.slow
@pytest.mark.parametrize("caching", [True, False], ids=["prefix_caching", "no_prefix_caching"])
def test_demo_model_greedy_equals_hf_generate_on_16_mt_bench_prompts_chunked_and_preempted(
        model_dir, tokenizer, demo_prompts_and_hf_tokens, caching):
    ids, expected = demo_prompts_and_hf_tokens
    block_bytes = 2 * 30 * 8 * 3 * 64 * 4           # layers * (K, V) * block_size * kv_heads * head_dim * fp32
    # chunked prefill (32-token budget) and a cache of 64 blocks (512 tokens) for 8 sequences of up to
    # 154 tokens, so sequences are preempted and resumed
    engine = make_engine(model_dir, tokenizer, caching, max_num_batched_tokens=32, max_num_seqs=8,
                         block_size=8, kv_cache_bytes=64 * block_bytes)
    preempted = count_preemptions(engine)
    ours, _ = run(engine, ids, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert [rid for rid in expected if ours[rid] != expected[rid]] == []
    assert preempted
    # each prompt after the first hits the template's 3 full blocks (24 tokens) at least
    assert (engine.allocator.prefix_cache_stats.num_hit_tokens >= 15 * 24) == caching
    assert engine.allocator.num_used_blocks == 0


@pytest.mark.slow
def test_demo_model_logits_after_a_prefix_hit_are_bitwise_those_computed_without_the_cache(
        model_dir, tokenizer, mt_bench_prompts):
    runner = ModelRunner(model_dir, torch.float32, torch.device("cpu"), block_size=8, num_blocks=64)
    target, *warmers = chat_prompt_ids(tokenizer, mt_bench_prompts[:2])
    assert_hit_logits_bitwise_equal(runner, SchedulerConfig(4, 64), target, warmers, 4)
