"""Engine end to end on a tiny random Llama: chunked prefill, preemption, seeds, prompt log probs.

Prefix caching end to end: outputs are unchanged by it (greedy == HF generate, seeded draws, prompt
log probs), and a prompt's logits after a cache hit are bitwise those computed without the cache.
"""
from __future__ import annotations

import pytest
import torch

from lmi_handler.config import EngineConfig
from lmi_handler.engine import logits_controls, sampler, stopping
from lmi_handler.engine.engine import Engine, RequestRejected
from lmi_handler.engine.model.kernels import ops, packing
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.precision import pick_device
from lmi_handler.engine.scheduler import SchedulerConfig
from lmi_handler.engine.sequence import FinishReason, GrammarKind, SamplingParams, StructuredOutputSpec
from tests.engine.device_syncs import DeviceSyncs
from tests.engine.helpers import ENGINE_PROMPTS as PROMPTS
from tests.engine.helpers import (
    PRECISIONS,
    assert_hit_logits_bitwise_equal,
    hf_greedy,
    make_engine,
    run,
)


def test_greedy_tokens_equal_hf_generate_with_chunked_prefill_in_a_batch(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = make_engine(tiny_model_dir, tiny_tokenizer, max_num_batched_tokens=12)  # prompts split in chunks
    ours, _ = run(engine, PROMPTS, [params] * 3)
    for i, prompt in enumerate(PROMPTS):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert ours[f"r{i}"] == expected


def test_preempted_sequence_resumes_with_the_same_tokens(tiny_model_dir, tiny_tokenizer):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    roomy, _ = run(make_engine(tiny_model_dir, tiny_tokenizer), PROMPTS, [params] * 3)
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4  # layers * (K, V) * kv_heads * head_dim * block_size * fp32
    tight = make_engine(tiny_model_dir, tiny_tokenizer, kv_cache_bytes=bytes_per_block * 18)  # 72 token slots
    preempted = []
    original = tight.scheduler._preempt

    def spy(seq):
        preempted.append(seq.request_id)
        return original(seq)

    tight.scheduler._preempt = spy
    squeezed, _ = run(tight, PROMPTS, [params] * 3)
    assert preempted, "the small cache should force a preemption"
    assert squeezed == roomy
    assert tight.allocator.num_used_blocks == 0


def test_seeded_sampled_request_gives_the_same_tokens_alone_and_in_a_batch(tiny_model_dir, tiny_tokenizer):
    seeded = SamplingParams(greedy=False, temperature=1.0, top_p=0.9, seed=-42, max_new_tokens=16, ignore_eos=True)
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    alone, _ = run(engine, [PROMPTS[0]], [seeded])
    others = [SamplingParams(greedy=False, temperature=0.7, max_new_tokens=9, ignore_eos=True),
              SamplingParams(max_new_tokens=5, ignore_eos=True)]
    crowd, _ = run(engine, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others[0], seeded, others[1]])
    assert crowd["r1"] == alone["r0"]
    other_seed, _ = run(engine, [PROMPTS[0]], [SamplingParams(greedy=False, seed=43, max_new_tokens=16,
                                                              ignore_eos=True)])
    assert other_seed["r0"] != alone["r0"]


def test_a_greedy_requests_log_probs_are_bitwise_the_same_alone_and_beside_a_sampled_request(
        tiny_model_dir, tiny_tokenizer):
    """Tokens and the reported log-probs (chosen and top-n) of a greedy request, engine end to end."""
    target = SamplingParams(max_new_tokens=10, ignore_eos=True, top_n_tokens=3)
    engine = make_engine(tiny_model_dir, tiny_tokenizer)

    def logprobs(results, rid):
        return [(t.id, t.log_prob, tuple(t.top_tokens or ()))
                for out in results[rid] for t in out.new_tokens]

    _, alone = run(engine, [PROMPTS[0]], [target])
    sampled = SamplingParams(greedy=False, temperature=0.8, seed=3, max_new_tokens=10, ignore_eos=True)
    _, crowd = run(engine, [PROMPTS[1], PROMPTS[0]], [sampled, target])
    _, greedy_crowd = run(engine, [PROMPTS[0], PROMPTS[2]], [target, SamplingParams(max_new_tokens=4)])
    assert logprobs(crowd, "r1") == logprobs(alone, "r0") == logprobs(greedy_crowd, "r0")
    assert len(logprobs(alone, "r0")) == 10


