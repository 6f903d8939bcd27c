"""GenerationParameters: types, ranges, defaults, aliases and the greedy rule (DESIGN §3, cases C06, C12)."""
from __future__ import annotations

import logging

import pytest

from lmi_handler.engine.sequence import SamplingParams
from lmi_handler.protocol.errors import RequestValidationError, error_object
from lmi_handler.protocol.params import MAX_STOP_SEQUENCES, GenerationParameters
from lmi_handler.protocol.sequences import requested
from tests.helpers import load_case

BAD_VALUES = [
    # (field, value): bad type
    ("temperature", "hot"), ("temperature", True), ("top_p", "1"), ("top_k", 1.5), ("top_k", "5"),
    ("max_new_tokens", 1.5), ("max_new_tokens", "30"), ("max_new_tokens", True), ("seed", 1.0),
    ("do_sample", 1), ("do_sample", "true"), ("details", "yes"), ("return_full_text", 0),
    ("stop_sequences", 5), ("stop_sequences", [1, 2]), ("stop", 5), ("ignore_eos", 1), ("ignore_eos_token", "no"),
    ("stop_token_ids", "2"), ("stop_token_ids", [1.5]), ("top_n_tokens", 2.0), ("logprobs", True),
    ("typical_p", [0.5]), ("min_p", {}), ("truncate", 1.5), ("n", 1.0), ("best_of", "2"), ("num_beams", 2.5),
    ("repetition_penalty", "1"), ("presence_penalty", "0"), ("frequency_penalty", "x"),
    ("skip_special_tokens", 1), ("decoder_input_details", "false"), ("include_stop_str_in_output", 1),
    # out of range
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
    ("top_k", -2), ("min_p", -0.1), ("min_p", 1.01), ("typical_p", 0.0), ("typical_p", 1.01),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.01), ("presence_penalty", -2.01), ("frequency_penalty", 3), ("frequency_penalty", -3),
    ("max_new_tokens", 0), ("max_new_tokens", -5), ("n", 0), ("best_of", 0), ("num_beams", 0),
    ("top_n_tokens", -1), ("top_n_tokens", 21), ("logprobs", 21), ("truncate", 0),
    ("seed", 1 << 63), ("seed", -(1 << 63) - 1),
    ("stop_sequences", [""]), ("stop_sequences", ""), ("stop_sequences", ["x"] * (MAX_STOP_SEQUENCES + 1)),
    ("stop_token_ids", [-1]),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_is_rejected_naming_the_field(field, value):
    with pytest.raises(RequestValidationError) as info:
        GenerationParameters.parse({field: value})
    err = info.value
    assert err.field == field
    assert err.status_code == 400
    assert f"`{field}`" in err.message and "must be" in err.message
    assert error_object(err.message, err.status_code, openai=False) == {"error": err.message, "code": 400}


@pytest.mark.parametrize(("field", "value"), [
    ("top_p", 1.0), ("top_p", 1), ("typical_p", 1.0), ("top_k", 0), ("top_k", -1), ("min_p", 0.0), ("min_p", 1.0),
    ("temperature", 0), ("temperature", 0.0), ("temperature", 2), ("repetition_penalty", 1.0),
    ("presence_penalty", -2), ("frequency_penalty", 2.0), ("max_new_tokens", 1), ("seed", -7),
    ("seed", (1 << 63) - 1), ("top_n_tokens", 0), ("top_n_tokens", 20), ("truncate", 1),
    ("stop_sequences", ["x"] * MAX_STOP_SEQUENCES), ("stop_token_ids", []), ("stop_sequences", []),
])
def test_boundary_value_is_accepted(field, value):
    GenerationParameters.parse({field: value})


def test_defaults_equal_lmi_schema():
    p = GenerationParameters.parse(None)
    assert p == GenerationParameters.parse({})
    assert (p.do_sample, p.seed, p.temperature, p.repetition_penalty, p.top_k, p.top_p, p.max_new_tokens,
            p.details, p.return_full_text, p.stop_sequences, p.decoder_input_details) == \
           (None, None, 1.0, 1.0, 0, 1.0, 30, False, False, None, False)
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.ignore_eos, p.include_stop_str_in_output,
            p.skip_special_tokens, p.typical_p, p.truncate, p.n, p.best_of, p.num_beams, p.top_n_tokens) == \
           (0.0, 0.0, 0.0, False, False, True, 1.0, None, 1, None, 1, None)
    assert p.is_greedy()


def test_null_means_not_given():
    p = GenerationParameters.parse({"temperature": None, "seed": None, "stop": None, "details": None})
    assert p.model_fields_set == set()
    assert p.is_greedy()


def test_aliases_stop_and_ignore_eos_token():
    p = GenerationParameters.parse({"stop": "###", "ignore_eos_token": True})
    assert p.stop_sequences == ["###"] and p.ignore_eos
    assert GenerationParameters.parse({"stop_sequences": ["a", "b"]}).stop_sequences == ["a", "b"]


def test_top_k_minus_one_means_off():
    assert GenerationParameters.parse({"top_k": -1}).top_k == 0


def test_best_of_below_n_is_rejected():
    with pytest.raises(RequestValidationError) as info:
        GenerationParameters.parse({"n": 3, "best_of": 2})
    assert info.value.field == "best_of" and "n (3)" in info.value.message


