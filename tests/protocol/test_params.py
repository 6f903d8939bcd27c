"""GenerationParameters: types, ranges, defaults, aliases and the greedy rule (DESIGN §3, cases C06, C12), then
every parameter honoured end to end on a real server's /invocations (slow)."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lmi_handler.engine.sequence import SamplingParams
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import RequestValidationError, error_body
from lmi_handler.protocol.params import MAX_STOP_SEQUENCES, GenerationParameters
from lmi_handler.protocol.sequences import requested
from tests.helpers import load_case
from tests.server.helpers import generated_text, invoke, stream_lines, streamed_text

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
    ("priority", "high"), ("priority", 1.5), ("priority", True), ("priority", [0]), ("priority", 1 << 63),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_is_rejected_naming_the_field(field, value):
    with pytest.raises(RequestValidationError) as info:
        GenerationParameters.parse({field: value})
    err = info.value
    assert err.field == field
    assert err.status_code == 400
    assert f"`{field}`" in err.message and "must be" in err.message
    assert error_body(Dialect.LMI, err.message, err.status_code) == {"error": err.message, "code": 400}


@pytest.mark.parametrize(("field", "value"), [
    ("top_p", 1.0), ("top_p", 1), ("typical_p", 1.0), ("top_k", 0), ("top_k", -1), ("min_p", 0.0), ("min_p", 1.0),
    ("temperature", 0), ("temperature", 0.0), ("temperature", 2), ("repetition_penalty", 1.0),
    ("presence_penalty", -2), ("frequency_penalty", 2.0), ("max_new_tokens", 1), ("seed", -7),
    ("seed", (1 << 63) - 1), ("top_n_tokens", 0), ("top_n_tokens", 20), ("truncate", 1),
    ("stop_sequences", ["x"] * MAX_STOP_SEQUENCES), ("stop_token_ids", []), ("stop_sequences", []),
    ("priority", -(1 << 63)), ("priority", 0), ("priority", (1 << 63) - 1),
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
    assert p.to_sampling_params() == SamplingParams(
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
                                          ({"n": 2, "best_of": 3}, "best_of")])
def test_greedy_multi_sequence_requests_are_rejected_before_inference(given, field):
    params = GenerationParameters.parse(given)
    with pytest.raises(RequestValidationError) as info:
        params.to_sampling_params()
    assert info.value.field == field and info.value.status_code == 400 and field in info.value.message


@pytest.mark.parametrize("given, field", [({"num_beams": 2, "do_sample": True}, "do_sample"),
                                          ({"num_beams": 2, "temperature": 0.7}, "temperature"),
                                          ({"num_beams": 2, "n": 2}, "n"), ({"num_beams": 3, "stop": ["."]}, "stop"),
                                          ({"num_beams": 2, "top_n_tokens": 2}, "top_n_tokens")])
def test_what_a_beam_search_cannot_honour_is_refused_naming_the_field(given, field):
    with pytest.raises(RequestValidationError) as info:
        GenerationParameters.parse(given)
    assert info.value.status_code == 400 and f"`{field}`" in info.value.message.replace("stop_sequences", "stop")


def test_beam_search_parameters_reach_the_engine():
    params = GenerationParameters.parse({"num_beams": 4, "length_penalty": 0.5, "early_stopping": "never",
                                         "max_new_tokens": 24}).to_sampling_params()
    assert (params.num_beams, params.length_penalty, params.early_stopping, params.greedy) == (4, 0.5, "never", True)


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


PROMPT = "Write a short poem about the ocean."


def details(client, inputs=PROMPT, **params) -> dict:
    response = invoke(client, inputs, details=True, **params)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
def test_top_k_1_and_tiny_temperature_equal_greedy(client):
    greedy = generated_text(client, PROMPT, max_new_tokens=16)
    assert generated_text(client, PROMPT, do_sample=True, top_k=1, seed=5, max_new_tokens=16) == greedy
    assert generated_text(client, PROMPT, do_sample=True, temperature=1e-4, seed=9, max_new_tokens=16) == greedy
    for tiny in (1e-6, 1e-40, 1e-300):  # below vLLM's sampling epsilon: greedy, never inf/NaN logits
        assert generated_text(client, PROMPT, temperature=tiny, max_new_tokens=16) == greedy


@pytest.mark.slow
def test_seeded_request_gives_the_same_tokens_alone_among_unseeded_and_in_a_dynamic_batch(
        rolling_server, dynamic_server, client):
    params = {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "seed": 1234, "max_new_tokens": 24}
    alone = generated_text(client, PROMPT, **params)

    def send(index: int) -> str:
        body_params = params if index == 0 else {**params, "seed": None, "temperature": 0.9}
        with httpx.Client(base_url=rolling_server.url, timeout=300) as http:
            return generated_text(http, PROMPT if index == 0 else f"{PROMPT} #{index}", **body_params)

    with ThreadPoolExecutor(8) as pool:
        crowd = list(pool.map(send, range(8)))
    assert crowd[0] == alone
    with httpx.Client(base_url=dynamic_server.url, timeout=300) as http:
        batch = http.post("/invocations", json={"inputs": ["Tell me a joke.", PROMPT, "Hello!"], "parameters": params})
        assert batch.status_code == 200, batch.text
        assert batch.json()[1]["generated_text"] == alone
    assert generated_text(client, PROMPT, **{**params, "seed": 4321}) != alone
    assert generated_text(client, PROMPT, **{**params, "seed": -7}) == generated_text(client, PROMPT,
                                                                                       **{**params, "seed": -7})


@pytest.mark.slow
@pytest.mark.parametrize("name, value", [("repetition_penalty", 1.8), ("presence_penalty", 2.0),
                                         ("frequency_penalty", 2.0)])
def test_penalties_change_the_greedy_text(client, name, value):
    prompt = "Repeat after me: apple apple apple apple apple"
    plain = generated_text(client, prompt, max_new_tokens=24)
    assert generated_text(client, prompt, max_new_tokens=24, **{name: value}) != plain


@pytest.mark.slow
@pytest.mark.parametrize("params", [{"min_p": 0.05}, {"typical_p": 0.5}, {"top_p": 0.5}, {"top_k": 5}])
def test_filters_alone_turn_sampling_on_and_stay_reproducible_with_a_seed(client, params):
    first = generated_text(client, PROMPT, seed=11, max_new_tokens=12, **params)
    assert first == generated_text(client, PROMPT, seed=11, max_new_tokens=12, **params)


@pytest.mark.slow
def test_return_full_text_prepends_the_prompt(client):
    text = generated_text(client, "The sky is", max_new_tokens=5)
    assert generated_text(client, "The sky is", max_new_tokens=5, return_full_text=True) == "The sky is" + text


@pytest.mark.slow
def test_stop_token_ids_end_generation_with_stop_sequence(client):
    prompt = "The capital of France is"
    tokens = details(client, prompt, max_new_tokens=10)["details"]["tokens"]
    assert len(tokens) == 10
    target = tokens[3]["id"]
    stopped = details(client, prompt, max_new_tokens=10, stop_token_ids=[target])["details"]
    assert stopped["finish_reason"] == "stop_sequence"
    first_hit = next(i for i, t in enumerate(tokens) if t["id"] == target)
    assert stopped["generated_tokens"] == first_hit + 1


@pytest.mark.slow
def test_stop_token_ids_outside_the_vocabulary_get_a_400(client):
    response = invoke(client, PROMPT, stop_token_ids=[49152])
    assert response.status_code == 400 and "stop_token_ids" in response.json()["error"]


@pytest.mark.slow
def test_ignore_eos_runs_to_max_new_tokens(client):
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    natural = details(client, chat, max_new_tokens=60)["details"]
    assert natural["finish_reason"] == "eos_token" and natural["tokens"][-1]["special_token"] is True
    forced = details(client, chat, max_new_tokens=natural["generated_tokens"] + 5, ignore_eos=True)["details"]
    assert forced["finish_reason"] == "length"
    assert forced["generated_tokens"] == natural["generated_tokens"] + 5


@pytest.mark.slow
def test_skip_special_tokens_false_renders_the_eos_marker(client):
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    assert "<|im_end|>" not in generated_text(client, chat, max_new_tokens=60)
    assert generated_text(client, chat, max_new_tokens=60, skip_special_tokens=False).endswith("<|im_end|>")


@pytest.mark.slow
def test_truncate_keeps_the_last_prompt_tokens(client, tokenizer):
    long_prompt = "zebra " * 50 + "The capital of France is"
    ids = tokenizer.encode(long_prompt)
    cut = details(client, long_prompt, max_new_tokens=4, truncate=6, decoder_input_details=True)
    assert [t["id"] for t in cut["details"]["prefill"]] == ids[-6:]
    full = details(client, long_prompt, max_new_tokens=4, decoder_input_details=True)
    assert len(full["details"]["prefill"]) == len(ids) > 6


@pytest.mark.slow
def test_decoder_input_details_returns_prompt_tokens_with_log_probs(client):
    body = details(client, "One, two, three,", max_new_tokens=3, decoder_input_details=True)
    prefill = body["details"]["prefill"]
    assert prefill[0]["log_prob"] is None
    assert all(t["log_prob"] <= 0 for t in prefill[1:])
    assert "".join(t["text"] for t in prefill) == "One, two, three,"


@pytest.mark.slow
def test_top_n_tokens_returns_alternatives_led_by_the_greedy_choice(client):
    body = details(client, "The capital of France is", max_new_tokens=4, top_n_tokens=3)
    tops = body["details"]["top_tokens"]
    assert len(tops) == 4
    for token, alternatives in zip(body["details"]["tokens"], tops):
        assert len(alternatives) == 3
        assert alternatives[0]["id"] == token["id"]
        assert alternatives[0]["log_prob"] >= alternatives[1]["log_prob"] >= alternatives[2]["log_prob"]


@pytest.mark.slow
def test_log_prob_is_the_chosen_tokens_log_probability(client):
    tokens = details(client, max_new_tokens=6)["details"]["tokens"]
    assert all(-30 < t["log_prob"] <= 0 for t in tokens)


@pytest.mark.slow
@pytest.mark.parametrize("params, field", [({"num_beams": 2, "do_sample": True}, "do_sample"), ({"n": 2}, "n"),
                                           ({"best_of": 2}, "best_of")])
def test_sampled_beam_search_and_greedy_multi_sequence_requests_get_a_clear_400(client, params, field):
    response = invoke(client, PROMPT, **params)
    assert response.status_code == 400 and field in response.json()["error"]


@pytest.mark.slow
def test_best_of_returns_the_most_likely_sequence_and_the_others_in_details(client):
    params = {"do_sample": True, "temperature": 1.0, "seed": 77, "max_new_tokens": 12, "details": True}
    body = details(client, "The capital of France is", best_of=3, **{k: v for k, v in params.items() if k != "details"})
    others = body["details"]["best_of_sequences"]
    assert len(others) == 2
    best_score = sum(t["log_prob"] for t in body["details"]["tokens"])
    seeds = set()
    for other in others:
        assert sum(t["log_prob"] for t in other["tokens"]) <= best_score
        assert other["generated_tokens"] == len(other["tokens"])
        seeds.add(other["seed"])
    assert len(seeds) == 2 and not seeds & {None}
    # each member is an ordinary seeded request: seed 77 + j gives the same text alone
    member_texts = {body["generated_text"]} | {o["generated_text"] for o in others}
    solo = {generated_text(client, "The capital of France is", **{**params, "seed": 77 + j, "details": False})
            for j in range(3)}
    assert member_texts == solo
    streamed = client.post("/invocations", json={"inputs": "Hi", "stream": True,
                                                 "parameters": {"best_of": 2, "do_sample": True}})
    assert streamed.status_code == 400 and "best_of" in streamed.json()["error"]


@pytest.mark.slow
def test_chat_messages_on_invocations_answer_in_the_chat_completion_shape(client):
    response = client.post("/invocations", json={"messages": [{"role": "user", "content": "Say hi."}],
                                                 "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] <= 12


@pytest.mark.slow
def test_streamed_texts_concatenate_to_generated_text_for_every_sampled_stream(client):
    for seed in range(3):
        lines = stream_lines(client, {"inputs": "Emoji and CJK: 😀 你好", "parameters": {
            "do_sample": True, "temperature": 1.2, "seed": seed, "max_new_tokens": 20}})
        assert streamed_text(lines) == lines[-1]["generated_text"]


@pytest.mark.slow
def test_unknown_parameters_are_ignored_with_one_warning(client, rolling_server):
    response = invoke(client, "Hello", max_new_tokens=2, frobnicate_7x=True)
    assert response.status_code == 200
    warnings = [line for line in rolling_server.log_path.read_text().splitlines() if "frobnicate_7x" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0]


def test_priority_reaches_the_engine_and_defaults_to_0():
    assert GenerationParameters.parse({"priority": -3}).to_sampling_params().priority == -3
    assert GenerationParameters.parse({}).to_sampling_params().priority == 0
