"""server/ops.py: request ids on every response, the X-Request-Timeout header, cancel by id, clients that go
away, and the SIGTERM drain (fast rules, then a real server).
"""
from __future__ import annotations

import json
import logging
import signal
import threading
import time
import traceback

import httpx
import pytest

from lmi_handler.config import ConfigError
from lmi_handler.frontend.loops import RollingFrontEnd
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.server.ops import (
    ENGINE_DEAD_EXIT_CODE,
    _no_refusal_traceback,
    exit_when_dead,
    request_id_of,
    request_timeout,
)
from tests.server.helpers import Reply, idle, metric, send, send_all, start_server, wait_until


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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the loop thread's death
def test_the_process_exits_with_status_3_when_the_engine_loop_dies_and_not_when_it_is_stopped():
    """exit_when_dead's own rule, fast: a loop thread that ended by itself is a failure (the process must go,
    after exit_s); a front end stopped on purpose (shutdown) is not. os._exit is replaced: it would end pytest."""

    class LoopDies(Exception):
        pass

    def handle(inputs):           # the initialization call only
        return None

    def dies():                   # loop_once raising past the loop's own guard: the thread ends
        raise LoopDies("the loop itself broke")

    exits: list[int] = []
    dying = RollingFrontEnd(handle, {}, max_batch_size=2)
    dying.loop_once = dies
    dying.start()
    watcher = exit_when_dead(dying, exit_s=0.1, poll_s=0.01, exit_process=exits.append)
    watcher.join(timeout=10)
    assert exits == [ENGINE_DEAD_EXIT_CODE] == [3] and dying.failure == "the engine loop has stopped"
    stopped = RollingFrontEnd(handle, {}, max_batch_size=2)
    stopped.start()
    stopped.ready.wait(5)
    watcher = exit_when_dead(stopped, exit_s=0.1, poll_s=0.01, exit_process=exits.append)
    stopped.stop()
    watcher.join(timeout=10)
    assert not watcher.is_alive() and exits == [3]


def test_a_dead_engine_answers_in_flight_requests_even_while_its_step_is_stuck():
    """The engine-dead exit ends every live request with a 503 naming the failure before the process goes,
    though the loop thread never comes back from its step (a collective waiting on a tensor-parallel rank
    that died: seen as a stream cut off without its error line when the step outlived exit_s)."""
    import asyncio

    from lmi_handler.frontend.requests import ClientRequest

    stuck, release = threading.Event(), threading.Event()

    def handle(inputs):
        if inputs.content.size():       # a step: it never returns while the test runs
            stuck.set()
            release.wait(30)
        return None

    async def run() -> tuple[list, list[int]]:
        exits: list[int] = []
        front_end = RollingFrontEnd(handle, {}, max_batch_size=2)
        front_end.start()
        client = ClientRequest(b'{"inputs": "Hi"}', asyncio.get_running_loop(), public_id="a")
        front_end.track(client)
        front_end.submit(client)
        await asyncio.to_thread(stuck.wait, 10)
        front_end.engine_failure = lambda: RuntimeError("tensor-parallel rank 1 (pid 9) was killed by SIGKILL")
        watcher = exit_when_dead(front_end, exit_s=0.2, poll_s=0.01, exit_process=exits.append)
        chunk = await asyncio.wait_for(client.chunks.get(), 5)
        await asyncio.to_thread(watcher.join, 10)
        release.set()
        return [chunk, client.ended], exits

    (chunk, ended), exits = asyncio.run(run())
    assert chunk.last and chunk.code == 503 and "rank 1" in chunk.error and ended
    assert exits == [ENGINE_DEAD_EXIT_CODE]


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


# ---- a dead engine: unhealthy at once, every request ended, the process exits for its supervisor ------------

BREAKS_ENGINE = "broken:prefill@Zebras"     # engine/faults.py: from the step prefilling "Zebras", every step fails
DEAD_EXIT_S = 4.0
STREAMS = [("/invocations", {"inputs": "Tell me a very long story.", "stream": True,
                             "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}),
           ("/generate_stream", {"inputs": "Tell me a very long story.",
                                 "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}),
           ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}],
                                     "max_tokens": 2000, "ignore_eos": True, "stream": True})]


def stream_error(path: str, event: dict) -> tuple[int | None, str]:
    """(status, message) of a stream's error line in its dialect's shape (LMI, TGI or OpenAI)."""
    if path.startswith("/v1/"):
        return event["error"]["code"], event["error"]["message"]
    if path == "/generate_stream":
        assert event["error_type"] == "generation"
        return 503, event["error"]
    assert event["details"]["finish_reason"] == "error"
    return event["code"], event["error"]