def test_non_object_parameters_are_rejected():
    with pytest.raises(RequestValidationError) as info:
        GenerationParameters.parse(["temperature", 1])  # type: ignore[arg-type]
    assert info.value.field == "parameters"


def test_unknown_parameters_warn_and_are_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="lmi_handler.protocol.params"):
        p = GenerationParameters.parse({"watermark": False, "foo_bar": 3, "max_new_tokens": 5})
    assert p.max_new_tokens == 5
    assert "foo_bar" in caplog.text and "watermark" in caplog.text


@pytest.mark.parametrize(("params", "greedy"), [
    ({}, True),
    ({"do_sample": False, "temperature": 0.8}, True),          # C12 as given
    ({"do_sample": True, "temperature": 0.01}, False),         # C12: user temperature applies
    ({"do_sample": True, "temperature": 0}, True),             # C12
    ({"do_sample": True, "temperature": 1.5}, False),          # C12
    ({"temperature": 1.5}, False),                              # C12: sampling params alone enable sampling
    ({"temperature": 1.0}, False),
    ({"temperature": 0}, True),
    ({"top_k": 50}, False), ({"top_p": 0.9}, False), ({"min_p": 0.1}, False), ({"typical_p": 0.5}, False),
    ({"top_k": 0, "top_p": 1.0, "typical_p": 1.0}, True),      # "off" values do not turn sampling on
    ({"do_sample": False, "top_p": 0.5}, True),
    ({"do_sample": True}, False),
    ({"repetition_penalty": 1.2, "seed": 3}, True),
])
def test_greedy_rule(params, greedy):
    assert GenerationParameters.parse(params).is_greedy() is greedy


def test_c12_request_is_greedy():
    case = load_case("C12")
    assert GenerationParameters.parse(case["request"]["parameters"]).to_sampling_params().greedy


def test_c06_request_is_accepted_with_neutral_values():
    case = load_case("C06")
    sp = GenerationParameters.parse(case["request"]["parameters"]).to_sampling_params()
    assert not sp.greedy and sp.seed == 7 and sp.top_p == 1.0 and sp.top_k == 0 and sp.typical_p == 1.0
    omitted = {k: v for k, v in case["request"]["parameters"].items() if k not in ("top_p", "top_k", "typical_p")}
    assert GenerationParameters.parse(omitted).to_sampling_params() == sp


def test_to_sampling_params_maps_every_knob():
    p = GenerationParameters.parse({
        "do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "typical_p": 0.95,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": -3,
        "max_new_tokens": 12, "stop": ["\n\n", "END"], "stop_token_ids": [7], "ignore_eos": True,
        "include_stop_str_in_output": True, "skip_special_tokens": False, "top_n_tokens": 3,
        "decoder_input_details": True})
    assert p.to_sampling_params((2,)) == SamplingParams(
        greedy=False, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, typical_p=0.95, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=-3, max_new_tokens=12, stop_sequences=("\n\n", "END"),
        stop_token_ids=(7,), ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False,
        top_n_tokens=3, prompt_logprobs=True)


def test_temperature_zero_gives_a_valid_engine_temperature():
    sp = GenerationParameters.parse({"do_sample": True, "temperature": 0}).to_sampling_params()
    assert sp.greedy and sp.temperature > 0


def test_logprobs_is_used_when_top_n_tokens_is_absent():
    assert GenerationParameters.parse({"logprobs": 4}).to_sampling_params().top_n_tokens == 4
    assert GenerationParameters.parse({"logprobs": 4, "top_n_tokens": 2}).to_sampling_params().top_n_tokens == 2


@pytest.mark.parametrize("given, field", [({"n": 2}, "n"), ({"best_of": 2}, "best_of"),
                                          ({"n": 2, "best_of": 3}, "best_of"), ({"num_beams": 2}, "num_beams"),
                                          ({"num_beams": 2, "do_sample": True}, "num_beams")])
def test_beams_and_greedy_multi_sequence_requests_are_rejected_before_inference(given, field):
    params = GenerationParameters.parse(given)
    with pytest.raises(RequestValidationError) as info:
        params.to_sampling_params()
    assert info.value.field == field and info.value.status_code == 400 and field in info.value.message


@pytest.mark.parametrize("given, count", [({}, 1), ({"n": 2, "do_sample": True}, 2),
                                          ({"best_of": 3, "temperature": 0.8}, 3), ({"n": 2, "best_of": 4, "top_p": 0.9}, 4)])
def test_sampled_requests_may_ask_for_several_sequences(given, count):
    params = GenerationParameters.parse(given)
    params.to_sampling_params()
    assert requested(params.n, params.best_of)[0] == count


def test_details_default_follows_tgi_compat():
    assert not GenerationParameters.parse({}).wants_details(False)
    assert GenerationParameters.parse({}).wants_details(True)
    assert not GenerationParameters.parse({"details": False}).wants_details(True)


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-300, True), (1e-40, True), (9.9e-6, True),
                                                 (1e-5, False), (0.01, False)])
def test_temperatures_below_the_sampling_epsilon_are_greedy(temperature, greedy):
    params = GenerationParameters.parse({"temperature": temperature, "do_sample": True})
    assert params.is_greedy() is greedy
    assert params.to_sampling_params().greedy is greedy