def test_penalized_seeded_request_is_the_same_alone_and_in_a_batch_that_changes_every_few_steps(
        tiny_model_dir, tiny_tokenizer):
    """Alone, the sampling tables are advanced on the device every decode step; in the crowd, requests
    finishing at different steps make the engine rebuild them. Both must give the same tokens."""
    target = SamplingParams(greedy=False, seed=7, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.2, max_new_tokens=14, ignore_eos=True)
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    alone, results = run(engine, [PROMPTS[0]], [target])
    others = [SamplingParams(max_new_tokens=k, ignore_eos=True, repetition_penalty=1.1) for k in (3, 6, 9)]
    crowd, _ = run(engine, [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1]], [others[0], target, others[1], others[2]])
    assert crowd["r1"] == alone["r0"] and len(alone["r0"]) == 14
    final = results["r0"][-1]
    assert "".join(t.text for out in results["r0"] for t in out.new_tokens) == final.generated_text


def test_prompt_log_probs_match_hf_across_chunks(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[0]
    engine = make_engine(tiny_model_dir, tiny_tokenizer, max_num_batched_tokens=8)
    _, results = run(engine, [prompt], [SamplingParams(max_new_tokens=2, prompt_logprobs=True)])
    prompt_tokens = next(out.prompt_tokens for out in results["r0"] if out.prompt_tokens)
    assert [t.id for t in prompt_tokens] == prompt and prompt_tokens[0].log_prob is None
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = [logp[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]
    assert [t.log_prob for t in prompt_tokens[1:]] == pytest.approx(expected, abs=1e-4)


def test_prompt_top_alternatives_match_hf_across_chunks_beside_a_request_without_them(tiny_model_dir,
                                                                                      tiny_tokenizer):
    """vLLM prompt_logprobs=k: each prompt token after the first carries its k best alternatives."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = make_engine(tiny_model_dir, tiny_tokenizer, max_num_batched_tokens=8)
    _, results = run(engine, [PROMPTS[0], PROMPTS[2]],
                     [SamplingParams(max_new_tokens=2, prompt_logprobs=True, prompt_top_n_tokens=3),
                      SamplingParams(max_new_tokens=2, prompt_logprobs=True, prompt_top_n_tokens=1)])
    for rid, prompt, k in (("r0", PROMPTS[0], 3), ("r1", PROMPTS[2], 1)):
        prompt_tokens = next(out.prompt_tokens for out in results[rid] if out.prompt_tokens)
        assert prompt_tokens[0].top_tokens is None
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for p, token in enumerate(prompt_tokens[1:]):
            top = torch.topk(logp[p], k)
            assert [t for t, _ in token.top_tokens] == top.indices.tolist()
            assert [lp for _, lp in token.top_tokens] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_finish_reasons_length_eos_and_context_limit(tiny_model_dir, tiny_tokenizer):
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    _, results = run(engine, [PROMPTS[1]], [SamplingParams(max_new_tokens=3, ignore_eos=True)])
    final = results["r0"][-1]
    assert final.finished and final.finish_reason is FinishReason.LENGTH and final.num_generated_tokens == 3
    ids, _ = run(engine, [PROMPTS[1]], [SamplingParams(max_new_tokens=6, ignore_eos=True)])
    stop_at = ids["r0"][2]
    _, results = run(engine, [PROMPTS[1]], [SamplingParams(max_new_tokens=6, stop_token_ids=(stop_at,))])
    assert results["r0"][-1].finish_reason is FinishReason.STOP_SEQUENCE
    with pytest.raises(RequestRejected, match="token limit"):
        engine.add_request("long", [5] * 250, SamplingParams(max_new_tokens=10))  # context is 256


def test_max_model_len_bounds_requests_and_past_max_position_embeddings_is_refused_before_loading(tiny_model_dir,
                                                                                                  tiny_tokenizer):
    from dataclasses import replace

    from lmi_handler.config import ConfigError

    config = EngineConfig(model_path=tiny_model_dir, dtype="float32", device_id=-1, max_num_seqs=2,
                          max_num_batched_tokens=64, max_model_len=257, block_size=4, kv_cache_bytes=1 << 22)
    with pytest.raises(ConfigError, match="option.max_model_len=257 exceeds the model's context of 256 tokens "
                                          r"\(max_position_embeddings"):
        Engine(config, tokenizer=tiny_tokenizer)
    engine = Engine(replace(config, max_model_len=64), tokenizer=tiny_tokenizer)
    assert engine.max_model_len == 64
    with pytest.raises(RequestRejected, match="token limit of 64"):
        engine.add_request("long", [5] * 60, SamplingParams(max_new_tokens=5))


@pytest.mark.slow
def test_engine_greedy_on_the_demo_model_equals_hf_generate_for_mt_bench_prompts(model_dir, tokenizer,
                                                                                 mt_bench_prompts):
    """The issue's oracle at the engine level: 4 MT-bench prompts (chat template), 32 tokens, batched."""
    from transformers import AutoModelForCausalLM

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False) for text in mt_bench_prompts[:4]]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    config = EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=None, block_size=16, kv_cache_bytes=1 << 28)
    engine = Engine(config, tokenizer=tokenizer)
    ours, results = run(engine, ids, [SamplingParams(max_new_tokens=32)] * 4)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, prompt_ids in enumerate(ids):
        expected = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False)[0, len(prompt_ids):]
        assert ours[f"r{i}"] == expected.tolist()
        final = results[f"r{i}"][-1]
        assert final.generated_text == tokenizer.decode(ours[f"r{i}"], skip_special_tokens=True)