@pytest.mark.slow
def test_a_dead_engine_turns_ping_503_ends_every_stream_refuses_new_requests_and_the_process_exits(
        model_dir, tmp_path_factory):
    server = start_server(tmp_path_factory, "dead-engine", env={"SERVING_JOB_QUEUE_SIZE": "1"},
                          max_rolling_batch_size="4", fault_injection=BREAKS_ENGINE,
                          engine_dead_exit_s=str(DEAD_EXIT_S))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            bad = http.post("/invocations", json={"inputs": "Hi", "parameters": {"top_k": -5}})
            assert bad.status_code == 400 and http.get("/ping").status_code == 200
            flights = []
            for count, (path, body) in enumerate(STREAMS, start=1):   # one by one: the queue holds only one
                flights.append(in_thread(send, server.url, path, body, stream=True))
                wait_until(lambda n=count: metric(http, "lmi_requests_running") == n, 60, poll_s=0.05)
            wait_until(lambda: metric(http, "lmi_generation_tokens_total") >= 6, 60, poll_s=0.05)
            burst = send_all(server.url, [{"path": "/invocations", "body": {"inputs": "Hi", "parameters": {
                "max_new_tokens": 2}}} for _ in range(10)])
            assert {r.status for r in burst} == {200, 503}        # the queue (1) and the free slot took two
            assert http.get("/ping").status_code == 200 and http.get("/health").status_code == 200
            breaking = http.post("/invocations", json={"inputs": "Zebras run", "parameters": {"max_new_tokens": 4}})
            died = time.monotonic()
            assert breaking.status_code == 503 and "engine is dead" in breaking.json()["error"]
            wait_until(lambda: http.get("/ping").status_code == 503, 3)
            ping = http.get("/ping").json()
            assert ping["status"] == "Unhealthy" and "engine is dead" in ping["reason"]
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["error_type"] == "healthcheck"
            start = time.monotonic()
            refused = http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503 and time.monotonic() - start < 2
            assert refused.json()["error"]["type"] == "server_error" and "engine" in refused.json()["error"]["message"]
        for (path, _), (thread, box) in zip(STREAMS, flights):
            thread.join(timeout=10)
            (reply,) = box
            assert reply.status == 200 and reply.error is None and len(reply.events) >= 2, (path, reply)
            code, message = stream_error(path, reply.events[-1])
            assert code == 503 and "engine is dead" in message, path
            assert reply.total_s - reply.head_s < 60
        assert server.proc.wait(timeout=DEAD_EXIT_S + 20) == 3      # ENGINE_DEAD_EXIT_CODE: the supervisor restarts it
        assert time.monotonic() - died >= DEAD_EXIT_S - 1
        assert "exiting in 4 s with status 3" in server.log_path.read_text()
    finally:
        server.stop()


@pytest.mark.slow
def test_a_dynamic_batch_engine_found_dead_answers_503_and_engine_dead_exit_0_keeps_the_process_up(
        model_dir, tmp_path_factory):
    server = start_server(tmp_path_factory, "dead-dynamic", rolling_batch="disable", fault_injection=BREAKS_ENGINE,
                          engine_dead_exit_s="0")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            ok = http.post("/invocations", json={"inputs": "The sky is", "parameters": {"max_new_tokens": 2}})
            assert ok.status_code == 200 and http.get("/ping").status_code == 200
            breaking = http.post("/invocations", json={"inputs": "Zebras run", "parameters": {"max_new_tokens": 2}})
            assert breaking.status_code == 503 and "engine is dead" in breaking.json()["error"]
            assert http.get("/ping").status_code == 503
            assert http.post("/generate", json={"inputs": "Hi"}).status_code == 503
            time.sleep(3)
            assert server.proc.poll() is None and http.get("/ping").status_code == 503   # 0: kept up, unhealthy
            assert http.get("/models").json()["models"][0]["status"] == "UNHEALTHY"
    finally:
        server.stop()


def _traceback_of(raise_it) -> str:
    try:
        raise_it()
    except Exception:  # noqa: BLE001 - any error, formatted as starlette hands it to uvicorn
        return traceback.format_exc()
    raise AssertionError("nothing raised")


def test_uvicorns_start_up_traceback_is_dropped_for_a_refused_setting_only():
    """serve()'s filter on uvicorn.error: a ConfigError's traceback goes (cli.py prints its one line); another
    error's stays, one raised while handling a ConfigError too."""
    def refused():
        raise ConfigError("option.x=1: must be 2")

    def chained():
        try:
            refused()
        except ConfigError as exc:
            raise RuntimeError("the model did not load") from exc

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, message, None, None)

    assert not _no_refusal_traceback(record(_traceback_of(refused)))
    assert _no_refusal_traceback(record(_traceback_of(chained)))
    assert _no_refusal_traceback(record(_traceback_of(lambda: 1 / 0)))
    assert _no_refusal_traceback(record("Application startup failed. Exiting."))
