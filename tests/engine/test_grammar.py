"""Tests for engine/grammar.py and structured output through the engine (llguidance, real compiles).

Specs and masks on the tiny tokenizer; the tiny engine for the promises (outputs match, batch invariance,
seeded reproducibility, compiles off the loop, the time limit); the demo model for 32 JSON-schema prompts.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import replace

import pytest

from lmi_handler.config import EngineConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.grammar import GrammarCompiler
from lmi_handler.engine.grammar_spec import GrammarError, check_spec, grammar_source
from lmi_handler.engine.logits_controls import unpack_bitmask
from lmi_handler.engine.sequence import FinishReason, GrammarKind, SamplingParams, Sequence, StructuredOutputSpec
from tests.engine.helpers import ENGINE_PROMPTS as PROMPTS
from tests.engine.helpers import make_engine, run
from tests.helpers import JSON_SCHEMAS as SCHEMAS
from tests.helpers import SCHEMA_SUBJECTS as SUBJECTS

EOS = 2     # the tiny model's eos (its tokenizer's own eos, id 1, is an ordinary token to the engine)


def spec(kind, value="", **kw) -> StructuredOutputSpec:
    return StructuredOutputSpec(GrammarKind(kind), value, **kw)


def schema_spec(schema: dict, **kw) -> StructuredOutputSpec:
    return spec("json_schema", json.dumps(schema), **kw)


COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
         "required": ["color", "n"], "additionalProperties": False}


@pytest.mark.parametrize("bad, reason", [
    (spec("json_schema", "{not json"), "not valid JSON"),
    (spec("json_schema", "[1, 2]"), "object or a boolean"),
    (schema_spec({"type": "foo"}), "foo"),
    (schema_spec({"type": "string", "format": "no-such-format"}), "no-such-format"),
    (spec("regex", "(yes|no"), "unclosed group"),
    (spec("grammar", "start: undefined_rule"), "undefined_rule"),
    (spec("grammar", 'root ::= "a" ('), "does not parse"),
    (spec("choice"), "at least one choice"),
])
def test_an_invalid_spec_is_refused_with_its_reason(bad, reason):
    with pytest.raises(GrammarError, match=re.escape(reason)):
        check_spec(bad)


@pytest.mark.parametrize("good", [schema_spec(COLOR), spec("json_object"), spec("regex", r"[a-c]{3}-[0-9]{2}"),
                                  spec("choice", choices=("yes", "no")), spec("grammar", 'start: "x" NUM\nNUM: /[0-9]+/'),
                                  spec("grammar", 'root ::= "yes" | "no"')])
def test_valid_specs_pass_the_check(good):
    check_spec(good)


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    return GrammarCompiler(tiny_tokenizer, 600, (EOS,), compile_timeout_s=30.0)   # logits wider than the vocab


def compiled_seq(compiler, s: StructuredOutputSpec, stop_token_ids=()) -> Sequence:
    """A sequence holding its compiled grammar (waits for the compile, which may queue behind another one)."""
    seq = Sequence("r", [5], SamplingParams(stop_token_ids=stop_token_ids, structured_output=s))
    ticket = compiler.submit(s)
    ticket.future.result(timeout=30)
    seq.grammar = ticket.outcome(time.monotonic(), (EOS,) + tuple(stop_token_ids))
    return seq


def allowed(compiler, seq) -> set[int]:
    return set(unpack_bitmask(compiler.fill_bitmask([seq]), 600)[0].nonzero().flatten().tolist())


def test_the_mask_follows_the_grammar_covers_the_padded_vocabulary_and_adds_end_ids_where_it_may_end(
        compiler, tiny_tokenizer):
    compiler.validate(spec("choice", choices=("yes", "no")))
    seq = compiled_seq(compiler, spec("choice", choices=("yes", "no")), stop_token_ids=(77,))
    first = allowed(compiler, seq)
    assert first and all(t < 512 for t in first) and EOS not in first and 77 not in first
    assert all(tiny_tokenizer.decode([t]) and ("yes".startswith(tiny_tokenizer.decode([t]))
                                              or "no".startswith(tiny_tokenizer.decode([t]))) for t in first)
    for t in tiny_tokenizer.encode("yes", add_special_tokens=False):
        assert seq.grammar.advance(t) == (False, None)
    assert allowed(compiler, seq) == {EOS, 77}          # only an end id may follow the finished grammar
    assert seq.grammar.advance(77) == (True, None)


def test_json_whitespace_runs_are_bounded(compiler, tiny_tokenizer):
    for gap, ok in ((" " * 4, True), (" " * 9, False)):
        seq = compiled_seq(compiler, schema_spec(COLOR, max_whitespace=8))
        errors = [seq.grammar.advance(t)[1] for t in tiny_tokenizer.encode('{"color":' + gap + '"red"',
                                                                           add_special_tokens=False)]
        assert (all(e is None for e in errors)) is ok


def test_a_rejected_token_is_an_error_not_a_silent_pass(compiler, tiny_tokenizer):
    seq = compiled_seq(compiler, spec("regex", "[0-9]+"))
    ended, error = seq.grammar.advance(tiny_tokenizer.encode("x", add_special_tokens=False)[0])
    assert not ended and "rejected" in error


def test_grammar_source_of_a_choice_matches_exactly_the_choices():
    assert '"yes"' in grammar_source(spec("choice", choices=("yes", 'a "b"')))


# --- through the tiny engine -------------------------------------------------------------------------------

def text_before_eos(tokenizer, token_ids: list[int]) -> str:
    assert token_ids and token_ids[-1] == EOS
    return tokenizer.decode(token_ids[:-1])


SPECS = [spec("choice", choices=("yes", "no", "maybe")), spec("regex", r"[a-c]{3}-[0-9]{2}"),
         schema_spec(COLOR, max_whitespace=1)]


def check_output(s: StructuredOutputSpec, text: str) -> None:
    import jsonschema

    if s.kind is GrammarKind.CHOICE:
        assert text in s.choices
    elif s.kind is GrammarKind.REGEX:
        assert re.fullmatch(s.value, text)
    else:
        jsonschema.validate(json.loads(text), json.loads(s.value))


def test_constrained_outputs_match_their_spec_greedy_and_sampled(tiny_model_dir, tiny_tokenizer):
    engine = make_engine(tiny_model_dir, tiny_tokenizer, max_num_seqs=8)
    params = [SamplingParams(max_new_tokens=120, structured_output=s) for s in SPECS]
    params += [replace(p, greedy=False, seed=seed) for p in params for seed in (1, 2)]
    ids, results = run(engine, [PROMPTS[i % 3] for i in range(len(params))], params)
    finished = 0
    for i, p in enumerate(params):
        final = results[f"r{i}"][-1]
        assert final.finish_reason in (FinishReason.EOS_TOKEN, FinishReason.LENGTH), final.error
        if final.finish_reason is FinishReason.EOS_TOKEN:
            finished += 1
            check_output(p.structured_output, text_before_eos(tiny_tokenizer, ids[f"r{i}"]))
    assert finished >= 6
    assert engine.allocator.num_used_blocks == 0 and len(engine.grammars._cache) == 3   # compiled once each


def test_a_constrained_seeded_row_is_the_same_alone_and_beside_other_constrained_rows(tiny_model_dir,
                                                                                    tiny_tokenizer):
    target = SamplingParams(greedy=False, seed=11, max_new_tokens=30, structured_output=SPECS[2])
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    alone, _ = run(engine, [PROMPTS[0]], [target])
    crowd, _ = run(engine, [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                   [SamplingParams(max_new_tokens=20, structured_output=SPECS[1]), target,
                    SamplingParams(greedy=False, seed=3, max_new_tokens=9, structured_output=SPECS[0])])
    assert crowd["r1"] == alone["r0"]
    again, _ = run(engine, [PROMPTS[0]], [target])
    assert again["r0"] == alone["r0"]


def test_max_tokens_before_the_grammar_ends_finishes_with_length(tiny_model_dir, tiny_tokenizer):
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    _, results = run(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=3, structured_output=SPECS[2])])
    assert results["r0"][-1].finish_reason is FinishReason.LENGTH


LARGE = {"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 50 + 1}}}[0-9]+x{i}$"} for i in range(3000)},
    "required": [f"p{i}" for i in range(3000)]}   # about a second to compile on this machine


def test_a_slow_compile_does_not_pause_the_other_streams_and_holds_no_blocks(tiny_model_dir, tiny_tokenizer):
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    engine.add_request("stream", PROMPTS[1], SamplingParams(max_new_tokens=200, ignore_eos=True))
    engine.step()                                                   # prefill: the stream is running
    # a schema no other test compiled (the grammar cache is shared by spec, so LARGE itself may be compiled already)
    fresh = dict(LARGE, title=f"slow-{uuid.uuid4().hex}")
    engine.add_request("slow", PROMPTS[0], SamplingParams(max_new_tokens=4, structured_output=schema_spec(fresh)))
    slow = engine.seqs["slow"]
    tokens_while_compiling, done = 0, {}
    while slow.waiting_for_grammar and "slow" not in done:
        assert slow.block_table == [] and slow in engine.scheduler.waiting
        outputs = engine.step()
        done.update((out.request_id, out) for out in outputs)
        tokens_while_compiling += sum(len(o.new_tokens) for o in outputs if o.request_id == "stream")
    assert tokens_while_compiling >= 2, "the stream must keep producing tokens while the grammar compiles"
    while engine.has_unfinished:
        done.update((out.request_id, out) for out in engine.step())
    assert done["slow"].error is None, done["slow"].error
    assert done["slow"].finish_reason in (FinishReason.EOS_TOKEN, FinishReason.LENGTH)
    assert done["stream"].num_generated_tokens == 200


def test_a_compile_past_the_limit_fails_only_its_request(tiny_model_dir, tiny_tokenizer):
    config = EngineConfig(model_path=tiny_model_dir, dtype="float32", device_id=-1, max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=None, block_size=4, kv_cache_bytes=1 << 22,
                          structured_output_compile_timeout_s=0.05)
    engine = Engine(config, tokenizer=tiny_tokenizer)
    engine.grammars.validate(SPECS[0])                 # a small grammar compiled within the limit beforehand
    ids, results = run(engine, [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [
        SamplingParams(max_new_tokens=4, structured_output=schema_spec(LARGE)),
        SamplingParams(max_new_tokens=6, ignore_eos=True), SamplingParams(max_new_tokens=6, structured_output=SPECS[0])])
    failed = results["r0"][-1]
    assert failed.finish_reason is FinishReason.ERROR and failed.invalid_request and ids["r0"] == []
    assert "structured_output_compile_timeout_s (0.05 s)" in failed.error
    assert results["r1"][-1].num_generated_tokens == 6
    assert results["r2"][-1].finish_reason is not FinishReason.ERROR
    with pytest.raises(GrammarError, match="structured_output_compile_timeout_s"):
        engine.grammars.validate(schema_spec(dict(LARGE, required=["p0"])))


def test_a_compile_that_ended_past_the_limit_fails_even_when_the_loop_asks_late(tiny_model_dir, tiny_tokenizer):
    # the outcome follows when the compile ended, not when the engine loop came round: here the loop asks only
    # after the compile has finished (as a long step, or a loaded machine, would make it), past the 0.05 s limit
    config = EngineConfig(model_path=tiny_model_dir, dtype="float32", device_id=-1, max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=None, block_size=4, kv_cache_bytes=1 << 22,
                          structured_output_compile_timeout_s=0.05)
    engine = Engine(config, tokenizer=tiny_tokenizer)
    fresh = dict(LARGE, title=f"late-{uuid.uuid4().hex}")
    engine.add_request("late", PROMPTS[0], SamplingParams(max_new_tokens=4, structured_output=schema_spec(fresh)))
    compiled = engine.seqs["late"].grammar_ticket.future.result(timeout=120)
    assert compiled.finished_at > engine.seqs["late"].grammar_ticket.deadline
    done = {}
    while engine.has_unfinished:
        done.update((out.request_id, out) for out in engine.step())
    assert done["late"].finish_reason is FinishReason.ERROR and done["late"].invalid_request
    assert "structured_output_compile_timeout_s" in done["late"].error and done["late"].new_tokens == []
    # the same compile, cached, serves a request that arrives after it ended (its deadline is its own)
    engine.add_request("cached", PROMPTS[0], SamplingParams(max_new_tokens=4, structured_output=schema_spec(fresh)))
    while engine.has_unfinished:
        done.update((out.request_id, out) for out in engine.step())
    assert done["cached"].error is None and done["cached"].num_generated_tokens >= 1


def test_an_invalid_grammar_fails_its_request_before_any_token(tiny_model_dir, tiny_tokenizer):
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    ids, results = run(engine, [PROMPTS[0], PROMPTS[1]],
                       [SamplingParams(structured_output=spec("regex", "(a|b")), SamplingParams(max_new_tokens=3)])
    assert results["r0"][-1].invalid_request and "unclosed group" in results["r0"][-1].error and ids["r0"] == []
    assert results["r1"][-1].num_generated_tokens == 3


# --- the demo model ---------------------------------------------------------------------------------------

def chat_ids(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


@pytest.mark.slow
def test_demo_model_outputs_for_32_json_schema_prompts_validate_when_they_finish(model_dir, tokenizer):
    import jsonschema

    config = EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=32,
                          max_num_batched_tokens=2048, max_model_len=None, block_size=16, kv_cache_bytes=1 << 28)
    engine = Engine(config, tokenizer=tokenizer)
    requests = []
    for i in range(32):
        schema = SCHEMAS[i % 4]
        text = (f"Describe {SUBJECTS[i % 8]} as a JSON object with the keys {', '.join(schema['required'])}. "
                "Answer with JSON only.")
        ids = chat_ids(tokenizer, text)
        params = SamplingParams(max_new_tokens=160, structured_output=schema_spec(schema))
        if i % 2:
            params = replace(params, greedy=False, temperature=0.7, seed=i)
        requests.append((f"r{i}", ids, params))
    results = engine.generate(requests)
    finished = 0
    for rid, _, params in requests:
        final = results[rid][-1]
        assert final.finish_reason in (FinishReason.EOS_TOKEN, FinishReason.LENGTH), final.error
        if final.finish_reason is FinishReason.EOS_TOKEN:
            finished += 1
            jsonschema.validate(json.loads(final.generated_text), json.loads(params.structured_output.value))
    assert finished >= 24, f"only {finished} of 32 finished within 160 tokens"

    choice = SamplingParams(max_new_tokens=8, structured_output=spec("choice", choices=("yes", "no")))
    regex = SamplingParams(max_new_tokens=16, structured_output=spec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    ask = [chat_ids(tokenizer, q)
           for q in ("Is the sky blue? Answer yes or no.", "When did the Apollo 11 landing happen? Give the date.")]
    _, small = run(engine, ask, [choice, regex])
    assert small["r0"][-1].generated_text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", small["r1"][-1].generated_text)
    assert engine.allocator.num_used_blocks == 0


def test_every_beam_of_a_constrained_beam_search_matches_its_grammar(tiny_model_dir, tiny_tokenizer):
    engine = make_engine(tiny_model_dir, tiny_tokenizer, max_num_seqs=8)
    regex = spec("regex", r"[a-c]{2,6}")
    ids, results = run(engine, [PROMPTS[0], PROMPTS[1]],
                       [SamplingParams(max_new_tokens=10, num_beams=3, structured_output=regex),
                        SamplingParams(max_new_tokens=10, num_beams=2, structured_output=SPECS[0])])
    for rid, s in (("r0", regex), ("r1", SPECS[0])):
        beams = results[rid][-1].beams
        assert len(beams) == int(rid == "r0") + 2
        for beam in beams:
            assert beam.finish_reason is FinishReason.EOS_TOKEN
            check_output(s, text_before_eos(tiny_tokenizer, [t.id for t in beam.tokens]))
    assert engine.allocator.num_used_blocks == 0
