"""/invocations request parsing and the LMI Token / Details objects."""
from __future__ import annotations

import json

import pytest

from lmi_handler.engine.sequence import FinishReason, TokenOutput
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.invocations import (
    InvocationRequest,
    build_details,
    load_json,
    prefill_to_dicts,
    token_to_dict,
)
from tests.helpers import load_case


def test_text_request_parses_from_bytes_str_and_dict():
    body = {"inputs": "Deep learning is", "parameters": {"max_new_tokens": 8}, "stream": True}
    for raw in (json.dumps(body).encode(), json.dumps(body), body):
        req = InvocationRequest.parse(raw)
        assert req.inputs == "Deep learning is" and req.parameters.max_new_tokens == 8
        assert req.stream and req.messages is None


def test_dynamic_batch_list_inputs():
    assert InvocationRequest.parse({"inputs": ["a", "b"]}).inputs == ["a", "b"]


def test_defaults_without_parameters_and_stream():
    req = InvocationRequest.parse(b'{"inputs": "hi", "parameters": null, "stream": null}')
    assert req.parameters.max_new_tokens == 30 and req.stream is False


@pytest.mark.parametrize(("body", "field"), [
    (b"", "body"), (b"   ", "body"), (b"{not json", "body"), (b"\xff\xfe", "body"), (b"[1, 2]", "body"),
    (b'"hello"', "body"), (b"{}", "inputs"), (b'{"parameters": {}}', "inputs"), (b'{"inputs": null}', "inputs"),
    (b'{"inputs": ""}', "inputs"), (b'{"inputs": 5}', "inputs"), (b'{"inputs": []}', "inputs"),
    (b'{"inputs": ["a", 3]}', "inputs"), (b'{"inputs": "a", "stream": "yes"}', "stream"),
    (b'{"inputs": "a", "parameters": "fast"}', "parameters"),
    (b'{"inputs": "a", "parameters": {"top_p": 1.5}}', "top_p"),
    (b'{"messages": []}', "messages"), (b'{"messages": [{"role": "robot", "content": "x"}]}', "messages"),
])
def test_bad_body_names_the_field(body, field):
    with pytest.raises(RequestValidationError) as info:
        InvocationRequest.parse(body)
    assert info.value.field == field and info.value.status_code == 400
    assert field in info.value.message


def test_an_empty_body_asks_for_a_json_object_without_naming_one_routes_field():
    """load_json serves every route: "inputs" would mislead an OpenAI client (its fields are prompt, messages)."""
    with pytest.raises(RequestValidationError) as info:
        load_json(b"")
    assert info.value.field == "body" and info.value.message == "Request body is empty: send a JSON object"


def test_c06_top_p_errors_mention_top_p():
    request = load_case("C06")["request"]
    InvocationRequest.parse(request)
    for bad in (1.5, 0):
        with pytest.raises(RequestValidationError) as info:
            InvocationRequest.parse({**request, "parameters": {**request["parameters"], "top_p": bad}})
        assert "top_p" in info.value.message
    with pytest.raises(RequestValidationError) as info:
        InvocationRequest.parse({**request, "parameters": {**request["parameters"], "repetition_penalty": 0}})
    assert "repetition_penalty" in info.value.message


def test_text_plain_body_is_the_input():
    req = InvocationRequest.parse(b"Tell me a story", content_type="text/plain; charset=utf-8")
    assert req.inputs == "Tell me a story" and not req.stream


def test_chat_body_folds_openai_fields_into_parameters():
    req = InvocationRequest.parse({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
                                   "max_tokens": 12, "stop": ["x"], "stream": True})
    assert req.messages is not None and req.inputs is None and req.stream
    assert req.messages == [{"role": "user", "content": "Hi"}]
    p = req.parameters
    assert p.max_new_tokens == 12 and p.stop_sequences == ["x"] and p.is_greedy()


def test_unknown_top_level_fields_are_ignored():
    assert InvocationRequest.parse({"inputs": "x", "model": "m"}).inputs == "x"


