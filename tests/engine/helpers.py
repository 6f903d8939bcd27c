"""Engine test helpers: tiny random Llama checkpoints written on the fly, a greedy loop, transformers'
greedy tokens, and a tiny engine (imported by the engine tests; conftest.py only holds fixtures).

The checkpoints are saved by transformers (safetensors) so our loader reads exactly what HF writes.
"""
from __future__ import annotations

from pathlib import Path

import torch

from lmi_handler.config import EngineConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.kv_cache import BlockAllocator, build_block_tables, build_slot_mapping, num_blocks_needed
from lmi_handler.engine.model.attention import AttentionMetadata, write_kv
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from lmi_handler.engine.sequence import SamplingParams, Sequence

TINY_VOCAB = 512

# (activations' dtype, quantize) the engine runs a model in on CPU; every promise holds in each
PRECISIONS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
              "int8": (torch.float32, "int8"), "int8_bf16": (torch.bfloat16, "int8")}

TINY_VARIANTS = {
    "gqa_tied": dict(tie_word_embeddings=True),
    "gqa_untied": dict(tie_word_embeddings=False),
    "llama3_rope": dict(tie_word_embeddings=False, max_position_embeddings=512,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}),
    "linear_rope_bias": dict(tie_word_embeddings=True, attention_bias=True,
                             rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
}


def build_tiny_llama(path: Path, seed: int = 0, **overrides):
    """Write a random 2-layer GQA Llama (4 heads, 2 kv heads, vocab 512) to `path`; return the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=256,
                  initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    with torch.no_grad():   # biases are zero-initialised; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


def make_seq(prompt_ids: list[int], allocator: BlockAllocator, max_tokens: int,
             request_id: str = "r", prompt_logprobs: bool = False) -> Sequence:
    """A Sequence with blocks for `max_tokens` tokens already allocated."""
    seq = Sequence(request_id, list(prompt_ids), SamplingParams(prompt_logprobs=prompt_logprobs))
    blocks = allocator.allocate(num_blocks_needed(max_tokens, allocator.block_size))
    assert blocks is not None, "test allocator too small"
    seq.block_table = blocks
    return seq


def greedy_generate(runner, allocator: BlockAllocator, prompts: list[list[int]], n: int,
                    chunk_sizes: list[int] | None = None, stop_ids: tuple[int, ...] = ()):
    """Greedy-decode all prompts together for `n` new tokens; returns (token lists, per-step logits).

    chunk_sizes: prefill each prompt in chunks of at most these many tokens per step (one size
    per prompt; None = whole prompt in one step). Prefills of different prompts and decodes of
    finished prefills share steps, as the engine's chunked prefill does. A sequence stops at
    n tokens or at a token in stop_ids. Blocks are freed at the end.
    """
    seqs = [make_seq(p, allocator, len(p) + n, f"r{i}") for i, p in enumerate(prompts)]
    chunks = chunk_sizes or [len(p) for p in prompts]
    step_logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    active = list(range(len(seqs)))
    while active:
        counts = [min(chunks[i], seqs[i].num_tokens - seqs[i].num_computed_tokens) for i in active]
        out = runner.execute(runner.prepare(SchedulerOutput(seqs=[seqs[i] for i in active],
                                                            num_scheduled_tokens=counts)))
        for row, (i, count) in enumerate(zip(active, counts)):
            seq = seqs[i]
            seq.num_computed_tokens += count
            if seq.num_computed_tokens == seq.num_tokens:    # a token is due
                step_logits[i].append(out.logits[row].clone())
                seq.output_token_ids.append(int(out.logits[row].argmax()))  # sync: host loop
        active = [i for i in active
                  if seqs[i].num_output_tokens < n and not (seqs[i].output_token_ids
                                                            and seqs[i].output_token_ids[-1] in stop_ids)]
    for seq in seqs:
        allocator.free(seq.block_table)
    return [s.output_token_ids for s in seqs], step_logits


TINY_TOKENIZER_TEXTS = ["Hello world, hello there.", "The cat sat on the mat.", "Stop here. STOP now!",
                        "我很好😀。日本語のテキスト", "emoji at the end 🎉", "Ünïcödé àçcénts — “quotes” …"]


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB):
    """A GPT2-style byte-level BPE trained on a few strings (ids 0, 1 are <s>, </s>), padded with added
    tokens to `vocab_size` ids, wrapped like a real checkpoint's tokenizer. Needs no prepared model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TINY_TOKENIZER_TEXTS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.add_tokens([f"<extra_{i}>" for i in range(vocab_size - len(fast))])
    return fast


