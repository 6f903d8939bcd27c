"""server/app.py: DJL's routes on a real server: /ping, /invocations (rolling and dynamic batch, streamed and
not), /predictions/{model}, served names, the response formats, and an engine loop that is down.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import SMALL_KV_CACHE_BYTES
from tests.server.helpers import fresh_server, generated_text, invoke, stream_lines, streamed_text

pytestmark = pytest.mark.slow


PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "My favourite fruit is", "In 1969, humans", "Water boils at", "A haiku about the sea:"]


def test_ping_answers_healthy(client):
    response = client.get("/ping")
    assert response.status_code == 200 and response.json() == {"status": "Healthy"}


def test_non_streaming_answer_has_generated_text_and_details_tokens(client):
    response = invoke(client, "The capital of France is", max_new_tokens=6, details=True)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    details = body["details"]
    assert details["generated_tokens"] == len(details["tokens"]) == 6
    assert details["finish_reason"] == "length"
    assert "".join(t["text"] for t in details["tokens"]) == body["generated_text"]
    for token in details["tokens"]:
        assert set(token) >= {"id", "text", "log_prob", "special_token"}
        assert isinstance(token["id"], int) and token["log_prob"] <= 0.0
    assert "details" not in invoke(client, "Hi", max_new_tokens=2).json()


def test_streaming_sends_a_token_line_per_token_and_the_last_carries_the_result(client):
    lines = stream_lines(client, {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 10, "details": True}})
    assert len(lines) == 10
    assert all("token" in line for line in lines)
    assert all("generated_text" not in line and "details" not in line for line in lines[:-1])
    assert lines[-1]["generated_text"] == streamed_text(lines)
    assert lines[-1]["details"]["finish_reason"] == "length"
    assert lines[-1]["generated_text"] == generated_text(client, "Once upon a time", max_new_tokens=10)


def run_client(url: str, index: int) -> dict:
    """Client i: greedy when i is even; streaming when i % 4 < 2; other params vary."""
    params = {"max_new_tokens": 12 + index}
    if index % 2:
        params.update(do_sample=True, temperature=0.9, top_p=0.9, seed=index)
    body = {"inputs": PROMPTS[index], "parameters": params}
    with httpx.Client(base_url=url, timeout=300) as http:
        if index % 4 < 2:
            lines = stream_lines(http, body)
            return {"text": lines[-1]["generated_text"], "streamed": streamed_text(lines), "params": params,
                    "count": len(lines)}
        response = http.post("/invocations", json=body)
        assert response.status_code == 200, response.text
        return {"text": response.json()["generated_text"], "params": params}


def test_eight_concurrent_clients_complete_and_greedy_ones_equal_their_solo_runs(rolling_server, client):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run_client(rolling_server.url, i), range(8)))
    for index, result in enumerate(results):
        if "streamed" in result:
            assert result["streamed"] == result["text"]
        solo = generated_text(client, PROMPTS[index], **result["params"])
        if not result["params"].get("do_sample"):
            assert result["text"] == solo, f"client {index} differs from its solo run"


@pytest.mark.parametrize("parameters, field", [({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"),
                                               ({"max_new_tokens": "many"}, "max_new_tokens"),
                                               ({"top_k": 1180591620717411303424}, "top_k"),
                                               ({"stop_token_ids": [10 ** 30]}, "stop_token_ids")])
def test_bad_parameter_gets_4xx_naming_it_while_other_streams_go_on(rolling_server, client, parameters, field):
    body = {"inputs": "Count to twenty: 1, 2, 3,", "parameters": {"max_new_tokens": 40}}
    expected = generated_text(client, body["inputs"], **body["parameters"])
    result = {}

    def long_stream():
        with httpx.Client(base_url=rolling_server.url, timeout=300) as http:
            result["lines"] = stream_lines(http, body)

    thread = threading.Thread(target=long_stream)
    thread.start()
    bad = invoke(client, "Hello", **parameters)
    thread.join(timeout=300)
    assert 400 <= bad.status_code < 500
    error = bad.json()
    assert field in error["error"] and error["code"] == bad.status_code
    assert streamed_text(result["lines"]) == expected == result["lines"][-1]["generated_text"]
    assert client.get("/ping").status_code == 200


def test_predictions_route_answers_like_invocations(client):
    body = {"inputs": "Water boils at", "parameters": {"max_new_tokens": 5}}
    a = client.post("/predictions/model", json=body).json()
    b = client.post("/invocations", json=body).json()
    assert a == b


def test_dynamic_batch_answers_a_list_of_generated_texts_per_input(dynamic_server):
    with httpx.Client(base_url=dynamic_server.url, timeout=300) as http:
        inputs = ["The sky is", "Water boils at", "Once upon a time"]
        response = http.post("/invocations", json={"inputs": inputs, "parameters": {"max_new_tokens": 6}})
        assert response.status_code == 200, response.text
        answers = response.json()
        assert isinstance(answers, list) and len(answers) == 3
        assert all(isinstance(a["generated_text"], str) and a["generated_text"] for a in answers)
        solo = http.post("/invocations", json={"inputs": inputs[1], "parameters": {"max_new_tokens": 6}}).json()
        assert solo == [answers[1]]


def test_dynamic_batch_streams_outputs_lines_that_join_to_each_inputs_text(dynamic_server):
    inputs = ["The sky is", "Once upon a time"]
    with httpx.Client(base_url=dynamic_server.url, timeout=300) as http:
        whole = http.post("/invocations", json={"inputs": inputs, "parameters": {"max_new_tokens": 8}}).json()
        rows = []
        with http.stream("POST", "/invocations", json={"inputs": inputs, "stream": True,
                                                       "parameters": {"max_new_tokens": 8}}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("application/jsonlines")
            for line in response.iter_lines():
                if line.strip():
                    rows.append(json.loads(line)["outputs"])
        assert len(rows) >= 2 and all(len(row) == 2 for row in rows)
        assert ["".join(row[i] for row in rows) for i in range(2)] == [a["generated_text"] for a in whole]
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "stream": True})
        assert chat.status_code == 400 and "stream" in chat.json()["error"]["message"]
        assert http.get("/ping").status_code == 200


def test_enable_streaming_makes_a_dynamic_batch_list_stream_outputs_lines_that_join_to_each_inputs_text(
        dynamic_server, model_dir):
    """LMI schema: option.rolling_batch=disable with option.enable_streaming=true answers a list of inputs with
    application/jsonlines lines of {"outputs": [new text per input]}, token by token, no `stream` in the body."""
    inputs = ["The sky is", "Once upon a time", "Water is"]
    parameters = {"max_new_tokens": 8}
    with httpx.Client(base_url=dynamic_server.url, timeout=300) as http:     # the same model, not streaming
        whole = http.post("/invocations", json={"inputs": inputs, "parameters": parameters}).json()
    with fresh_server(rolling_batch="disable", enable_streaming="true", num_threads="1",
                      kv_cache_bytes=str(SMALL_KV_CACHE_BYTES)) as streaming:
        response = streaming.post("/invocations", json={"inputs": inputs, "parameters": parameters})
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/jsonlines")
        rows = [json.loads(line)["outputs"] for line in response.text.splitlines() if line.strip()]
        assert len(rows) >= 2 and all(len(row) == len(inputs) for row in rows)
        assert ["".join(row[i] for row in rows) for i in range(len(inputs))] == [a["generated_text"] for a in whole]


def test_text_plain_body_is_the_whole_input(client):
    response = client.post("/invocations", content="The capital of France is".encode(),
                           headers={"content-type": "text/plain"})
    assert response.status_code == 200, response.text
    assert response.json()["generated_text"] == generated_text(client, "The capital of France is")


def test_predictions_for_an_unknown_model_is_404(client):
    response = client.post("/predictions/no-such-model", json={"inputs": "Hi"})
    assert response.status_code == 404 and "no-such-model" in response.json()["error"]


def test_dynamic_batch_answers_chat_and_openai_routes_in_openai_shapes(dynamic_server):
    with httpx.Client(base_url=dynamic_server.url, timeout=300) as http:
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi."}],
                                                       "max_tokens": 8, "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["object"] == "chat.completion" and chat.json()["choices"][0]["message"]["content"]
        lmi_chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "Say hi."}],
                                                   "max_tokens": 8, "temperature": 0})
        assert lmi_chat.json()["choices"][0]["message"]["content"] == chat.json()["choices"][0]["message"]["content"]
        completion = http.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 4, "temperature": 0})
        assert completion.json()["object"] == "text_completion"
        # a list of prompts: one choice set per prompt (OpenAI, vLLM), the first the single prompt's answer
        listed = http.post("/v1/completions", json={"prompt": ["The sky is", "Grass is"], "max_tokens": 4,
                                                    "temperature": 0})
        assert listed.status_code == 200, listed.text
        choices = listed.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert choices[0]["text"] == completion.json()["choices"][0]["text"]


BODY = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6, "details": True}}


def sse_events(http: httpx.Client, body: dict) -> list[dict]:
    events = []
    with http.stream("POST", "/invocations", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
            else:
                assert line == "", f"unexpected SSE line {line!r}"
    return events


def test_tgi_compat_wraps_answers_in_a_list_and_streams_sse_by_default(tgi_server):
    with httpx.Client(base_url=tgi_server.url, timeout=300) as http:
        plain = http.post("/invocations", json=BODY).json()
        assert isinstance(plain, list) and len(plain) == 1
        answer = plain[0]
        assert answer["details"]["finish_reason"] == "length"
        assert all({"id", "text", "logprob", "special"} <= set(t) for t in answer["details"]["tokens"])
        events = sse_events(http, {**BODY, "stream": True})
        assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == answer["generated_text"]
        bad = http.post("/invocations", json={**BODY, "parameters": {"top_p": 2}})
        assert bad.status_code == 400 and "top_p" in bad.json()["error"]


def test_output_formatter_sse_streams_every_response_as_server_sent_events(sse_server):
    with httpx.Client(base_url=sse_server.url, timeout=300) as http:
        events = sse_events(http, BODY)  # no "stream": the server-wide formatter streams anyway
        assert len(events) == 6
        assert all("generated_text" not in e for e in events[:-1])
        assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"]
        assert events[-1]["details"]["generated_tokens"] == 6


PARAMS = {"max_new_tokens": 4, "do_sample": False}


def test_every_served_name_is_accepted_and_the_first_is_answered(app):
    listed = app.get("/v1/models").json()["data"]
    names = [m["id"] for m in listed]
    assert names == ["smol", "model"]
    assert all(isinstance(m["created"], int) and m["created"] > 1_700_000_000 and m["object"] == "model" for m in listed)
    for name in names:
        reply = app.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1})
        assert reply.status_code == 200 and reply.json()["model"] == "smol"
        assert app.post(f"/predictions/{name}", json={"inputs": "Hi", "parameters": PARAMS}).status_code == 200
    # any other `model` is answered by the loaded model too, under its first name (tests/server/test_openai.py
    # has option.strict_model_name's 404)
    foreign = app.post("/v1/completions", json={"model": "tgi", "prompt": "Hi", "max_tokens": 1})
    assert foreign.status_code == 200 and foreign.json()["model"] == "smol"
    assert app.post("/predictions/tgi", json={"inputs": "Hi", "parameters": PARAMS}).status_code == 404   # DJL's URL
    djl = app.get("/models").json()["models"]
    assert [m["modelName"] for m in djl] == names and {m["status"] for m in djl} == {"READY"}


def test_a_dead_engine_loop_is_unhealthy_and_requests_fail_fast(model_dir):
    """On an app of its own: stopping its front end's loop touches no other test's server."""
    with fresh_server(max_rolling_batch_size="2", num_threads="1", kv_cache_bytes=str(SMALL_KV_CACHE_BYTES)) as app:
        front_end = app.app.state.front_end
        front_end.stop()
        assert not front_end.thread.is_alive()
        assert app.get("/ping").status_code == 503 and app.get("/health").status_code == 503
        refused = app.post("/invocations", json={"inputs": "Hi", "parameters": PARAMS})
        assert refused.status_code == 503 and "engine" in refused.json()["error"]
        assert app.service is not None


def _followers(server_pid: int) -> list[int]:
    """The tensor-parallel follower ranks the server spawned (children running engine/parallel/worker.py)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and b"parallel.worker" in cmdline:
            pids.append(int(proc.name))
    return pids


