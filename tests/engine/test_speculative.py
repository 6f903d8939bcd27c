"""Speculative decoding changes nothing but the speed: with each proposer, verified drafts give bitwise the plain
decode's tokens and log probs (greedy and seeded, penalties, logit controls, grammars, stops), alone and beside
rows that do not draft, in every CPU precision; counts and KV blocks are right.

The tiny random model copies nothing, so besides the real proposers (n-gram, the target as its own draft) an
oracle proposer drafts the plain run's own tokens with every third one wrong: accepted runs, rejections at each
position, and stops inside a drafted run all happen on purpose.
"""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from lmi_handler.config import ConfigError, EngineConfig, SpeculativeConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.sequence import FinishReason, GrammarKind, SamplingParams, StructuredOutputSpec
from lmi_handler.engine.speculative import check_draft
from lmi_handler.engine.speculative.ngram import lookup
from tests.engine.helpers import ENGINE_PROMPTS as PROMPTS
from tests.engine.helpers import PRECISIONS, build_tiny_llama, build_tiny_tokenizer

P = dict(max_new_tokens=20, ignore_eos=True)
REQUESTS = {   # request id -> (prompt, params): greedy, seeded with every knob, logit controls, a beam search
    "greedy": (PROMPTS[0], SamplingParams(top_n_tokens=2, **P)),
    "seeded": (PROMPTS[1], SamplingParams(greedy=False, seed=-7, temperature=0.8, top_p=0.9, top_k=40,
                                          repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2, **P)),
    "controls": (PROMPTS[2], SamplingParams(greedy=False, seed=3, min_p=0.05, logit_bias=((7, 3.0), (9, -5.0)),
                                            bad_words=((300, 200),), min_tokens=4, **P)),
    "beams": (PROMPTS[1], SamplingParams(num_beams=2, max_new_tokens=8)),
}


class OracleProposer:
    """Drafts the plain run's next tokens (`expected`: request id -> token ids), every `wrong`-th one off by one."""

    def __init__(self, expected: dict[str, list[int]], wrong: int | None = 3):
        self.expected, self.wrong = expected, wrong

    def propose(self, seqs, ks):
        drafts = []
        for seq, k in zip(seqs, ks):
            start = seq.num_output_tokens
            tokens = list(self.expected[seq.request_id][start:start + k])
            drafts.append([(t + 1) % 512 if self.wrong and (start + j) % self.wrong == 2 else t
                           for j, t in enumerate(tokens)])
        return drafts

    def forget(self, seq):
        pass


def make_engine(model_dir, tokenizer, precision="fp32", speculative=None, max_num_seqs=8):
    dtype, quantize = PRECISIONS[precision]
    config = EngineConfig(model_path=model_dir, dtype=str(dtype).removeprefix("torch."), device_id=-1,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=None, block_size=4,
                          kv_cache_bytes=1 << 22, quantize=quantize, speculative=speculative)
    return Engine(config, tokenizer=tokenizer)


def outputs(engine, ids, requests=REQUESTS):
    """Each request's (token id, log prob, top-n) per generated token, its text and finish reason."""
    results = engine.generate([(rid, *requests[rid]) for rid in ids])
    return {rid: ([(t.id, t.log_prob, tuple(t.top_tokens or ())) for out in outs for t in out.new_tokens],
                  outs[-1].generated_text, outs[-1].finish_reason) for rid, outs in results.items()}


NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2)


def speculative_configs(model_dir) -> dict[str, SpeculativeConfig]:
    return {"ngram": NGRAM, "draft_model": SpeculativeConfig("draft_model", 3, draft_model=model_dir),
            "oracle": SpeculativeConfig("ngram", 4)}


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tiny_tokenizer):
    """The plain decode of every request in every precision, alone: what speculation must reproduce."""
    engines = {precision: make_engine(tiny_model_dir, tiny_tokenizer, precision) for precision in PRECISIONS}
    return {precision: {rid: outputs(engine, [rid])[rid] for rid in REQUESTS} for precision, engine in engines.items()}


@pytest.mark.parametrize("proposer, precision", [("ngram", "fp32"), ("draft_model", "fp32")] +
                         [("oracle", precision) for precision in sorted(PRECISIONS)])
def test_each_proposer_gives_bitwise_the_plain_tokens_and_log_probs_alone_and_batched(
        proposer, precision, plain, tiny_model_dir, tiny_tokenizer):
    engine = make_engine(tiny_model_dir, tiny_tokenizer, precision, speculative_configs(tiny_model_dir)[proposer])
    expected = {rid: [t for t, _, _ in plain[precision][rid][0]] for rid in REQUESTS}
    if proposer == "oracle":
        engine.speculator.proposer = OracleProposer(expected)
    alone = {rid: outputs(engine, [rid])[rid] for rid in ("greedy", "seeded", "controls")}
    batched = outputs(engine, list(REQUESTS))            # beside a beam search, which never drafts
    for rid in alone:
        assert alone[rid] == plain[precision][rid] == batched[rid], rid
    assert batched["beams"] == plain[precision]["beams"]
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if proposer == "oracle":   # every position drafted right and wrong: both outcomes happened
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and stats.accepted_per_pos[0] > 0
    assert engine.allocator.num_used_blocks == 0


