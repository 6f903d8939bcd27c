"""server/ops.py: request ids on every response, the X-Request-Timeout header, cancel by id, clients that go
away, and the SIGTERM drain (fast rules, then a real server).
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.server.ops import request_id_of, request_timeout
from tests.server.helpers import Reply, idle, metric, send, start_server, wait_until


def test_the_timeout_header_overrides_the_option_and_bad_values_name_the_header():
    assert request_timeout({}, None) is None
    assert request_timeout({}, 2.0) == 2.0
    assert request_timeout({"x-request-timeout": "0.5"}, 2.0) == 0.5
    for bad in ("0", "-1", "soon", "nan", "inf", "1e9"):
        with pytest.raises(RequestValidationError, match="X-Request-Timeout"):
            request_timeout({"x-request-timeout": bad}, None)


def test_request_ids_are_the_clients_when_well_formed_else_generated():
    assert request_id_of({"x-request-id": "abc-123_x.y:z"}) == "abc-123_x.y:z"
    for bad in ("", "a b", "x" * 129, "é"):
        made = request_id_of({"x-request-id": bad})
        assert len(made) == 32 and made != bad
    assert request_id_of({}) != request_id_of({})


LONG = {"inputs": "Tell me a very long story.", "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = start_server(tmp_path_factory, "ops", env={"SERVING_JOB_QUEUE_SIZE": "4"}, max_rolling_batch_size="2")
    yield server
    server.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        wait_until(lambda: idle(client), 30)
        yield client
        wait_until(lambda: idle(client), 30)


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn(*args, **kwargs)))
    thread.start()
    return thread, box


@pytest.mark.slow
def test_every_response_carries_the_clients_request_id_or_a_generated_one(http):
    calls = [("GET", "/ping", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
             ("POST", "/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
             ("POST", "/invocations", {"inputs": "Hi", "parameters": {"top_p": 7}}),
             ("POST", "/v1/chat/completions", {"messages": "nope"}), ("GET", "/no/such/route", None),
             ("POST", "/v1/requests/nobody/cancel", None)]
    seen = set()
    for method, path, body in calls:
        given = http.request(method, path, json=body, headers={"x-request-id": f"id-{len(seen)}"})
        assert given.headers["x-request-id"] == f"id-{len(seen)}", (path, given.status_code)
        made = http.request(method, path, json=body).headers["x-request-id"]
        assert len(made) == 32 and made not in seen
        seen |= {made, f"id-{len(seen)}"}
    with http.stream("POST", "/invocations", json={**LONG, "stream": True, "parameters": {"max_new_tokens": 3}},
                     headers={"x-request-id": "streamed-1"}) as response:
        assert response.headers["x-request-id"] == "streamed-1"
        response.read()


@pytest.mark.slow
def test_cancel_by_id_ends_a_running_stream_with_its_error_line_and_frees_its_blocks(http):
    with http.stream("POST", "/invocations", json={**LONG, "stream": True},
                     headers={"x-request-id": "cancel-stream"}) as response:
        lines = response.iter_lines()
        for _ in range(2):
            assert "token" in json.loads(next(lines))
        cancelled = http.post("/v1/requests/cancel-stream/cancel")
        asked = time.monotonic()
        assert cancelled.status_code == 200 and cancelled.json() == {"id": "cancel-stream",
                                                                     "object": "request.cancel", "cancelled": True}
        rest = [json.loads(line) for line in lines if line.strip()]
        assert time.monotonic() - asked < 2
    last = rest[-1]
    assert last["details"]["finish_reason"] == "error" and "cancelled" in last["error"] and last["code"] == 409
    wait_until(lambda: idle(http), 2)
    assert http.post("/v1/requests/cancel-stream/cancel").status_code == 404   # finished: nothing to cancel


def cancel_whole(server, http, request_id: str, gauge: str, value: int, join_s: float):
    """Send LONG (not streamed) as `request_id`, wait until `gauge` reads `value`, cancel it by id;
    returns its reply once the sending thread ends (within `join_s`)."""
    thread, box = in_thread(send, server.url, "/invocations", LONG, headers={"x-request-id": request_id})
    wait_until(lambda: metric(http, gauge) == value, 30, poll_s=0.05)
    assert http.post(f"/v1/requests/{request_id}/cancel").status_code == 200
    thread.join(timeout=join_s)
    (reply,) = box
    return reply


@pytest.mark.slow
def test_cancel_by_id_ends_a_running_non_streaming_request_with_a_409_json_error(server, http):
    reply = cancel_whole(server, http, "cancel-whole", "lmi_requests_running", 1, join_s=10)
    assert reply.status == 409 and "cancelled" in reply.json()["error"]
    wait_until(lambda: idle(http), 2)


def hold_batch(server, http, count: int = 2) -> list[tuple[threading.Thread, list]]:
    """Fill the batch (2) with long streams named hold-i; the caller cancels them."""
    holds = [in_thread(send, server.url, "/invocations", {**LONG, "stream": True}, stream=True,
                       headers={"x-request-id": f"hold-{i}"}) for i in range(count)]
    wait_until(lambda: metric(http, "lmi_requests_running") == count, 30, poll_s=0.05)
    return holds


def release(http, holds) -> None:
    for i, (thread, box) in enumerate(holds):
        assert http.post(f"/v1/requests/hold-{i}/cancel").status_code == 200
        thread.join(timeout=10)
        assert box[0].events[-1]["details"]["finish_reason"] == "error"


@pytest.mark.slow
def test_cancel_by_id_ends_a_queued_request_at_once_without_touching_the_running_ones(server, http):
    holds = hold_batch(server, http)
    reply = cancel_whole(server, http, "queued-1", "lmi_front_end_queue_depth", 1, join_s=2)
    assert reply.status == 409 and "queued-1" in reply.json()["error"]
    assert metric(http, "lmi_requests_running") == 2 and metric(http, "lmi_front_end_queue_depth") == 0
    release(http, holds)


@pytest.mark.slow
def test_cancelling_an_unknown_id_answers_404_with_an_openai_error_object(http):
    reply = http.post("/v1/requests/never-seen/cancel")
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == 404 and "never-seen" in reply.json()["error"]["message"]


@pytest.mark.slow
def test_a_streaming_client_that_disconnects_has_its_sequence_aborted_and_blocks_freed(http):
    with http.stream("POST", "/invocations", json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric(http, "lmi_kv_cache_blocks_used") > 0
    wait_until(lambda: idle(http), 2)


@pytest.mark.slow
def test_a_non_streaming_client_that_disconnects_has_its_sequence_aborted_and_blocks_freed(server, http):
    reply = send(server.url, "/invocations", LONG, timeout_s=2)
    assert reply.error is not None and "Timeout" in reply.error
    wait_until(lambda: idle(http), 2)


@pytest.mark.slow
def test_a_queued_client_that_disconnects_leaves_the_queue_and_never_runs(server, http):
    holds = hold_batch(server, http)
    reply = send(server.url, "/invocations", LONG, timeout_s=1.5)
    assert reply.error is not None
    wait_until(lambda: metric(http, "lmi_front_end_queue_depth") == 0, 2)
    assert metric(http, "lmi_requests_running") == 2
    release(http, holds)


@pytest.mark.slow
def test_sigterm_refuses_new_requests_and_drains_every_accepted_one_before_exiting(model_dir, tmp_path_factory):
    server = start_server(tmp_path_factory, "drain", max_rolling_batch_size="8", shutdown_grace_s="120")
    try:
        body = {"inputs": "The sky is", "stream": True, "parameters": {"max_new_tokens": 24, "ignore_eos": True,
                                                                       "details": True}}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            flights = [in_thread(send, server.url, "/invocations", body, stream=True) for _ in range(8)]
            wait_until(lambda: metric(http, "lmi_requests_running") == 8, 60, poll_s=0.05)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = http.post("/invocations", json={"inputs": "Hi"})
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
            ping = http.get("/ping")          # a load balancer stops routing here while the drain runs
            assert ping.status_code == 503 and ping.json() == {"status": "Draining"}
            assert http.get("/health").status_code == 503
        replies: list[Reply] = []
        for thread, box in flights:
            thread.join(timeout=120)
            replies.extend(box)
        assert len(replies) == 8
        for reply in replies:
            assert reply.status == 200 and reply.error is None
            assert reply.events[-1]["details"]["finish_reason"] == "length" and len(reply.events) == 24
        assert len({reply.events[-1]["generated_text"] for reply in replies}) == 1
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
