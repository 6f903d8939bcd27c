"""Request cases on decoding controls: a structured-output constraint never dropped (C34), max_tokens cutting
constrained JSON reported as `length` (C36), beam search equal to transformers' (C39). Each case's kind
is tried beyond its one input: every field a constraint may arrive in, both OpenAI routes, and beam
settings alone, in a crowd and streamed.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.helpers import load_case

pytestmark = pytest.mark.slow

YES_NO = ("yes", "no")


def post(client, path: str, body: dict) -> httpx.Response:
    return client.post(path, json=body)


# ---- C34: a constraint in any field it may come in is enforced, never dropped -------------------------

C34_FIELDS = [{"guided_choice": list(YES_NO)}, {"structured_outputs": {"choice": list(YES_NO)}},
              {"structured_outputs": {"regex": "(yes|no)"}}, {"guided_regex": "(yes|no)"},
              {"guided_grammar": 'start: "yes" | "no"'}, {"structured_outputs": {"grammar": 'start: "yes" | "no"'}}]


@pytest.mark.parametrize("constraint", C34_FIELDS, ids=lambda c: json.dumps(c)[:40])
def test_c34_a_choice_constraint_is_enforced_in_every_field_on_chat_and_completions(client, constraint):
    case = load_case("C34")["request"]
    chat = post(client, "/v1/chat/completions", {**{k: v for k, v in case.items() if k != "guided_choice"},
                                                 **constraint})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] in YES_NO
    completion = post(client, "/v1/completions", {"model": "model", "prompt": case["messages"][0]["content"],
                                                  "max_tokens": 8, "temperature": 0, **constraint})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] in YES_NO


def test_c34_the_case_as_given_and_on_invocations_and_tgi_generate(client):
    case = load_case("C34")["request"]
    answer = post(client, "/v1/chat/completions", case)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] in YES_NO
    question = case["messages"][0]["content"]
    for parameters in ({"guided_choice": list(YES_NO)}, {"structured_outputs": {"choice": list(YES_NO)}},
                       {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                           "enum": list(YES_NO)}}}}):
        got = post(client, "/invocations", {"inputs": question, "parameters": {"max_new_tokens": 8, **parameters}})
        assert got.status_code == 200, got.text
        text = got.json()["generated_text"]
        assert (json.loads(text) if "response_format" in parameters else text) in YES_NO
    for route in ("/generate", "/invocations", "/"):
        got = post(client, route, {"inputs": question, "parameters": {"max_new_tokens": 8,
                                                                     "grammar": {"type": "regex", "value": "(yes|no)"}}})
        assert got.status_code == 200, got.text
        body = got.json()
        assert re.fullmatch("(yes|no)", (body[0] if route == "/" else body)["generated_text"])


def test_c34_kind_an_unknown_structured_outputs_key_or_two_constraints_are_a_400_never_a_200(client):
    case = {k: v for k, v in load_case("C34")["request"].items() if k != "guided_choice"}
    for extra, field in (({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
                         ({"guided_choice": ["yes"], "guided_regex": "no"}, "guided_regex"),
                         ({"response_format": {"type": "yaml"}}, "response_format.type")):
        got = post(client, "/v1/chat/completions", {**case, **extra})
        assert got.status_code == 400 and f"`{field}`" in got.json()["error"]["message"]


# ---- C36: max_tokens cutting JSON says `length` ------------------------------------------------------

def test_c36_cut_json_finishes_with_length_and_whole_json_with_stop_validating(client):
    import jsonschema

    case = load_case("C36")["request"]
    schema = case["response_format"]["json_schema"]["schema"]
    prompt = {"model": "model", "prompt": "A person as JSON: ", "temperature": 0,
              "response_format": case["response_format"]}
    for path, body, content in (("/v1/chat/completions", case, lambda c: c["message"]["content"]),
                                ("/v1/completions", prompt, lambda c: c["text"])):
        short = post(client, path, {**body, "max_tokens": 5}).json()["choices"][0]
        assert short["finish_reason"] == "length"
        whole = post(client, path, {**body, "max_tokens": 200}).json()["choices"][0]
        assert whole["finish_reason"] == "stop"
        jsonschema.validate(json.loads(content(whole)), schema)
        assert content(whole).startswith(content(short))


# ---- C39: beam search equals transformers' ------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_beams(hf_model, tokenizer, prompt: str, **settings) -> str:
    ids = tokenizer.encode(prompt)
    out = hf_model.generate(torch.tensor([ids]), num_beams=4, do_sample=False, **settings)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def streamed_text(client, body: dict) -> str:
    lines = [json.loads(line) for line in client.post("/invocations", json={**body, "stream": True}).text.splitlines()
             if line.strip()]
    assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"]
    return lines[-1]["generated_text"]


def test_c39_beam_search_equals_transformers_alone_among_streams_and_streamed(client, hf_model, tokenizer):
    case = load_case("C39")["request"]
    for length_penalty, early_stopping in ((1.0, True), (0.5, False)):
        parameters = {**case["parameters"], "length_penalty": length_penalty, "early_stopping": early_stopping}
        expected = hf_beams(hf_model, tokenizer, case["inputs"], max_new_tokens=24, length_penalty=length_penalty,
                            early_stopping=early_stopping)
        body = {"inputs": case["inputs"], "parameters": parameters}
        alone = post(client, "/invocations", body)
        assert alone.status_code == 200 and alone.json()["generated_text"] == expected
        others = [{"inputs": f"Tell me about topic {i}.", "parameters": {"max_new_tokens": 24}} for i in range(6)]
        with ThreadPoolExecutor(7) as pool:
            streams = [pool.submit(streamed_text, client, other) for other in others]
            crowded = pool.submit(post, client, "/invocations", body)
            assert crowded.result().json()["generated_text"] == expected
            assert all(s.result() for s in streams)
        assert streamed_text(client, body) == expected


def test_c39_kind_vllm_use_beam_search_answers_the_n_best_beams_best_first(client, hf_model, tokenizer):
    prompt = load_case("C39")["request"]["inputs"]
    ids = tokenizer.encode(prompt)
    out = hf_model.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, do_sample=False,
                            max_new_tokens=12, early_stopping=True)
    expected = [tokenizer.decode(row[len(ids):], skip_special_tokens=True) for row in out]
    got = post(client, "/v1/completions", {"model": "model", "prompt": prompt, "max_tokens": 12, "n": 3,
                                           "use_beam_search": True, "early_stopping": True, "temperature": 0})
    assert got.status_code == 200, got.text
    assert [c["text"] for c in got.json()["choices"]] == expected
    assert [c["index"] for c in got.json()["choices"]] == [0, 1, 2]