def test_killing_a_tensor_parallel_follower_fails_the_running_request_and_ping_turns_503(tmp_path):
    """A real server at tensor_parallel_degree=2 (tiny random Llama): SIGKILL of rank 1 mid-stream ends the
    running stream with an error naming the rank, and /ping answers 503 within tensor_parallel_timeout_s."""
    from tests.engine.helpers import build_tiny_llama, build_tiny_tokenizer
    from tests.helpers import REPO, ServerProcess

    build_tiny_llama(tmp_path / "tiny", tie_word_embeddings=False, max_position_embeddings=4096)
    build_tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    timeout_s = 10
    options = {"model_id": str(tmp_path / "tiny"), "tensor_parallel_degree": "2", "num_threads": "1",
               "tensor_parallel_timeout_s": str(timeout_s), "kv_cache_bytes": str(16 << 20)}
    with ServerProcess(options, tmp_path / "server.log", REPO / "serving.properties") as server:
        (follower,) = _followers(server.proc.pid)
        lines = []
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 3000, "ignore_eos": True}, "stream": True}
            with client.stream("POST", "/invocations", json=body) as response:
                for line in response.iter_lines():
                    if line.strip():
                        lines.append(json.loads(line))
                    if len(lines) == 3:
                        os.kill(follower, signal.SIGKILL)
                        killed = time.monotonic()
            assert len(lines) < 3000 and "error" in json.dumps(lines[-1]) and "rank 1" in json.dumps(lines[-1])
            while client.get("/ping").status_code != 503:
                assert time.monotonic() - killed < timeout_s, "/ping still healthy past the timeout"
                time.sleep(0.1)
            assert client.get("/health").status_code == 503
