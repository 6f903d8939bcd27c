"""benchmarks/structured.py and its report rows: the schema set, the output check, the token counts, the ratios.

Numbers are hand-made (never a machine's timings); the schemas are checked by jsonschema and by the
grammar library our engine compiles them with.
"""
from __future__ import annotations

import json
import sys

import jsonschema
import pytest

from lmi_handler.engine.grammar_spec import check_spec
from lmi_handler.engine.sequence import GrammarKind, StructuredOutputSpec
from tests.benchmarks.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_args
import report
import structured
from workload import PROMPTS


def _questions(n: int = 64) -> list[str]:
    return [json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines()[:n]]


def _schemas() -> list[dict]:
    return structured.build_schemas(_questions(), structured.read_categories(PROMPTS, 64))


def _kinds(schema: dict) -> set[str]:
    """The features a schema uses anywhere: nested objects, arrays, enums, required keys, ranges."""
    found = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if node.get("enum"):
            found.add("enum")
        if node.get("required"):
            found.add("required")
        if "minimum" in node or "maximum" in node:
            found.add("range")
        for child in (node.get("properties") or {}).values():
            found.add("nested object" if child.get("type") == "object" else "property")
            stack.append(child)
        if node.get("type") == "array":
            found.add("array")
            if node["items"].get("type") == "object":
                found.add("nested object")
            stack.append(node["items"])
    return found


def test_the_64_schemas_are_distinct_valid_and_built_the_same_every_time():
    schemas = _schemas()
    assert len(schemas) == 64 and schemas == _schemas()
    assert len({structured.schema_text(s) for s in schemas}) == 64
    for schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
        check_spec(StructuredOutputSpec(GrammarKind.JSON_SCHEMA, structured.schema_text(schema)))  # llguidance takes it
        assert {"enum", "required", "array"} <= _kinds(schema)


def test_every_template_nests_and_the_category_reaches_the_enum():
    schemas = _schemas()
    for kind in range(structured.NUM_TEMPLATES):
        assert "nested object" in _kinds(schemas[kind])
    categories = structured.read_categories(PROMPTS, 64)
    assert schemas[1]["properties"]["assessment"]["properties"]["topics"]["items"]["enum"][0] == categories[1]
    assert set(categories) <= set(structured.CATEGORIES)


def test_schema_text_is_canonical_json_as_the_protocol_layer_writes_it():
    from lmi_handler.protocol.decoding import _schema_text

    schema = _schemas()[5]
    assert structured.schema_text(schema) == _schema_text(schema, "response_format")


def test_the_check_counts_finished_outputs_and_validates_each_against_its_own_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    other = {"type": "object", "properties": {"b": {"type": "string", "enum": ["x"]}}, "required": ["b"]}
    texts = ['{"a": 1}', '{"b": "y"}', '{"a": 1', '{"a": ', '{"b": "x"}']
    finished = [True, True, True, False, True]
    out = structured.check_outputs(texts, finished, [schema, other, schema, schema, other])
    assert {k: v for k, v in out.items() if k != "invalid"} == {
        "num_outputs": 5, "num_finished": 4, "num_length": 1, "num_valid": 2, "num_invalid": 2}
    assert [i for i, _ in out["invalid"]] == [1, 2]
    assert "ValidationError" in out["invalid"][0][1] and "JSONDecodeError" in out["invalid"][1][1]


def test_run_figures_count_every_generated_token_and_requests_per_second():
    figures = structured.run_figures(2.0, [10, 30, 20], num_steps=31)
    assert figures == {"wall_s": 2.0, "num_requests": 3, "output_tokens": 60, "output_tokens_per_s": 30.0,
                       "requests_per_s": 1.5, "mean_tokens_per_request": 20.0, "num_steps": 31}


def test_a_round_keeps_the_constrained_run_on_top_and_the_ratio_to_the_unconstrained():
    constrained = {**structured.run_figures(2.0, [10, 10]), "output_token_ids": [[1], [2]]}
    plain = {**structured.run_figures(1.0, [16, 16]), "output_token_ids": [[3], [4]]}
    record = structured.round_record(constrained, plain, "constrained,unconstrained")
    assert record["output_tokens_per_s"] == 10.0 and record["output_token_ids"] == [[1], [2]]
    assert "output_token_ids" not in record["unconstrained"] and record["unconstrained"]["output_tokens"] == 32
    assert record["constrained_vs_unconstrained"] == pytest.approx(10.0 / 32.0)
    assert structured.round_order(1) == ("unconstrained", "constrained")
    assert structured.round_order(2) == ("constrained", "unconstrained")


def test_a_structured_round_runs_three_modes_and_checks_only_the_constrained_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    ran = []

    def run(mode: str, lengths) -> dict:
        ran.append((mode, lengths))
        counts = {"constrained": [3, 5], "unconstrained": [8, 8], "length_matched": lengths}[mode]
        texts = ['{"a": 1}', '{"a": "x"}'] if mode == "constrained" else ["free text", "more"]
        return {**structured.run_figures(1.0 if mode == "constrained" else 0.8, counts),
                "output_token_ids": [[1] * n for n in counts], "texts": texts, "finished_on_grammar": [True, True]}

    record = structured.structured_round(2, run, [schema, schema])
    # the length-matched run asks each request for as many tokens as its constrained answer
    assert ran == [("constrained", None), ("unconstrained", None), ("length_matched", [3, 5])]
    assert record["order"] == "constrained,unconstrained,length_matched"
    assert (record["validation"]["num_valid"], record["validation"]["num_invalid"]) == (1, 1)
    assert "texts" not in record and "texts" not in record["unconstrained"] and "texts" not in record["length_matched"]
    assert record["length_matched"]["output_tokens"] == record["output_tokens"] == 8
    assert record["constrained_vs_length_matched"] == pytest.approx(0.8)
    assert record["constrained_vs_unconstrained"] == pytest.approx(8.0 / 20.0)


