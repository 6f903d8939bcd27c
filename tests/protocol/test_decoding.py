"""protocol/decoding.py: every dialect's constraint shape to one engine spec, the one-constraint rule, the
spec checks (llguidance's validation, no tokenizer) and logit_bias."""
from __future__ import annotations

import pytest

from lmi_handler.engine.sequence import GrammarKind, StructuredOutputSpec
from lmi_handler.protocol import decoding
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.params import GenerationParameters

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
AS_SCHEMA = StructuredOutputSpec(GrammarKind.JSON_SCHEMA, '{"properties": {"a": {"type": "integer"}}, '
                                 '"required": ["a"], "type": "object"}')


@pytest.mark.parametrize(("given", "field"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs"),
    ({"grammar": {"type": "json", "value": SCHEMA}}, "grammar"),
    ({"grammar": {"type": "json_object", "value": SCHEMA}}, "grammar"),
    ({"grammar": {"type": "json_schema", "value": {"name": "x", "schema": SCHEMA}}}, "grammar"),
    ({"guided_json": SCHEMA}, "guided_json"),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'}, "guided_json"),
])
def test_a_schema_in_any_field_is_the_same_spec_so_one_compile_serves_them_all(given, field):
    assert decoding.structured_output(given) == (field, AS_SCHEMA)


@pytest.mark.parametrize(("given", "spec"), [
    ({"response_format": {"type": "json_object"}}, StructuredOutputSpec(GrammarKind.JSON_OBJECT)),
    ({"grammar": {"type": "json_object"}}, StructuredOutputSpec(GrammarKind.JSON_OBJECT)),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     StructuredOutputSpec(GrammarKind.JSON_OBJECT, max_whitespace=0)),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutputSpec(GrammarKind.REGEX, "a+")),
    ({"grammar": {"type": "regex", "value": "a+"}}, StructuredOutputSpec(GrammarKind.REGEX, "a+")),
    ({"guided_choice": ["x", "y"]}, StructuredOutputSpec(GrammarKind.CHOICE, choices=("x", "y"))),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, StructuredOutputSpec(GrammarKind.GRAMMAR, 'start: "x"')),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputSpec(GrammarKind.GRAMMAR, 'root ::= "x"')),
])
def test_each_kind_in_each_shape(given, spec):
    assert decoding.structured_output(given)[1] == spec


def test_text_and_empty_values_ask_for_nothing():
    assert decoding.structured_output({"response_format": {"type": "text"}}) is None
    assert decoding.structured_output({"guided_choice": [], "guided_json": {}, "guided_regex": ""}) is None
    assert GenerationParameters.parse({}).constraint is None


@pytest.mark.parametrize(("given", "field", "says"), [
    ({"grammar": {"type": "xml", "value": "x"}}, "grammar.type", "json, json_object, regex, json_schema"),
    ({"grammar": {"type": "json"}}, "grammar.value", "required"),
    ({"grammar": "regex"}, "grammar", "object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name",
     "non-empty string"),
    ({"structured_outputs": {}}, None, None),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar", "choice": ["a"]}}, "structured_outputs", "regex, choice"),
    ({"guided_json": [1, 2]}, "guided_json", "JSON schema"),
    ({"guided_regex": "a{2,1}"}, "guided_regex", "regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}}, "guided_json",
     "JSON schema"),
])
def test_bad_shapes_and_specs_name_the_field_and_the_reason(given, field, says):
    if field is None:                          # {} is empty: no constraint
        assert decoding.structured_output(given) is None
        return
    with pytest.raises(RequestValidationError) as info:
        decoding.structured_output(given)
    assert info.value.field == field and says in info.value.message and info.value.status_code == 400


def test_logit_bias_keys_are_token_ids_and_values_within_openais_range():
    assert decoding.logit_bias({"5": 1, "3": -100.0}) == ((3, -100.0), (5, 1.0))
    for bad in ({"a": 1}, {"-1": 1}, {"1": 100.5}, {"1": True}, {"1": float("nan")}):
        with pytest.raises(RequestValidationError) as info:
            decoding.logit_bias(bad)
        assert info.value.field == "logit_bias"


def test_tgi_grammar_and_lmi_controls_reach_the_engine_from_parameters():
    params = GenerationParameters.parse({"grammar": {"type": "regex", "value": "(yes|no)"}, "min_length": 2,
                                         "bad_sequences": ["x"], "allowed_token_ids": [5, 3],
                                         "logit_bias": {"7": 2}}).to_sampling_params()
    assert params.structured_output == StructuredOutputSpec(GrammarKind.REGEX, "(yes|no)")
    assert (params.min_tokens, params.allowed_token_ids, params.logit_bias) == (2, (3, 5), ((7, 2.0),))
