"""The real app in-process (ASGI): TGI's routes and shapes, served model names, framework errors in our
shapes, metrics consistent with the answers, and fail-fast while the engine loop is down."""
from __future__ import annotations

import json

import pytest

from lmi_handler import handler
from tests.server.inprocess import fresh_server

pytestmark = pytest.mark.slow

PARAMS = {"max_new_tokens": 4, "do_sample": False}


@pytest.fixture(scope="module")
def app():
    with fresh_server(max_rolling_batch_size="4", served_model_name="smol, model") as server:
        yield server


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in text.splitlines() if line.startswith("data:")]


def sample(app, name: str, **labels: str) -> float:
    value = app.app.state.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


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


def test_every_served_name_is_accepted_and_the_first_is_answered(app):
    listed = app.get("/v1/models").json()["data"]
    names = [m["id"] for m in listed]
    assert names == ["smol", "model"]
    assert all(isinstance(m["created"], int) and m["created"] > 1_700_000_000 and m["object"] == "model" for m in listed)
    for name in names:
        reply = app.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1})
        assert reply.status_code == 200 and reply.json()["model"] == "smol"
        assert app.post(f"/predictions/{name}", json={"inputs": "Hi", "parameters": PARAMS}).status_code == 200
    missing = app.post("/v1/completions", json={"model": "tgi", "prompt": "Hi", "max_tokens": 1})
    assert missing.status_code == 404 and "tgi" in missing.json()["error"]["message"]
    djl = app.get("/models").json()["models"]
    assert [m["modelName"] for m in djl] == names and {m["status"] for m in djl} == {"READY"}


def test_framework_404_and_405_answer_in_our_error_shapes(app):
    lmi = app.post("/nowhere", json={})
    assert lmi.status_code == 404 and lmi.json()["code"] == 404 and "/nowhere" in lmi.json()["error"]
    openai = app.post("/v1/embeddings", json={})
    assert openai.status_code == 404 and openai.json()["error"]["code"] == 404
    wrong_method = app.get("/generate")
    assert wrong_method.status_code == 405 and wrong_method.json()["code"] == 405
    assert "POST" in wrong_method.headers["allow"]


def test_metrics_agree_with_the_answers_and_gauges_return_to_zero(app):
    before = {name: sample(app, name) for name in ("lmi_prompt_tokens_total", "lmi_generation_tokens_total",
                                                    "lmi_e2e_request_latency_seconds_count",
                                                    "lmi_time_to_first_token_seconds_count")}
    finished_before = sum(sample(app, "lmi_requests_finished_total", finish_reason=r)
                          for r in ("length", "eos_token", "stop_sequence", "error", "abort"))
    bodies = [{"inputs": f"Count to {i}:", "parameters": {"max_new_tokens": 3 + i, "details": True,
                                                          "decoder_input_details": True}} for i in range(4)]
    answers = app.gather(*(app.client.post("/invocations", json=b) for b in bodies))
    docs = [a.json() for a in answers]
    assert app.post("/invocations", json={"inputs": "Hi", "parameters": {"top_p": 5}}).status_code == 400
    generated = sum(d["details"]["generated_tokens"] for d in docs)
    prompt = sum(len(d["details"]["prefill"]) for d in docs)
    assert sample(app, "lmi_generation_tokens_total") - before["lmi_generation_tokens_total"] == generated
    assert sample(app, "lmi_prompt_tokens_total") - before["lmi_prompt_tokens_total"] == prompt
    finished = sum(sample(app, "lmi_requests_finished_total", finish_reason=r)
                   for r in ("length", "eos_token", "stop_sequence", "error", "abort"))
    assert finished - finished_before == 4          # the 400 never reached the engine
    for name in ("lmi_e2e_request_latency_seconds_count", "lmi_time_to_first_token_seconds_count"):
        assert sample(app, name) - before[name] == 4
    assert sample(app, "lmi_time_per_output_token_seconds_count") >= generated - 4
    text = app.get("/metrics").text
    assert 'lmi_http_requests_total{code="400",route="/invocations"}' in text
    for gauge in ("lmi_requests_running", "lmi_requests_waiting", "lmi_front_end_queue_depth",
                  "lmi_front_end_live_requests", "lmi_kv_cache_blocks_used", "lmi_kv_cache_usage_ratio"):
        assert sample(app, gauge) == 0, gauge
    assert sample(app, "lmi_kv_cache_blocks_total") > 0


def test_a_burst_past_the_queue_leaves_no_request_live_once_answered():
    """A request refused between reserve() and submit() (the batch filled meanwhile) once stayed in the front
    end's live table for good: its body and plan leaked, and draining waited for it (issue 15's soak)."""
    with fresh_server(max_rolling_batch_size="1", job_queue_size="1", num_threads="1") as server:
        body = {"inputs": "The sky is", "parameters": {"max_new_tokens": 2}}
        replies = server.gather(*(server.client.post("/invocations", json=body) for _ in range(24)))
        assert {r.status_code for r in replies} == {200, 503}
        assert server.app.state.front_end.num_live == 0
        assert sample(server, "lmi_front_end_live_requests") == 0


def test_a_dead_engine_loop_is_unhealthy_and_requests_fail_fast(app):
    """Runs last: it stops this module's front end."""
    front_end = app.app.state.front_end
    front_end.stop()
    assert not front_end.thread.is_alive()
    assert app.get("/ping").status_code == 503 and app.get("/health").status_code == 503
    refused = app.post("/invocations", json={"inputs": "Hi", "parameters": PARAMS})
    assert refused.status_code == 503 and "engine" in refused.json()["error"]
    assert handler.get_state().service is not None
