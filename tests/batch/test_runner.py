"""The offline runner on the demo model: every example of the batch input format, bad lines, seeds, resume."""
from __future__ import annotations

import json

import jsonschema
import pytest

from lmi_handler.batch.runner import BatchRunner, EngineFailed
from lmi_handler.engine.faults import FaultInjector, FaultRule
from lmi_handler.protocol.batch_lines import BatchDefaults, BatchRejected
from tests.batch.helpers import (
    COMPLETIONS,
    batch_line,
    by_custom_id,
    content,
    format_example_lines,
    read_jsonl,
    write_jsonl,
)
from tests.helpers import NAMED_WEATHER, TOOLS, WEATHER_PARAMETERS, WEATHER_QUESTION

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Name three animals."}]


def run(runner, tmp_path, lines, name="run", **defaults):
    source = write_jsonl(tmp_path / f"{name}.in.jsonl", lines)
    out, err = tmp_path / f"{name}.out.jsonl", tmp_path / f"{name}.err.jsonl"
    summary = runner.run(source, out, err, BatchDefaults.parse(defaults), progress=False)
    return summary, by_custom_id(read_jsonl(out)), by_custom_id(read_jsonl(err))


def usage(record) -> dict:
    return record["response"]["body"]["usage"]


def test_every_example_of_the_input_format_gives_the_right_records(runner, tmp_path):
    lines = [
        batch_line("greedy-default", {"messages": ASK, "max_completion_tokens": 8}),
        batch_line("greedy-explicit", {"messages": ASK, "max_completion_tokens": 8, "temperature": 0}),
        batch_line("argmax-top-k-1", {"messages": ASK, "max_completion_tokens": 8, "temperature": 1.5, "top_k": 1}),
        *[batch_line(f"limit-{n}", {"messages": ASK, "max_completion_tokens": n, "ignore_eos": True})
          for n in (1, 3, 6)],
        batch_line("sampled", {"messages": ASK, "max_completion_tokens": 8, "temperature": 0.9, "top_p": 0.9,
                               "top_k": 40, "seed": 7}),
        batch_line("text", {"prompt": "The sky is", "max_tokens": 5, "ignore_eos": True}, COMPLETIONS),
        batch_line("legacy-max-tokens", {"messages": ASK, "max_tokens": 4, "ignore_eos": True}),
        batch_line("bad-url", {"input": "Hi"}, url="/v1/embeddings"),
        batch_line("bad-method", {"messages": ASK, "max_tokens": 2}, method="GET"),
        batch_line("bad-stream", {"messages": ASK, "max_tokens": 2, "stream": True}),
        batch_line("bad-param", {"messages": ASK, "max_tokens": 2, "top_p": 1.5}),
        batch_line("greedy-default", {"messages": ASK, "max_tokens": 2}),   # duplicate custom_id
        '{"custom_id": "broken", "method": "POST", "url": ',
    ]
    summary, out, err = run(runner, tmp_path, lines)
    assert (summary.total, summary.completed, summary.failed) == (15, 9, 6)
    assert set(out) == {"greedy-default", "greedy-explicit", "argmax-top-k-1", "limit-1", "limit-3", "limit-6",
                        "sampled", "text", "legacy-max-tokens"}
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out.values())
    assert content(out["greedy-default"]) == content(out["greedy-explicit"]) == content(out["argmax-top-k-1"])
    for n in (1, 3, 6):
        assert usage(out[f"limit-{n}"])["completion_tokens"] == n
        assert out[f"limit-{n}"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert out["text"]["response"]["body"]["object"] == "text_completion" and usage(out["text"])["completion_tokens"] == 5
    assert usage(out["legacy-max-tokens"])["completion_tokens"] == 4
    assert out["sampled"]["response"]["body"]["object"] == "chat.completion" and content(out["sampled"])
    assert err["bad-url"]["error"]["code"] == "invalid_url" and "/v1/embeddings" in err["bad-url"]["error"]["message"]
    assert err["bad-method"]["error"]["code"] == "invalid_method"
    assert "stream" in err["bad-stream"]["error"]["message"]
    bad_param = err["bad-param"]["response"]
    assert bad_param["status_code"] == 400 and bad_param["body"]["error"]["param"] == "top_p"
    assert err["greedy-default"]["error"]["code"] == "duplicate_custom_id" and err["greedy-default"]["error"]["line"] == 14
    assert err[None]["error"]["line"] == 15 and err[None]["error"]["code"] == "invalid_json"


def test_a_seeded_line_gives_the_same_text_alone_and_among_other_lines(runner, tmp_path):
    seeded = batch_line("seeded", {"messages": ASK, "max_completion_tokens": 10, "temperature": 0.9, "seed": 1234})
    _, alone, _ = run(runner, tmp_path, [seeded], "alone")
    others = [batch_line(f"other-{i}", {"prompt": f"Story {i}:", "max_tokens": 3 + i, "temperature": 1.0})
              for i in range(6)]
    _, crowd, _ = run(runner, tmp_path, others[:3] + [seeded] + others[3:], "crowd")
    assert content(alone["seeded"]) == content(crowd["seeded"])


def test_the_batch_length_serves_lines_without_their_own(runner, tmp_path):
    lines = [batch_line("none", {"prompt": "1, 2, 3,", "ignore_eos": True}, COMPLETIONS),
             batch_line("own", {"prompt": "1, 2, 3,", "max_tokens": 2, "ignore_eos": True}, COMPLETIONS)]
    _, out, _ = run(runner, tmp_path, lines, max_decoding_length=5)
    assert usage(out["none"])["completion_tokens"] == 5 and usage(out["own"])["completion_tokens"] == 2


def test_a_batch_with_a_line_without_any_length_is_rejected_before_any_work(runner, tmp_path):
    lines = [batch_line("ok", {"prompt": "x", "max_tokens": 2}, COMPLETIONS), batch_line("none", {"messages": ASK})]
    with pytest.raises(BatchRejected, match=r"line 2 \(none\)"):
        run(runner, tmp_path, lines)
    assert not (tmp_path / "run.out.jsonl").exists()


def test_a_line_the_model_cannot_take_fails_alone_with_the_routes_400(runner, tmp_path):
    lines = [batch_line("too-long", {"prompt": "hello " * 9000, "max_tokens": 2}, COMPLETIONS),
             batch_line("ok", {"prompt": "Hi", "max_tokens": 2}, COMPLETIONS)]
    _, out, err = run(runner, tmp_path, lines)
    assert set(out) == {"ok"}
    assert err["too-long"]["response"]["status_code"] == 400


def test_a_rerun_does_only_the_lines_without_a_result(runner, tmp_path):
    lines = [batch_line(f"r{i}", {"prompt": f"Item {i}:", "max_tokens": 2}, COMPLETIONS) for i in range(6)]
    first, out, _ = run(runner, tmp_path, lines[:4], "resume")
    write_jsonl(tmp_path / "resume.in.jsonl", lines)
    second = runner.run(tmp_path / "resume.in.jsonl", tmp_path / "resume.out.jsonl", tmp_path / "resume.err.jsonl",
                        progress=False)
    assert (first.completed, second.already_done, second.completed) == (4, 4, 6)
    records = by_custom_id(read_jsonl(tmp_path / "resume.out.jsonl"))
    assert set(records) == {f"r{i}" for i in range(6)}
    assert {k: v["id"] for k, v in records.items() if k in out} == {k: v["id"] for k, v in out.items()}


def test_the_format_example_lines_run_with_any_model_and_are_answered_by_the_served_one(runner, tmp_path):
    """Batch input format: `model` is for OpenAI compatibility, the loaded model answers every line."""
    summary, out, err = run(runner, tmp_path, format_example_lines())
    assert (summary.completed, summary.failed, err) == (5, 0, {})
    assert {record["response"]["body"]["model"] for record in out.values()} == {runner.service.model_name}
    assert content(out["m-chat"]) == content(out["served"]) == content(out["no-model"])   # greedy, same prompt


def test_constrained_and_beam_lines_are_enforced_and_a_bad_constraint_fails_alone(runner, tmp_path):
    """A batch file's bodies are OpenAI bodies: response_format, structured_outputs, guided_* and
    use_beam_search act there as on the routes; a bad regex fails its line alone with the route's 400."""
    import json
    import re

    import jsonschema

    from tests.helpers import JSON_SCHEMAS, SCHEMA_SUBJECTS

    lines = [batch_line(f"json-{i}", {"messages": [{"role": "user", "content": f"Describe {SCHEMA_SUBJECTS[i]} as JSON."}],
                                      "max_tokens": 160, "response_format": {"type": "json_schema", "json_schema": {
                                          "name": "s", "schema": schema}}})
             for i, schema in enumerate(JSON_SCHEMAS)]
    lines += [batch_line("choice", {"messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
                                    "max_tokens": 8, "guided_choice": ["yes", "no"]}),
              batch_line("regex", {"prompt": "Apollo 11 landed on ", "max_tokens": 16,
                                   "structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}}, COMPLETIONS),
              batch_line("beams", {"prompt": "The capital of France is", "max_tokens": 8, "n": 2,
                                   "use_beam_search": True}, COMPLETIONS),
              batch_line("bad", {"prompt": "Hi", "max_tokens": 4, "guided_regex": "(unclosed"}, COMPLETIONS)]
    _, out, err = run(runner, tmp_path, lines)
    for i, schema in enumerate(JSON_SCHEMAS):
        record = out[f"json-{i}"]
        if record["response"]["body"]["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(content(record)), schema)
    assert content(out["choice"]) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", content(out["regex"]))
    assert len(out["beams"]["response"]["body"]["choices"]) == 2
    assert set(err) == {"bad"} and err["bad"]["response"]["status_code"] == 400
    assert "guided_regex" in json.dumps(err["bad"]["response"]["body"])


# ---- a step that fails: the server's rules (engine/faults.py StepGuard) --------------------------------------

@pytest.fixture
def inject_faults(service):
    """Install option.fault_injection rules on the session engine's scheduler (engine/faults.py); taken off, and
    every sequence dropped, after the test. Runners made meanwhile get a fresh StepGuard (and health) of their own."""
    yield lambda rules: FaultInjector(service.engine, FaultRule.parse_all(rules))
    service.engine.scheduler.fault_hooks.clear()
    service.engine.abort_all()


FAULT_LINES = [batch_line(f"ok-{i}", {"prompt": f"List {i + 2} colors:", "max_tokens": 6}, COMPLETIONS)
               for i in range(3)] + [batch_line("zebras", {"prompt": "Zebras are", "max_tokens": 6}, COMPLETIONS)]


def test_a_step_fault_fails_only_the_line_it_hits_and_the_others_answer_as_without_it(service, runner, inject_faults,
                                                                                       tmp_path):
    _, clean, _ = run(runner, tmp_path, FAULT_LINES, "clean")
    inject_faults("decode:2@Zebras")            # not pinned: the guard finds the line by stepping without it
    summary, out, err = run(BatchRunner(service), tmp_path, FAULT_LINES, "faulty")
    assert set(out) == {"ok-0", "ok-1", "ok-2"} and set(err) == {"zebras"}
    assert (summary.completed, summary.failed) == (3, 1)
    response = err["zebras"]["response"]
    assert response["status_code"] == 500 and "injected fault" in response["body"]["error"]["message"]
    assert {cid: content(out[cid]) for cid in out} == {cid: content(clean[cid]) for cid in out}   # greedy


def test_an_engine_broken_for_good_raises_engine_failed_and_writes_no_record_for_the_lines_inside(
        service, inject_faults, tmp_path):
    inject_faults("broken:prefill@Zebras")      # every later step fails, even the guard's own probe: dead
    source = write_jsonl(tmp_path / "in.jsonl", FAULT_LINES)
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    with pytest.raises(EngineFailed, match="the engine cannot go on"):
        BatchRunner(service).run(source, out, err, BatchDefaults(), progress=False)
    assert read_jsonl(out) == [] and read_jsonl(err) == []     # all four were inside the engine: a rerun does them


def test_a_line_with_tools_answers_tool_calls_as_the_route_does(runner, tmp_path):
    body = {"model": "model", "messages": WEATHER_QUESTION, "tools": TOOLS, "tool_choice": NAMED_WEATHER,
            "max_tokens": 40}
    _, out, err = run(runner, tmp_path, [batch_line("tools", body)])
    choice = out["tools"]["response"]["body"]["choices"][0]
    assert err == {} and choice["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), WEATHER_PARAMETERS)