RUNNER_PROMPTS = [[1, 17, 300, 45, 9], [1, 250], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 499]]


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_engine(model_dir, tokenizer, max_num_batched_tokens=64, kv_cache_bytes=1 << 22, max_num_seqs=4,
                scheduling_policy="fcfs"):
    config = EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=None, block_size=4,
                          kv_cache_bytes=kv_cache_bytes, scheduling_policy=scheduling_policy)
    return Engine(config, tokenizer=tokenizer)


def run(engine, prompts, params_list):
    results = engine.generate([(f"r{i}", p, params) for i, (p, params) in enumerate(zip(prompts, params_list))])
    return {rid: [t.id for out in outs for t in out.new_tokens] for rid, outs in results.items()}, results


ENGINE_PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 300, 6, 9, 400, 11, 23, 57, 88, 91, 120, 33, 7],
           [300, 200, 100, 50, 25], [7, 7, 7, 7, 8, 8, 8, 9, 9, 10, 10, 11, 12, 13, 14, 15, 16, 17]]


def assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, target, others, n, chunks):
    """Run `target` alone, then first in a batch with `others` (their prompts chunked by `chunks`, so
    the target's prefill and decode steps share the batch with other prefills and decodes)."""
    alone_tokens, alone_logits = greedy_generate(runner, allocator, [target], n)
    batch_tokens, batch_logits = greedy_generate(runner, allocator, [target] + others, n,
                                                 chunk_sizes=[len(target)] + chunks)
    assert batch_tokens[0] == alone_tokens[0]
    diffs = [(a - b).abs().max().item() for a, b in zip(alone_logits[0], batch_logits[0])]
    assert all(torch.equal(a, b) for a, b in zip(alone_logits[0], batch_logits[0])), f"max abs diffs {diffs}"


def run_step(sched: Scheduler) -> list:
    """Pretend the model ran one scheduled step: advance the computed tokens and append a token to the
    sequences at their end; returns the step's sequences (scheduler and LoRA-admission tests)."""
    out = sched.schedule()
    sched.update_from_output(out)
    for seq in out.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(1)
    return out.seqs


def random_paged_case(starts: list[int], lengths: list[int], heads: int, kv_heads: int, head_dim: int,
                      block_size: int, seed: int, num_blocks: int = 256):
    """Random K/V for every sequence's whole context in a paged cache with shuffled block ids, and
    queries for the step's rows. Returns (q, k_cache, v_cache, meta, keys, values)."""
    g = torch.Generator().manual_seed(seed)
    ctx = [s + n for s, n in zip(starts, lengths)]
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for c in ctx:
        need = num_blocks_needed(c, block_size)
        tables.append(ids[:need])
        ids = ids[need:]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)   # junk outside contexts
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    keys = [torch.randn(c, kv_heads, head_dim, generator=g) for c in ctx]
    values = [torch.randn(c, kv_heads, head_dim, generator=g) for c in ctx]
    write_kv(k_cache, v_cache, torch.cat(keys), torch.cat(values),
             build_slot_mapping(tables, [0] * len(ctx), ctx, block_size))
    meta = make_meta(tables, starts, lengths, block_size)
    q = torch.randn(sum(lengths), heads, head_dim, generator=g)
    return q, k_cache, v_cache, meta, keys, values


def make_meta(tables: list[list[int]], starts: list[int], lengths: list[int], block_size: int) -> AttentionMetadata:
    ctx = [s + n for s, n in zip(starts, lengths)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return AttentionMetadata(
        slot_mapping=build_slot_mapping(tables, starts, lengths, block_size),
        block_tables=build_block_tables(tables), context_lens=torch.tensor(ctx, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), query_lens=list(lengths), context_lens_host=ctx,
        block_size=block_size)


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