@pytest.mark.slow
def test_demo_model_greedy_log_probs_are_bitwise_the_same_alone_and_beside_a_sampled_request(
        model_dir, tokenizer, mt_bench_prompts):
    """The leak a trial found (a greedy token's log-prob moved in the 5th decimal when a sampled request
    shared the step) on the real model and vocabulary: tokens and log-probs must be bitwise the same."""
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                          tokenize=False), add_special_tokens=False)
           for text in mt_bench_prompts[:2]]
    config = EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=4,
                          max_num_batched_tokens=256, max_model_len=None, block_size=16, kv_cache_bytes=1 << 27)
    engine = Engine(config, tokenizer=tokenizer)
    target = SamplingParams(max_new_tokens=8, top_n_tokens=2, ignore_eos=True)

    def trace(results, rid):
        return [(t.id, t.log_prob, tuple(t.top_tokens or ())) for out in results[rid] for t in out.new_tokens]

    _, alone = run(engine, [ids[0]], [target])
    sampled = SamplingParams(greedy=False, temperature=0.9, seed=1, max_new_tokens=8, ignore_eos=True)
    _, crowd = run(engine, [ids[1], ids[0]], [sampled, target])
    assert trace(crowd, "r1") == trace(alone, "r0") and len(trace(alone, "r0")) == 8


SYSTEM = [5, 17, 99, 3, 250, 8, 41, 77, 12, 300, 6, 9, 400, 11]        # 3 full blocks of 4 + 2


PREFIX_PROMPTS = [SYSTEM + [23, 57, 88, 91, 120, 33, 7], SYSTEM + [300, 200, 100], SYSTEM + [7] * 9,
           SYSTEM[:9] + [44, 45], [300, 200, 100, 50, 25]]


KV_BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 4  # tiny model: layers * (K, V) * kv_heads * head_dim * block_size * fp32


