"""server/tgi.py: TGI's routes (/generate, /generate_stream, /, /info, /health) in TGI's shapes, through the
real TGI client (its own venv) and huggingface_hub's InferenceClient.
"""
from __future__ import annotations

import json
import re
import subprocess

import httpx
import pytest
from huggingface_hub import InferenceClient

from tests.helpers import REPO
from tests.server.helpers import PROMPT, TGI_PYTHON, run_tgi_client, solo_text

pytestmark = pytest.mark.slow


def generate_text(server, prompt: str = PROMPT, max_new_tokens: int = 8) -> str:
    """TGI /generate greedy (its answer is not wrapped in a list under tgi_compat)."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    return httpx.post(server.url + "/generate", json=body, timeout=300).json()["generated_text"]


def test_the_tgi_client_generates_streams_and_chats_unchanged(tgi_server):
    got = run_tgi_client(tgi_server.url, PROMPT, 8)
    assert got["generated_text"] == generate_text(tgi_server)
    assert got["generated_text"] == "".join(got["token_texts"]) and got["generated_tokens"] == len(got["token_texts"])
    assert got["finish_reason"] == ("length" if got["generated_tokens"] == 8 else "eos_token")
    assert got["prefill_length"] > 0
    assert "".join(got["stream_texts"]) == got["stream_final"] == got["generated_text"]
    assert got["stream_details"] == got["finish_reason"]
    assert "max_new_tokens" in got["bad_request"]
    assert got["chat"] and got["chat_stream"] == got["chat"]


def test_inference_client_text_generation_without_tgi_compat(rolling_server):
    expected = solo_text(rolling_server)
    client = InferenceClient(model=rolling_server.url, timeout=300)
    assert client.text_generation(PROMPT, max_new_tokens=8) == expected
    detailed = client.text_generation(PROMPT, max_new_tokens=8, details=True, decoder_input_details=True)
    assert detailed.generated_text == expected
    assert detailed.details.generated_tokens == len(detailed.details.tokens) <= 8
    assert "".join(t.text for t in detailed.details.tokens) == expected and detailed.details.prefill
    assert "".join(client.text_generation(PROMPT, max_new_tokens=8, stream=True)) == expected
    events = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert [e.index for e in events] == list(range(1, len(events) + 1))
    assert events[-1].generated_text == expected and events[-1].details.input_length > 0
    assert all(e.generated_text is None for e in events[:-1])


def test_generate_answers_tgi_shape_with_details_and_seed(app):
    server = app
    params = {"max_new_tokens": 4, "details": True, "do_sample": True, "seed": 11}
    doc = server.post("/generate", json={"inputs": "The sky is", "parameters": params}).json()
    assert isinstance(doc, dict) and isinstance(doc["generated_text"], str)
    details = doc["details"]
    assert set(details) == {"finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    assert details["seed"] == 11 and details["generated_tokens"] == len(details["tokens"]) <= 4
    assert set(details["tokens"][0]) == {"id", "text", "logprob", "special"}
    assert "".join(t["text"] for t in details["tokens"]) == doc["generated_text"]
    same = server.post("/invocations", json={"inputs": "The sky is", "parameters": params}).json()
    assert same["generated_text"] == doc["generated_text"]          # one engine, two output shapes
    plain = server.post("/generate", json={"inputs": "The sky is", "parameters": {"max_new_tokens": 2}})
    assert set(plain.json()) == {"generated_text"}


def test_generate_reads_temperature_zero_by_the_lmi_rule_as_greedy(app):
    """Parameters on TGI's routes follow the LMI schema (docs/serving.md): temperature 0 is greedy, as on /invocations
    and vLLM; real TGI refuses it with a 422 ("must be strictly positive"), so a TGI client never sends it and
    nothing it sends changes meaning. A negative temperature is still refused, naming the field."""
    server = app
    greedy = {"max_new_tokens": 6, "details": True}
    expected = server.post("/generate", json={"inputs": "The sky is", "parameters": greedy}).json()
    zero = server.post("/generate", json={"inputs": "The sky is", "parameters": {**greedy, "temperature": 0}})
    assert zero.status_code == 200
    assert zero.json()["generated_text"] == expected["generated_text"]
    assert zero.json()["details"]["seed"] is None          # greedy: TGI's seed is null
    negative = server.post("/generate", json={"inputs": "The sky is", "parameters": {"temperature": -0.5}})
    assert negative.status_code == 400 and "temperature" in negative.json()["error"]


def test_generate_refuses_chat_messages_with_a_400_naming_them(app):
    server = app
    response = server.post("/generate", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 400 and "messages" in json.loads(response.text)["error"]


PARAMS = {"max_new_tokens": 4, "do_sample": False}


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in text.splitlines() if line.startswith("data:")]


def test_generate_stream_sends_tgi_stream_responses_ending_in_generated_text_and_details(app):
    whole = app.post("/generate", json={"inputs": "The sky is", "parameters": {**PARAMS, "details": True}}).json()
    response = app.post("/generate_stream", json={"inputs": "The sky is", "parameters": {**PARAMS, "details": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(set(e) == {"index", "token", "top_tokens", "generated_text", "details"} for e in events)
    assert all(set(e["token"]) == {"id", "text", "logprob", "special"} for e in events)
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == whole["generated_text"]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    details = events[-1]["details"]
    assert details["finish_reason"] == whole["details"]["finish_reason"] and details["seed"] is None
    assert details["generated_tokens"] == len(events) and details["input_length"] > 0


def test_the_compat_route_streams_by_the_body_flag_and_wraps_whole_answers_in_a_list(app):
    body = {"inputs": "The sky is", "parameters": PARAMS}
    whole = app.post("/", json=body).json()
    assert isinstance(whole, list) and set(whole[0]) == {"generated_text"}
    events = sse_events(app.post("/", json={**body, "stream": True}).text)
    assert events[-1]["generated_text"] == whole[0]["generated_text"]


def test_tgi_info_and_health(app):
    info = app.get("/info").json()
    assert info["model_id"] == "smol" and info["max_total_tokens"] > info["max_input_tokens"] > 0
    assert app.get("/health").status_code == 200


def test_the_tgi_clients_grammar_constrains_generate_and_generate_stream_and_a_bad_one_is_a_400(rolling_server):
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    script = REPO / "tests" / "server" / "clients" / "tgi_grammar.py"
    run = subprocess.run([str(TGI_PYTHON), str(script), rolling_server.url, json.dumps(schema)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert got["json_finish"] == "eos_token"
    jsonschema.validate(json.loads(got["json"]), schema)
    assert got["stream"] == got["stream_final"] == got["json"]
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", got["date"])
    assert "grammar" in got["bad_request"] and "unclosed" in got["bad_request"]