def test_token_to_dict_lmi_and_tgi_names():
    t = TokenOutput(5, " of", -0.25, False, [(5, -0.25), (9, -1.5)])
    assert token_to_dict(t, decode_token=lambda i: f"<{i}>") == {
        "id": 5, "text": " of", "log_prob": -0.25, "special_token": False,
        "top_tokens": [{"id": 5, "text": "<5>", "log_prob": -0.25, "special_token": False},
                       {"id": 9, "text": "<9>", "log_prob": -1.5, "special_token": False}]}
    assert token_to_dict(t, tgi_compat=True) == {"id": 5, "text": " of", "logprob": -0.25, "special": False}


def test_non_finite_log_prob_becomes_null():
    assert token_to_dict(TokenOutput(1, "a", float("-inf"), False))["log_prob"] is None


def test_prefill_first_log_prob_is_null():
    prompt = [TokenOutput(1, "<s>", None, True), TokenOutput(2, "Hi", -3.0, False)]  # type: ignore[arg-type]
    assert prefill_to_dicts(prompt) == [{"id": 1, "text": "<s>", "log_prob": None},
                                        {"id": 2, "text": "Hi", "log_prob": -3.0}]


def test_build_details_shapes():
    tokens = [TokenOutput(1, "a", -0.1, False, [(1, -0.1)]), TokenOutput(2, "b", -0.2, False, [(2, -0.2)])]
    d = build_details(finish_reason=FinishReason.LENGTH, tokens=tokens, inputs="p")
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 2 and d["inputs"] == "p"
    assert [t["text"] for t in d["tokens"]] == ["a", "b"] and "top_tokens" not in d["tokens"][0]
    assert [[x["id"] for x in row] for row in d["top_tokens"]] == [[1], [2]]
    assert "prefill" not in d
    streamed = build_details(finish_reason=FinishReason.EOS_TOKEN, tokens=tokens, inputs="p", include_tokens=False)
    assert streamed == {"finish_reason": "eos_token", "generated_tokens": 2, "inputs": "p"}
    tgi = build_details(finish_reason=FinishReason.STOP_SEQUENCE, tokens=tokens, inputs="p", tgi_compat=True)
    assert tgi["prefill"] == [] and "logprob" in tgi["tokens"][0]


# ---- LoRA: the fields naming an adapter (/invocations `adapters`, TGI parameters.adapter_id) ----

def test_adapters_is_one_name_or_one_name_per_input():
    assert InvocationRequest.parse({"inputs": "hi", "adapters": "sql"}).adapters == "sql"
    listed = InvocationRequest.parse({"inputs": ["a", "b"], "adapters": ["sql", "chat"]})
    assert listed.adapters == ["sql", "chat"]
    chat = InvocationRequest.parse({"messages": [{"role": "user", "content": "hi"}], "adapters": "sql"})
    assert chat.adapters == "sql" and chat.chat is not None


@pytest.mark.parametrize("body, allowed", [
    ({"inputs": ["a", "b"], "adapters": ["sql"]}, "a list of 2 names (one per input)"),
    ({"inputs": "hi", "adapters": ["sql"]}, "a non-empty adapter name, got"),
    ({"inputs": "hi", "adapters": ""}, "a non-empty adapter name"),
    ({"inputs": "hi", "adapters": 3}, "a non-empty adapter name"),
])
def test_a_bad_adapters_field_is_refused_naming_it(body, allowed):
    with pytest.raises(RequestValidationError, match="adapters") as err:
        InvocationRequest.parse(body)
    assert allowed in str(err.value) and err.value.status_code == 400


def test_tgi_adapter_id_is_a_non_empty_string():
    assert InvocationRequest.parse({"inputs": "hi", "parameters": {"adapter_id": "sql"}}).parameters.adapter_id == "sql"
    with pytest.raises(RequestValidationError, match="adapter_id"):
        InvocationRequest.parse({"inputs": "hi", "parameters": {"adapter_id": ""}})