def test_a_draft_equal_to_the_target_accepts_every_greedy_draft_and_frees_every_block(tiny_model_dir,
                                                                                      tiny_tokenizer):
    engine = make_engine(tiny_model_dir, tiny_tokenizer, speculative=SpeculativeConfig(
        "draft_model", 3, draft_model=tiny_model_dir))
    params = SamplingParams(max_new_tokens=21, ignore_eos=True)
    results = engine.generate([(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens == 3 * stats.num_drafts > 0
    assert stats.accepted_per_pos == [stats.num_drafts] * 3 and stats.mean_acceptance_length == 4.0
    assert all(len(outs) == 1 + 20 // 4 for outs in results.values())   # the first token, then 4 a step
    assert engine.allocator.num_used_blocks == 0 and engine.speculator.proposer.allocator.num_used_blocks == 0


def test_stop_strings_stop_ids_and_max_tokens_end_a_sequence_inside_a_drafted_run(plain, tiny_model_dir,
                                                                                  tiny_tokenizer):
    reference = make_engine(tiny_model_dir, tiny_tokenizer)
    engine = make_engine(tiny_model_dir, tiny_tokenizer, speculative=SpeculativeConfig("ngram", 4))
    tokens = [t for t, _, _ in plain["fp32"]["greedy"][0]]
    text = tiny_tokenizer.decode(tokens[:8])
    stop = next(text[a:a + 2] for a in range(len(text) - 6, 0, -1) if text[a:a + 2].strip() and
                text[a:a + 2] not in text[:a + 1])
    prompt = REQUESTS["greedy"][0]
    cases = {"stop string": SamplingParams(stop_sequences=(stop,), max_new_tokens=20),
             "stop id": SamplingParams(stop_token_ids=(tokens[6],), max_new_tokens=20, ignore_eos=True),
             "length": SamplingParams(max_new_tokens=7, ignore_eos=True),
             "included": SamplingParams(stop_sequences=(stop,), include_stop_str_in_output=True, max_new_tokens=20)}
    requests = {rid: (prompt, params) for rid, params in cases.items()}
    engine.speculator.proposer = OracleProposer({rid: tokens for rid in cases}, wrong=None)
    got, want = outputs(engine, list(cases), requests), outputs(reference, list(cases), requests)
    assert got == want
    assert want["stop string"][2] is FinishReason.STOP_SEQUENCE and want["stop id"][2] is FinishReason.STOP_SEQUENCE
    assert want["length"][2] is FinishReason.LENGTH and len(want["length"][0]) == 7
    assert engine.speculator.stats.num_accepted_tokens > 0 and engine.allocator.num_used_blocks == 0


def test_a_constrained_request_verifies_its_drafts_and_stays_valid(tiny_model_dir, tiny_tokenizer):
    regex = "[a-z ]{0,40}"
    params = SamplingParams(structured_output=StructuredOutputSpec(GrammarKind.REGEX, regex), max_new_tokens=16)
    seeded = replace(params, greedy=False, seed=11, temperature=1.5)
    requests = {"greedy": (PROMPTS[0], params), "seeded": (PROMPTS[2], seeded)}
    want = outputs(make_engine(tiny_model_dir, tiny_tokenizer), list(requests), requests)
    engine = make_engine(tiny_model_dir, tiny_tokenizer, speculative=SpeculativeConfig("ngram", 4))
    engine.speculator.proposer = OracleProposer({rid: [t for t, _, _ in want[rid][0]] for rid in requests})
    got = outputs(engine, list(requests), requests)
    assert got == want
    for tokens, _, reason in got.values():     # the text before the eos (the tiny tokenizer spells eos "!")
        ids = [t for t, _, _ in tokens]
        assert re.fullmatch(regex, tiny_tokenizer.decode(ids[:-1] if reason is FinishReason.EOS_TOKEN else ids))
    assert 0 < engine.speculator.stats.num_accepted_tokens < engine.speculator.stats.num_draft_tokens


def test_a_lora_request_verifies_its_drafts_under_its_adapter(tiny_model_dir, tiny_tokenizer, tmp_path):
    from transformers import LlamaConfig

    from lmi_handler.config import LoraConfig
    from tests.engine.lora_helpers import write_peft_adapter

    write_peft_adapter(tmp_path / "a", LlamaConfig.from_pretrained(tiny_model_dir), seed=11)
    requests = {"adapter": (PROMPTS[0], SamplingParams(adapter="a", top_n_tokens=1, **P)),
                "base": (PROMPTS[2], SamplingParams(greedy=False, seed=2, **P))}

    def engine(speculative=None):
        config = EngineConfig(model_path=tiny_model_dir, dtype="float32", device_id=-1, max_num_seqs=4,
                              max_num_batched_tokens=64, max_model_len=None, block_size=4, kv_cache_bytes=1 << 22,
                              speculative=speculative,
                              lora=LoraConfig(max_loras=2, max_cpu_loras=2, adapter_roots=(tmp_path,)))
        built = Engine(config, tokenizer=tiny_tokenizer)
        built.adapters.load("a", tmp_path / "a")
        return built

    want = outputs(engine(), list(requests), requests)
    speculating = engine(SpeculativeConfig("ngram", 4))
    speculating.speculator.proposer = OracleProposer({rid: [t for t, _, _ in want[rid][0]] for rid in requests})
    assert outputs(speculating, list(requests), requests) == want
    assert speculating.speculator.stats.num_accepted_tokens > 0


def test_above_disable_by_batch_size_running_rows_the_step_decodes_plainly(tiny_model_dir, tiny_tokenizer):
    config = SpeculativeConfig("draft_model", 2, draft_model=tiny_model_dir, disable_by_batch_size=1)
    engine = make_engine(tiny_model_dir, tiny_tokenizer, speculative=config)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.generate([("a", PROMPTS[0], params), ("b", PROMPTS[1], params)])
    assert engine.speculator.stats.num_drafts == 0
    engine.generate([("a", PROMPTS[0], params)])
    assert engine.speculator.stats.num_drafts > 0


def test_a_row_whose_drafts_keep_failing_decodes_plainly_for_a_while(plain, tiny_model_dir, tiny_tokenizer):
    from lmi_handler.engine.speculative.speculator import LOW_ACCEPTANCE_AFTER

    engine = make_engine(tiny_model_dir, tiny_tokenizer, speculative=SpeculativeConfig("ngram", 4))
    tokens = [t for t, _, _ in plain["fp32"]["greedy"][0]]
    engine.speculator.proposer = OracleProposer({"greedy": [(t + 1) % 512 for t in tokens]}, wrong=None)
    assert outputs(engine, ["greedy"]) == {"greedy": plain["fp32"]["greedy"]}
    stats = engine.speculator.stats
    # 4 steps of 4 wrong drafts (16 drafted, none kept), then plain decode for the 15 tokens left (paused 16 steps)
    assert stats.num_accepted_tokens == 0 and stats.num_draft_tokens == LOW_ACCEPTANCE_AFTER == 16
    assert stats.num_drafts == 4 and len(tokens) == 20


def test_ngram_lookup_drafts_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3], dtype=np.int64)
    assert lookup(tokens, 3, 1, 3) == [4, 7, 8]           # "2 3" last seen before "4 7 8"
    assert lookup(tokens, 2, 3, 3) == []                   # "8 2 3" never seen before
    assert lookup(np.array([5, 6, 5]), 4, 1, 2) == [6, 5]   # the continuation may run into the suffix itself
    assert lookup(np.array([5]), 3, 1, 2) == []


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused_naming_both(tmp_path, tiny_model_dir,
                                                                              tiny_tokenizer):
    small = tmp_path / "small_vocab"
    build_tiny_llama(small, vocab_size=384)
    with pytest.raises(ConfigError, match=f"{small}.* 384 ids, the target {tiny_model_dir} 512"):
        check_draft(small, tiny_model_dir, 512, tiny_tokenizer)
    other = tmp_path / "other_tokenizer"
    build_tiny_llama(other)
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["<another>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match=f"{other} has another tokenizer than the target {tiny_model_dir}"):
        check_draft(other, tiny_model_dir, 512, tiny_tokenizer)
    with pytest.raises(ConfigError, match="has no config.json"):
        check_draft(tmp_path / "missing", tiny_model_dir, 512, tiny_tokenizer)


# ---- the demo model: a prompt the n-gram proposer copies from, and a layer-truncated draft --------------------


def truncated_copy(model_dir, out, num_layers: int):
    """The demo checkpoint with only its first num_layers decoder layers (same embeddings, norm and tokenizer)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
    weights = load_file(model_dir / "model.safetensors")
    save_file({name: w for name, w in weights.items()
               if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers},
              out / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out


@pytest.mark.slow
def test_on_the_demo_model_ngram_and_a_truncated_draft_give_the_plain_tokens_and_ngram_copies_its_lines(
        model_dir, tokenizer, tmp_path):
    lines = "".join(f"{i}. The quick brown fox jumps over the lazy dog.\n" for i in range(1, 5))
    prompt = tokenizer(lines + "5. The quick")["input_ids"]      # a list the model goes on with, copying its lines
    requests = {"greedy": (prompt, SamplingParams(max_new_tokens=24, ignore_eos=True, top_n_tokens=1))}

    def engine(speculative=None):
        config = EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=4,
                              max_num_batched_tokens=256, max_model_len=1024, block_size=16, kv_cache_bytes=1 << 26,
                              speculative=speculative)
        return Engine(config, tokenizer=tokenizer)

    want = outputs(engine(), ["greedy"], requests)
    ngram = engine(SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=4))
    assert outputs(ngram, ["greedy"], requests) == want
    stats = ngram.speculator.stats
    assert stats.num_accepted_tokens > stats.num_draft_tokens / 2, (stats, want["greedy"][1])   # it copies
    draft = engine(SpeculativeConfig("draft_model", 3, draft_model=truncated_copy(model_dir, tmp_path, 2)))
    assert outputs(draft, ["greedy"], requests) == want
    assert draft.speculator.stats.num_draft_tokens > 0