def test_the_compile_record_is_each_cold_run_minus_the_same_run_unconstrained():
    rec = structured.compile_record(1.5, 0.5, 4.0, 3.0, "how")
    assert (rec["first_compile_s"], rec["all_schemas_compile_s"], rec["method"]) == (1.0, 1.0, "how")


def _phase(rates: list[tuple[float, float]], **extra) -> dict:
    """A structured phase's result from (constrained, unconstrained) tok/s per round."""
    rounds = []
    for k, (c, u) in enumerate(rates, 1):
        rounds.append({"round": k, "output_tokens_per_s": c, "constrained_vs_unconstrained": c / u,
                       "unconstrained": {"output_tokens_per_s": u, "requests_per_s": u / 100},
                       "constrained_vs_length_matched": c / (c + 1.0),
                       "length_matched": {"output_tokens_per_s": c + 1.0, "requests_per_s": 1.0},
                       "validation": {"num_outputs": 4, "num_finished": 3, "num_length": 1, "num_valid": 3,
                                      "num_invalid": 0, "invalid": []}})
    median = sorted(rounds, key=lambda r: r["output_tokens_per_s"])[(len(rounds) - 1) // 2]
    return {"output_tokens_per_s": median["output_tokens_per_s"], "requests_per_s": 1.0,
            "mean_tokens_per_request": 50.0, "rounds": rounds,
            "compile": {"first_compile_s": 0.5, "all_schemas_compile_s": 2.0}, **extra}


def test_the_structured_ratios_are_medians_of_per_round_ratios_with_the_targets():
    phases = {"ours_structured": _phase([(95.0, 100.0), (80.0, 100.0), (90.0, 90.0)], grammar_backend="llguidance 1"),
              "vllm_structured": _phase([(100.0, 100.0), (40.0, 50.0), (45.0, 50.0)],
                                        structured_outputs_backend_used={"xgrammar": 4},
                                        structured_outputs_backend_configured="auto",
                                        grammar_backend={"xgrammar": "0.2.8", "llguidance": None})}
    summary = report.structured_summary(phases)
    ours = summary["ratios"]["ours_structured_vs_ours_unconstrained"]
    assert ours["per_round"] == pytest.approx([0.95, 0.8, 1.0]) and ours["median"] == pytest.approx(0.95)
    assert summary["ratios"]["ours_structured_vs_vllm_structured"]["per_round"] == pytest.approx([0.95, 2.0, 2.0])
    assert summary["targets_met"] == {"ours_structured_vs_ours_unconstrained": True,
                                      "ours_structured_vs_ours_length_matched": True,
                                      "ours_structured_vs_vllm_structured": True}
    assert summary["ratios"]["ours_structured_vs_ours_length_matched"]["per_round"] == pytest.approx(
        [95 / 96, 80 / 81, 90 / 91])
    ours_engine = summary["engines"]["ours_structured"]
    assert ours_engine["validation"] == {"num_outputs": 12, "num_finished": 9, "num_length": 3, "num_valid": 9,
                                         "num_invalid": 0}
    assert ours_engine["unconstrained"]["output_tokens_per_s"] == 100.0   # the median round by unconstrained tok/s
    table = "\n".join(report.structured_table({"phases": phases, "workload": {"max_new_tokens": 128},
                                                 "structured": summary}))
    assert "backend auto → xgrammar (4 requests); installed xgrammar 0.2.8" in table
    assert "backend llguidance 1;" in table


def test_a_missed_target_is_reported_as_not_met_and_the_table_says_so():
    phases = {"ours_structured": _phase([(80.0, 100.0)], grammar_backend="llguidance 1"),
              "vllm_structured": {"skipped": "--skip"}}
    result = {"phases": phases, "workload": {"max_new_tokens": 128}}
    result["structured"] = report.structured_summary(phases)
    assert result["structured"]["targets_met"] == {"ours_structured_vs_ours_unconstrained": False,
                                                   "ours_structured_vs_ours_length_matched": True,
                                                   "ours_structured_vs_vllm_structured": None}
    text = "\n".join(report.structured_table(result))
    assert "| ours | JSON schema | 80.0 |" in text and "| ours | unconstrained | 100.0 |" in text
    assert "| ours | unconstrained, length-matched | 81.0 |" in text
    assert "3 / 3 of 4" in text and "target ≥ 0.9: not met" in text and "vLLM" not in text


def test_no_structured_phase_leaves_no_structured_table():
    result = {"phases": {"ours_structured": {"skipped": "--skip"}}, "workload": {"max_new_tokens": 8}}
    assert report.structured_table(result) == []


def test_skip_structured_turns_off_both_engines_and_skip_vllm_turns_off_vllms():
    assert bench_args.skip_keys("ours_structured") == {"ours_structured", "structured"}
    assert bench_args.skip_keys("vllm_structured") == {"vllm_structured", "structured", "vllm"}
    assert "structured" in bench_args.PHASES and set(bench_args.STRUCTURED) <= set(bench_args.PHASES)


def test_a_negative_compile_difference_is_reported_as_noise_with_both_timings():
    assert report.compile_note({"all_schemas_compile_s": 0.57}) == "all schemas' compiles 0.57 s"
    note = report.compile_note({"all_schemas_compile_s": -4.48, "all_schemas_2_tokens_s": 10.0,
                                "all_unconstrained_2_tokens_s": 14.48})
    assert note == ("all schemas' compiles below the noise (2-token runs: 10.00 s with schemas, 14.48 s without)")
    assert "-4.48" not in note