# A hit changes where the prompt's prefill chunks start, and two of today's batch-invariant kernels depend
# on the chunk's shape: GEMMs use 2-row tiles for chunks under 16 tokens and 16-row tiles otherwise (the
# two round differently), and attention is one SDPA call per sequence over its whole query chunk.
# Measured on the tiny model: with one 16-row tile for every row the whole-prompt case is bitwise equal,
# and with attention also computed one query row at a time the chunked case is too (about 1e-6 abs apart
# otherwise). Row-invariant kernels (issue 7, item 1) remove both dependences; then these must pass.
def make_prefix_engine(model_dir, tokenizer, caching: bool, max_num_batched_tokens=64, kv_cache_bytes=1 << 22,
                max_num_seqs=4, block_size=4) -> Engine:
    config = EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=None,
                          block_size=block_size, kv_cache_bytes=kv_cache_bytes, enable_prefix_caching=caching)
    return Engine(config, tokenizer=tokenizer)


def run_prefix(engine: Engine, prompts, params, tag="r") -> tuple[dict[str, list[int]], dict]:
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
    expected = {f"r{i}": hf_greedy(hf, p, 16) for i, p in enumerate(PREFIX_PROMPTS)}
    settings = {"roomy": {}, "chunked": dict(max_num_batched_tokens=10),
                "preempting": dict(max_num_batched_tokens=10, kv_cache_bytes=KV_BYTES_PER_BLOCK * 16)}
    for name, kwargs in settings.items():
        for caching in (True, False):
            engine = make_prefix_engine(tiny_model_dir, tokenizer, caching, **kwargs)
            preempted = count_preemptions(engine)
            for round_ in range(2 if caching else 1):     # the second round starts with a warm cache
                ours, _ = run_prefix(engine, PREFIX_PROMPTS, params)
                assert ours == expected, (name, caching, round_)
            stats = engine.allocator.prefix_cache_stats
            assert (stats.num_hit_tokens > 0) == caching, (name, stats)
            assert bool(preempted) == (name == "preempting"), (name, caching)
            assert engine.allocator.num_used_blocks == 0
            assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_seeded_sampled_requests_give_the_same_tokens_with_and_without_hits(tiny_model_dir, tokenizer):
    seeded = SamplingParams(greedy=False, temperature=0.9, top_p=0.95, seed=7, max_new_tokens=16, ignore_eos=True)
    cold, _ = run_prefix(make_prefix_engine(tiny_model_dir, tokenizer, caching=False), PREFIX_PROMPTS, seeded)
    engine = make_prefix_engine(tiny_model_dir, tokenizer, caching=True)
    first, _ = run_prefix(engine, PREFIX_PROMPTS, seeded)
    hits_before = engine.allocator.prefix_cache_stats.num_hit_tokens
    warm, _ = run_prefix(engine, PREFIX_PROMPTS, seeded)              # every prompt hits its own earlier blocks
    assert engine.allocator.prefix_cache_stats.num_hit_tokens - hits_before >= 4 * len(PREFIX_PROMPTS)
    assert first == cold and warm == cold


