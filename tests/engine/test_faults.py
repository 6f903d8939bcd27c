"""Fault isolation in the engine step (engine/faults.py) on a tiny random Llama: a fault ends only its sequences,
unless the engine itself is dead."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.engine import RequestRejected
from lmi_handler.engine.faults import FaultInjector, FaultRule, InjectedFault, StepGuard
from lmi_handler.engine.health import EngineDead, EngineHealth
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


# ---- a dead engine (rules 4 and 5) ---------------------------------------------------------------

def test_fault_rule_kinds_parse_and_a_kind_prefix_is_not_taken_for_a_stage():
    broken, cuda, pinned, plain = FaultRule.parse_all(
        "broken:prefill@Zebras; cuda:decode:2@id=r3; pinned:decode:1@id=r9; decode:4@broken:")
    assert broken.kind == "broken" and broken.breaks_engine and broken.marker == "Zebras"
    assert cuda.kind == "cuda" and cuda.breaks_engine and (cuda.decode_step, cuda.request_id) == (2, "r3")
    assert pinned.pinned and not pinned.breaks_engine
    assert plain.kind == "plain" and plain.marker == "broken:" and not plain.breaks_engine
    for bad in ("broken:@x", "broken:decode@x", "cuda:prefill:1@x", "dead:prefill@x", "broken:prefill"):
        with pytest.raises(ValueError, match="fault_injection"):
            FaultRule.parse(bad)


def test_an_engine_broken_for_good_is_marked_dead_every_sequence_dropped_and_every_later_step_refused(
        tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, tokenizer)
    FaultInjector(engine, FaultRule.parse_all("broken:decode:3@id=r1"))
    health = EngineHealth()
    guard = StepGuard(engine, health)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens = {}
    with pytest.raises(EngineDead) as dead:
        while True:
            outputs, failed = guard.step()
            assert not failed, "a broken engine must not be mistaken for a per-request fault"
            for out in outputs:
                tokens.setdefault(out.request_id, []).extend(t.id for t in out.new_tokens)
    assert not health.alive and health.dead.reason == dead.value.reason
    assert "probe" in dead.value.reason and "broken for good" in dead.value.reason
    assert not engine.seqs and engine.allocator.num_used_blocks == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert len(tokens["r1"]) == 3     # it died in the step computing r1's fourth token
    engine.add_request("late", PROMPTS[0], PARAMS)
    with pytest.raises(EngineDead):   # from now on at once, before any step
        guard.step()
    assert engine.seqs["late"].num_computed_tokens == 0


@pytest.mark.parametrize("alone", [True, False], ids=["one_request", "three_joining_together"])
def test_an_engine_that_breaks_as_requests_join_is_found_dead_in_that_very_step(tiny_model_dir, tokenizer, alone):
    """Every sequence of the step is a new admission: stepping without them is an empty step, which proves
    nothing; each would fail alone forever if that counted as a working step."""
    engine = make_engine(tiny_model_dir, tokenizer)
    FaultInjector(engine, FaultRule.parse_all("broken:prefill@id=r0"))
    guard = StepGuard(engine)
    for i, prompt in enumerate(PROMPTS[:1] if alone else PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    with pytest.raises(EngineDead, match="probe"):
        guard.step()
    assert not engine.seqs and engine.allocator.num_used_blocks == 0


def test_a_cuda_error_marks_the_engine_dead_at_once_without_isolating(tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, tokenizer)
    FaultInjector(engine, FaultRule.parse_all("cuda:prefill@id=r2"))
    schedule, calls = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: calls.append(1) or schedule()
    guard = StepGuard(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    with pytest.raises(EngineDead, match="illegal memory access") as dead:
        guard.step()
    assert dead.value.reason.startswith("RuntimeError: CUDA error")
    assert len(calls) == 1 and not engine.seqs and engine.allocator.num_used_blocks == 0


def raise_rank_gone():
    raise torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1")


def raise_accelerator_error():
    raise torch.AcceleratorError("CUDA error: unspecified launch failure")


def raise_while_handling_a_fatal_error():
    try:
        raise torch.distributed.DistNetworkError("connection to rank 1 reset")
    except torch.distributed.DistNetworkError:
        raise ValueError("a bad row")  # noqa: B904 - the implicit chain is what is under test


@pytest.mark.parametrize("fail", [raise_rank_gone, raise_accelerator_error, raise_while_handling_a_fatal_error])
def test_a_forward_raising_a_fatal_error_marks_the_engine_dead(tiny_model_dir, tokenizer, fail):
    engine = make_engine(tiny_model_dir, tokenizer)
    execute = engine.runner.execute

    def forward_fails(model_input):
        fail()

    engine.add_request("r0", PROMPTS[0], PARAMS)
    engine.runner.execute = forward_fails
    guard = StepGuard(engine)
    with pytest.raises(EngineDead):
        guard.step()
    engine.runner.execute = execute        # the device came back: too late, dead is for good
    with pytest.raises(EngineDead):
        guard.step()


def test_out_of_memory_and_a_fault_on_the_only_sequence_stay_per_request_and_the_engine_serves_on(
        tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, tokenizer)
    solo = solo_tokens(engine, PROMPTS[2])
    FaultInjector(engine, FaultRule.parse_all("decode:2@id=lonely"))
    execute, oom = engine.runner.execute, []

    def out_of_memory_once(model_input):
        if not oom:
            oom.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return execute(model_input)

    health = EngineHealth()
    guard = StepGuard(engine, health)
    FaultInjector(engine, FaultRule.parse_all("prefill@" + tokenizer.decode([engine.eos_token_ids[0]])))
    engine.add_request("lonely", PROMPTS[1], PARAMS)        # fails alone: the probe says it is not the engine
    tokens, failed = drive(guard)
    assert list(failed) == ["lonely"] and health.alive
    engine.runner.execute = out_of_memory_once
    engine.add_request("oom", PROMPTS[0], PARAMS)
    tokens, failed = drive(guard)
    assert list(failed) == ["oom"] and "OutOfMemoryError" in failed["oom"] and health.alive
    engine.add_request("after", PROMPTS[2], PARAMS)
    tokens, failed = drive(guard)
    assert not failed and tokens["after"] == solo and health.alive
    assert engine.allocator.num_used_blocks == 0


def test_a_refused_request_never_reaches_the_guard_and_leaves_the_engine_alive(tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, tokenizer)
    guard = StepGuard(engine)
    with pytest.raises(RequestRejected):
        engine.add_request("too-long", PROMPTS[0], SamplingParams(max_new_tokens=10_000))
    engine.add_request("ok", PROMPTS[1], PARAMS)
    tokens, failed = drive(guard)
    assert not failed and len(tokens["ok"]) == PARAMS.max_new_tokens and guard.health.alive


def test_after_a_whole_batch_failure_check_failure_tells_a_dead_engine_from_a_bad_request(tiny_model_dir, tokenizer):
    """The dynamic batch runs engine.generate without the guard's isolation; check_failure classifies after."""
    engine = make_engine(tiny_model_dir, tokenizer)
    injector = FaultInjector(engine, FaultRule.parse_all("prefill@id=bad; broken:prefill@id=breaker"))
    guard = StepGuard(engine)
    for request_id in ("bad", "breaker"):
        with pytest.raises(InjectedFault) as failure:
            engine.generate([(request_id, PROMPTS[0], PARAMS), ("other", PROMPTS[1], PARAMS)])
        assert not engine.seqs              # generate aborted its requests on the way out
        if request_id == "bad":
            guard.check_failure(failure.value)    # the probe works: the engine is fine
            assert guard.health.alive and injector.broken_by is None
    with pytest.raises(EngineDead, match="probe"):
        guard.check_failure(failure.value)
    assert not guard.health.alive


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
