"""Fault isolation in the engine step (engine/faults.py) on a tiny random Llama: a fault ends only its sequences."""
from __future__ import annotations

import pytest

from lmi_handler.engine.faults import FaultInjector, FaultRule, InjectedFault, StepGuard
from lmi_handler.engine.sequence import SamplingParams, Sequence
from tests.engine.helpers import ENGINE_PROMPTS as PROMPTS
from tests.engine.helpers import make_engine

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


def solo_tokens(engine, prompt) -> list[int]:
    results = engine.generate([("solo", prompt, PARAMS)])
    return [t.id for out in results["solo"] for t in out.new_tokens]


def drive(guard: StepGuard, join: dict[int, list[tuple[str, list[int]]]] | None = None):
    """Step until idle (adding the requests of `join[step]` before that step); returns (tokens by id, failed)."""
    engine, tokens, failed, step = guard.engine, {}, {}, 0
    while engine.has_unfinished or (join and step <= max(join)):
        for request_id, prompt in (join or {}).get(step, []):
            engine.add_request(request_id, prompt, PARAMS)
        outputs, hit = guard.step()
        failed.update(hit)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(t.id for t in out.new_tokens)
        step += 1
    return tokens, failed


def test_a_decode_fault_ends_only_the_hit_sequence_and_the_others_keep_their_solo_tokens(tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, tokenizer)
    solo = {i: solo_tokens(engine, p) for i, p in enumerate(PROMPTS)}
    FaultInjector(engine, FaultRule.parse_all("decode:3@id=r1"))
    guard = StepGuard(engine)
    for _ in range(3):   # rounds in a row: nothing leaks
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, PARAMS)
        tokens, failed = drive(guard)
        assert list(failed) == ["r1"] and "InjectedFault" in failed["r1"]
        assert tokens["r1"] == solo[1][:3]          # its tokens before the faulted step were sent
        assert tokens["r0"] == solo[0] and tokens["r2"] == solo[2]
        assert engine.allocator.num_used_blocks == 0 and not engine.seqs


def test_a_fault_in_a_joining_prefill_fails_that_admission_alone_not_the_others_joining_with_it(
        tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, tokenizer)
    solo = {i: solo_tokens(engine, p) for i, p in enumerate(PROMPTS)}
    FaultInjector(engine, FaultRule.parse_all("prefill@" + tokenizer.decode(PROMPTS[1])))
    guard = StepGuard(engine)
    engine.add_request("r0", PROMPTS[0], PARAMS)
    tokens, failed = drive(guard, join={3: [("r1", PROMPTS[1]), ("r2", PROMPTS[2])]})
    assert list(failed) == ["r1"] and "r1" not in tokens
    assert tokens["r0"] == solo[0] and tokens["r2"] == solo[2]
    assert engine.allocator.num_used_blocks == 0


def test_a_pinned_fault_names_its_sequences_and_nothing_is_retried(tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, tokenizer)
    solo = {i: solo_tokens(engine, p) for i, p in enumerate(PROMPTS)}
    FaultInjector(engine, FaultRule.parse_all("pinned:decode:2@id=r0"))
    guard = StepGuard(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens, failed = drive(guard)
    assert list(failed) == ["r0"] and "SequenceFault" in failed["r0"]
    assert tokens["r1"] == solo[1] and tokens["r2"] == solo[2] and tokens["r0"] == solo[0][:2]


def test_a_fault_only_the_whole_batch_triggers_fails_the_newest_sequence_never_the_batch(tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, tokenizer)
    solo = {i: solo_tokens(engine, p) for i, p in enumerate(PROMPTS)}
    schedule = engine.scheduler.schedule

    def fails_with_three():   # a fault no single sequence causes
        out = schedule()
        if len(out.seqs) == 3 and all(not s.is_prefill for s in out.seqs):
            raise InjectedFault("the batch of three fails")
        return out

    engine.scheduler.schedule = fails_with_three
    guard = StepGuard(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens, failed = drive(guard)
    assert len(failed) == 1
    (newest,) = failed
    for i in range(3):
        if f"r{i}" != newest:
            assert tokens[f"r{i}"] == solo[i]
    assert engine.allocator.num_used_blocks == 0


def seq(request_id: str, prompt_len: int, computed: int, outputs: int) -> Sequence:
    s = Sequence(request_id, list(range(prompt_len)), SamplingParams())
    s.num_computed_tokens, s.output_token_ids = computed, list(range(outputs))
    return s


def test_fault_rules_pick_the_sequence_by_prompt_text_or_id_and_the_stage():
    decode4, prefill, by_id = FaultRule.parse_all("decode:4@Water is; prefill@id=r7;pinned:decode:1@id=r9")
    assert (decode4.stage, decode4.decode_step, decode4.marker) == ("decode", 4, "Water is")
    assert prefill.request_id == "r7" and by_id.pinned
    assert decode4.hits(seq("a", 3, 6, 4), "Water is wet") and not decode4.hits(seq("a", 3, 5, 3), "Water is")
    assert not decode4.hits(seq("a", 3, 6, 4), "The sky is")
    assert prefill.hits(seq("r7", 10, 4, 0), "") and prefill.hits(seq("r7#1", 10, 0, 0), "")
    assert not prefill.hits(seq("r7", 10, 10, 1), "") and not prefill.hits(seq("r70", 10, 0, 0), "")
    for bad in ("decode@x", "decode:0@x", "prefill:2@x", "boom@x", "decode:4", "decode:4@"):
        with pytest.raises(ValueError, match="fault_injection"):
            FaultRule.parse(bad)