def test_prompt_log_probs_are_correct_with_prefix_caching_on(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = make_prefix_engine(tiny_model_dir, tokenizer, caching=True, max_num_batched_tokens=8)
    run_prefix(engine, PREFIX_PROMPTS[:2], SamplingParams(max_new_tokens=4), tag="warm")    # cache holds SYSTEM's blocks
    stats = engine.allocator.prefix_cache_stats
    hits, queries = stats.num_hit_tokens, stats.num_queries
    details = SamplingParams(max_new_tokens=4, prompt_logprobs=True)
    ours, results = run_prefix(engine, PREFIX_PROMPTS[:2], details)
    assert (stats.num_hit_tokens, stats.num_queries) == (hits, queries)       # whole prompts computed
    for i, prompt in enumerate(PREFIX_PROMPTS[:2]):
        prompt_tokens = next(out.prompt_tokens for out in results[f"r{i}"] if out.prompt_tokens)
        assert [t.id for t in prompt_tokens] == prompt and prompt_tokens[0].log_prob is None
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        expected = [logp[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]
        assert [t.log_prob for t in prompt_tokens[1:]] == pytest.approx(expected, abs=1e-4)
        assert ours[f"r{i}"] == hf_greedy(hf, prompt, 4)
    again, _ = run_prefix(engine, PREFIX_PROMPTS[:2], SamplingParams(max_new_tokens=4), tag="after")
    assert stats.num_hit_tokens > hits                     # the cache stays usable for other requests
    assert list(again.values()) == [ours["r0"], ours["r1"]]




@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_logits_after_a_prefix_hit_are_bitwise_those_computed_without_the_cache(tiny_model_dir, precision):
    dtype, quantize = PRECISIONS[precision]
    runner = ModelRunner(tiny_model_dir, dtype, torch.device("cpu"), block_size=4, num_blocks=128, quantize=quantize)
    for budget in (64, 12):                  # whole prompts in one chunk; chunked prefill
        assert_hit_logits_bitwise_equal(runner, SchedulerConfig(4, budget), PREFIX_PROMPTS[0], [PREFIX_PROMPTS[1]], 8)


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
    engine = make_prefix_engine(model_dir, tokenizer, caching, max_num_batched_tokens=32, max_num_seqs=8,
                         block_size=8, kv_cache_bytes=64 * block_bytes)
    preempted = count_preemptions(engine)
    ours, _ = run_prefix(engine, ids, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert [rid for rid in expected if ours[rid] != expected[rid]] == []
    assert preempted
    # each prompt after the first hits the template's 3 full blocks (24 tokens) at least
    assert (engine.allocator.prefix_cache_stats.num_hit_tokens >= 15 * 24) == caching
    assert engine.allocator.num_used_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_demo_model_logits_after_a_prefix_hit_are_bitwise_those_computed_without_the_cache(
        model_dir, tokenizer, mt_bench_prompts, precision):
    dtype, quantize = PRECISIONS[precision]
    runner = ModelRunner(model_dir, dtype, torch.device("cpu"), block_size=8, num_blocks=64, quantize=quantize)
    target, *warmers = chat_prompt_ids(tokenizer, mt_bench_prompts[:2])
    assert_hit_logits_bitwise_equal(runner, SchedulerConfig(4, 64), target, warmers, 4)


P14 = dict(max_new_tokens=14, ignore_eos=True)
ONE_SYNC_CASES = {
    "every sampling option": [
        SamplingParams(**P14), SamplingParams(greedy=False, temperature=0.7, top_k=5, seed=3, **P14),
        SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, top_n_tokens=3, **P14),
        SamplingParams(logit_bias=((3, 2.0),), bad_words=((4, 5),), stop_sequences=("zz",), stop_token_ids=(5,),
                       min_tokens=2, max_new_tokens=14),
        SamplingParams(allowed_token_ids=tuple(range(3, 200)), typical_p=0.9, greedy=False, seed=1, **P14)],
    "beam search": [SamplingParams(num_beams=2, max_new_tokens=14), SamplingParams(**P14)],
    "structured output": [SamplingParams(structured_output=StructuredOutputSpec(GrammarKind.REGEX, "[a-z ]{0,99}"),
                                         max_new_tokens=14), SamplingParams(**P14)],
    "prompt log-probs": [SamplingParams(prompt_logprobs=True, prompt_top_n_tokens=2, **P14), SamplingParams(**P14)],
    "top_p": [SamplingParams(greedy=False, top_p=0.9, min_p=0.05, **P14), SamplingParams(**P14)],
}


@pytest.mark.parametrize("case", sorted(ONE_SYNC_CASES))
def test_each_step_waits_for_the_device_once_for_its_results_whatever_its_requests_ask(
        case, tiny_model_dir, tiny_tokenizer, monkeypatch):
    """Issue 38's rule, followed on CPU by DeviceSyncs from the engine's load on: every step of these requests
    (prefill, the sampling tables built, then advanced; beams, grammars and prompt log-probs included) reads
    the device once, the copy of its results (output_processor._to_host); its host-to-device copies do not
    block. top_p alone adds its documented check of whether 64 candidates held the mass. The forward is
    left out (a CUDA graph replays it; tests/engine/triton/test_cuda_graphs.py checks that step), and the
    C++ shortcuts taken only for CPU tensors are off, so the step runs the ops a GPU runs."""
    with DeviceSyncs(pick_device(-1), skip=("engine/model/",)) as probe:
        engine = make_engine(tiny_model_dir, tiny_tokenizer, max_num_seqs=8)
        for module in (sampler, stopping, logits_controls, packing, ops):      # built by the engine's load above
            monkeypatch.setattr(module, "built_kernels", lambda: None)
        execute = engine.runner.execute

        def execute_on_device(model_input):
            out = execute(model_input)
            probe.on_device(out.logits, out.chunk_logits)      # the forward's output lives on the device
            return out

        engine.runner.execute = execute_on_device
        requests = ONE_SYNC_CASES[case]
        for i, params in enumerate(requests):
            if params.structured_output is not None:
                engine.grammars.validate(params.structured_output)     # compiled (as the server's 400 check does)
            engine.add_request(f"r{i}", [1, 17, 30, 45, 9 + i], params)
        per_step, tokens = [], {f"r{i}": 0 for i in range(len(requests))}
        for _ in range(7):
            seen = len(probe.syncs)
            for out in engine.step():
                tokens[out.request_id] += len(out.new_tokens)
            per_step.append(probe.syncs[seen:])
    reporting = [f"r{i}" for i, params in enumerate(requests) if params.num_beams == 1]   # beams report at the end
    assert all(tokens[request_id] > 0 for request_id in reporting), tokens
    checks = {"apply_top_p"} if case == "top_p" else set()
    for syncs in per_step:
        assert [s.function for s in syncs if s.function == "_to_host"] == ["_to_host"], syncs
        assert {s.function for s in syncs if s.function != "_to_host"} == checks, syncs


def step_all(engine: Engine, requests, late=None, late_step: int = 0) -> dict[str, list[tuple[int, float]]]:
    """Add `requests` (id, prompt, params), then `late` before step `late_step`, and step until all finished;
    each request's (token id, log prob) pairs."""
    got: dict[str, list[tuple[int, float]]] = {}
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    step = 0
    while engine.has_unfinished or (late is not None and step <= late_step):
        if late is not None and step == late_step:
            engine.add_request(*late)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend((t.id, t.log_prob) for t in out.new_tokens)
        step += 1
    return got


def test_a_request_preempted_for_a_higher_priority_one_gives_bitwise_the_tokens_and_log_probs_it_gives_alone(
        tiny_model_dir, tiny_tokenizer):
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True, priority=1)
    seeded = SamplingParams(greedy=False, temperature=0.8, top_p=0.9, seed=11, max_new_tokens=16, ignore_eos=True,
                            priority=1)
    low = [(f"low{i}", p, greedy if i != 2 else seeded) for i, p in enumerate(PROMPTS)]
    high = ("high", list(range(3, 63)), SamplingParams(max_new_tokens=4, ignore_eos=True, priority=0))
    roomy = make_engine(tiny_model_dir, tiny_tokenizer, scheduling_policy="priority")
    alone = {**step_all(roomy, low), **step_all(roomy, [high])}
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4       # layers * (K, V) * kv_heads * head_dim * block_size * fp32
    tight = make_engine(tiny_model_dir, tiny_tokenizer, kv_cache_bytes=bytes_per_block * 28,
                        scheduling_policy="priority")
    preempted = count_preemptions(tight)
    squeezed = step_all(tight, low, late=high, late_step=4)   # high's 60-token prompt needs 15 of the 12 free
    assert "low2" in preempted and "high" not in preempted
    assert squeezed == alone                          # tokens and log probs, compared exactly
    assert tight.allocator.num_used_blocks == 0


def test_under_fcfs_the_engine_refuses_a_priority_other_than_0(tiny_model_dir, tiny_tokenizer):
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    with pytest.raises(RequestRejected, match="option.scheduling_policy=priority") as refused:
        engine.add_request("r", PROMPTS[1], SamplingParams(priority=-1))
    assert refused.value.field == "priority" and not engine.has_unfinished
    engine.add_request("r", PROMPTS[1], SamplingParams(priority=0))
