"""Request cases on operating the server: overload refused at once (C27), deadlines (C29), a fault in one
sequence's step (C31), each on a server with the set-up the case names.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.helpers import load_case
from tests.server.helpers import Reply, idle, metric, send, send_all, start_server, wait_until

pytestmark = pytest.mark.slow


INVOCATIONS, CHAT = "/invocations", "/v1/chat/completions"


def text_of(reply: Reply) -> str:
    if reply.lines:
        return "".join(e["token"]["text"] for e in reply.events if "token" in e and "error" not in e)
    return reply.json()["generated_text"]


def chat_text_of(reply: Reply) -> str:
    if reply.lines:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in reply.events if c.get("choices"))
    return reply.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def queue_server(model_dir, tmp_path_factory):
    server = start_server(tmp_path_factory, "c27", env={"SERVING_JOB_QUEUE_SIZE": "4"}, max_rolling_batch_size="2")
    yield server
    server.stop()


class PingWatch:
    """Polls /ping from a thread while an overload runs; every answer must be 200 (full is not unhealthy)."""

    def __init__(self, url: str):
        self.url, self.codes, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self.stop.is_set():
                self.codes.append(http.get("/ping").status_code)
                time.sleep(0.2)

    def __enter__(self) -> "PingWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def overload(url: str, path: str, body: dict, stream: bool = False) -> tuple[list[Reply], float]:
    with PingWatch(url) as watch:
        start = time.monotonic()
        replies = send_all(url, [dict(path=path, body=body, stream=stream)] * 24)
        elapsed = time.monotonic() - start
    assert watch.codes and set(watch.codes) == {200}
    return replies, elapsed


def check_refusals(replies: list[Reply], openai: bool) -> list[Reply]:
    """Every reply is 200 or an immediate 503 JSON error; returns the 200s."""
    assert {r.status for r in replies} <= {200, 503}, [(r.status, r.error) for r in replies]
    refused = [r for r in replies if r.status == 503]
    accepted = [r for r in replies if r.status == 200]
    assert len(refused) >= 12 and len(accepted) >= 2
    assert max(r.head_s for r in refused) < 1.0, sorted(round(r.head_s, 2) for r in refused)
    for r in refused:
        assert r.headers["content-type"].startswith("application/json")
        body = r.json()
        message = body["error"]["message"] if openai else body["error"]
        assert "job_queue_size" in message
        assert (body["error"]["code"] if openai else body["code"]) == 503
    return accepted


def test_c27_overload_is_refused_at_once_and_every_accepted_request_completes_unmixed(queue_server):
    request = load_case("C27")["request"]
    url = queue_server.url
    start = time.monotonic()
    solo = send(url, INVOCATIONS, request)
    solo_s = time.monotonic() - start
    assert solo.status == 200 and solo_s >= 1.0   # the precondition: T >= 1 s
    solo_text = solo.json()["generated_text"]
    replies, elapsed = overload(url, INVOCATIONS, request)
    for r in check_refusals(replies, openai=False):
        assert r.json()["generated_text"] == solo_text
    assert elapsed < 24 * solo_s
    start = time.monotonic()
    assert send(url, INVOCATIONS, request).json()["generated_text"] == solo_text
    assert time.monotonic() - start < 2 * solo_s


def test_c27_overload_on_the_openai_route_gets_error_objects_never_a_failing_200_stream(queue_server):
    url = queue_server.url
    body = {"messages": [{"role": "user", "content": "The sky is"}], "max_tokens": 128, "temperature": 0}
    solo = chat_text_of(send(url, CHAT, body))
    calls = [dict(path=CHAT, body={**body, "stream": i % 2 == 1}, stream=i % 2 == 1) for i in range(24)]
    with PingWatch(url) as watch:   # one overload, half of it streamed
        replies = send_all(url, calls)
    assert watch.codes and set(watch.codes) == {200}
    for r in check_refusals(replies, openai=True):
        if r.lines:
            assert r.lines[-1] == "data: [DONE]" and not any("error" in e for e in r.events)
        assert chat_text_of(r) == solo
    with httpx.Client(base_url=url) as http:
        wait_until(lambda: idle(http), 10)


@pytest.fixture(scope="module")
def deadline_server(model_dir, tmp_path_factory):
    server = start_server(tmp_path_factory, "c29", request_timeout_s="2", max_rolling_batch_size="1")
    yield server
    server.stop()


def is_timeout_error(reply: Reply, openai: bool = False) -> bool:
    if reply.status not in (408, 504):
        return False
    body = reply.json()
    message = body["error"]["message"] if openai else body["error"]
    return "timed out" in message and "request_timeout_s" in message


def test_c29_a_request_past_its_deadline_ends_within_the_deadline_with_a_timeout_error(deadline_server):
    request = load_case("C29")["request"]
    url = deadline_server.url
    with httpx.Client(base_url=url) as http:
        kv_before = metric(http, "lmi_kv_cache_blocks_used")
        whole = send(url, INVOCATIONS, request)
        assert whole.total_s < 4 and is_timeout_error(whole), (whole.status, whole.body)
        streamed = send(url, INVOCATIONS, {**request, "stream": True}, stream=True)
        assert streamed.total_s < 4 and streamed.status == 200
        events = streamed.events
        assert events[-1]["details"]["finish_reason"] == "error" and "timed out" in events[-1]["error"]
        assert all("details" not in e for e in events[:-1]) and len(events) > 1   # tokens came before
        wait_until(lambda: idle(http, kv_before), 1.0)


def test_c29_waiting_requests_time_out_too_and_nothing_stays_behind(deadline_server):
    request = load_case("C29")["request"]
    url = deadline_server.url
    with httpx.Client(base_url=url) as http:
        kv_before = metric(http, "lmi_kv_cache_blocks_used")
        prompts = ["Once upon a time", "The river", "In the city", "Long ago"]
        replies = send_all(url, [dict(path=INVOCATIONS, body={**request, "inputs": p}) for p in prompts])
        assert all(r.total_s < 4 and is_timeout_error(r) for r in replies), [(r.status, r.body) for r in replies]
        wait_until(lambda: idle(http, kv_before), 1.0)


def test_c29_a_request_that_fits_its_deadline_is_untouched(deadline_server):
    reply = send(deadline_server.url, INVOCATIONS, {"inputs": "Hi", "parameters": {"max_new_tokens": 4,
                                                                                    "details": True}})
    assert reply.status == 200 and reply.total_s < 2
    details = reply.json()["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 4


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_c29_a_chat_completion_past_its_deadline_ends_in_time(deadline_server, stream):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4000,
            "temperature": 0, "stream": stream}
    reply = send(deadline_server.url, CHAT, body, stream=stream)
    assert reply.total_s < 4
    if stream and reply.status == 200:
        assert "timed out" in reply.events[-1]["error"]["message"] and reply.lines[-1] == "data: [DONE]"
    else:
        assert is_timeout_error(reply, openai=True)


def test_the_timeout_header_overrides_the_option_for_one_request(deadline_server):
    request = load_case("C29")["request"]
    shorter = send(deadline_server.url, INVOCATIONS, request, headers={"X-Request-Timeout": "0.5"})
    assert is_timeout_error(shorter) and "0.5 s" in shorter.json()["error"] and shorter.total_s < 1.5
    longer = send(deadline_server.url, INVOCATIONS, request, headers={"X-Request-Timeout": "3"})
    assert is_timeout_error(longer) and 3 <= longer.total_s < 4.5
    bad = send(deadline_server.url, INVOCATIONS, request, headers={"X-Request-Timeout": "soon"})
    assert bad.status == 400 and "X-Request-Timeout" in bad.json()["error"]


@pytest.fixture(scope="module")
def fault_server(model_dir, tmp_path_factory):
    server = start_server(tmp_path_factory, "c31", max_rolling_batch_size="8",
                          fault_injection="decode:4@Water is;prefill@Zebras")
    yield server
    server.stop()


def stream_call(inputs: str, max_new_tokens: int = 32) -> dict:
    return dict(path=INVOCATIONS, stream=True, body={"inputs": inputs, "stream": True, "parameters": {
        "do_sample": False, "max_new_tokens": max_new_tokens, "details": True}})


def error_counter(http: httpx.Client) -> float:
    """The finished-requests counter labelled finish_reason="error", summed (0 before the first error)."""
    text = http.get("/metrics").text
    assert "lmi_requests_finished_total" in text, "the requests-by-finish_reason counter is not exported"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if not line.startswith("#") and 'finish_reason="error"' in line and "_total" in line.split("{")[0])


def check_completed(reply: Reply, solo: str, tokens: int = 32) -> None:
    assert reply.status == 200
    events = reply.events
    assert events[-1]["details"]["finish_reason"] == "length" and len(events) == tokens
    assert text_of(reply) == solo == events[-1]["generated_text"]


def check_faulted_stream(reply: Reply) -> None:
    """The stream ends with its error line (finish_reason "error") after at most 4 token lines."""
    assert reply.status == 200 and reply.error is None
    events = reply.events
    assert events[-1]["details"]["finish_reason"] == "error" and "injected fault" in events[-1]["error"]
    assert len(events) - 1 <= 4 and all("details" not in e for e in events[:-1])


def check_faulted_whole(reply: Reply) -> None:
    assert 400 <= reply.status < 600 and "injected fault" in reply.json()["error"]


@pytest.fixture(scope="module")
def solos(fault_server) -> dict[str, str]:
    return {p: text_of(send(fault_server.url, **stream_call(p))) for p in ("The sky is", "Cats are", "Music is")}


def after_fault_the_server_serves(url: str, solo: str, kv_before: float) -> None:
    with httpx.Client(base_url=url) as http:
        assert http.get("/ping").status_code == 200
        time.sleep(1)
        check_completed(send(url, **stream_call("The sky is")), solo)
        wait_until(lambda: idle(http, kv_before), 5)


def test_c31_a_fault_at_one_sequences_decode_step_fails_that_request_alone(fault_server, solos):
    url = fault_server.url
    with httpx.Client(base_url=url) as http:
        kv_before, errors_before = metric(http, "lmi_kv_cache_blocks_used"), error_counter(http)
    r1, r2, r3, r4 = send_all(url, [stream_call(p) for p in ("The sky is", "Water is", "Cats are", "Music is")])
    check_faulted_stream(r2)
    for reply, prompt in ((r1, "The sky is"), (r3, "Cats are"), (r4, "Music is")):
        check_completed(reply, solos[prompt])
    after_fault_the_server_serves(url, solos["The sky is"], kv_before)
    whole = send(url, INVOCATIONS, {"inputs": "Water is", "parameters": {"do_sample": False, "max_new_tokens": 32}})
    check_faulted_whole(whole)
    with httpx.Client(base_url=url) as http:
        assert error_counter(http) - errors_before == 2      # both faulted requests, counted once each


def test_c31_a_fault_in_the_prefill_of_a_joining_request_fails_it_alone(fault_server, solos):
    url = fault_server.url
    with httpx.Client(base_url=url) as http:
        kv_before = metric(http, "lmi_kv_cache_blocks_used")
        running: dict[str, Reply] = {}
        threads = [threading.Thread(target=lambda p=p: running.__setitem__(p, send(url, **stream_call(p))))
                   for p in ("The sky is", "Cats are", "Music is")]
        for thread in threads:
            thread.start()
        wait_until(lambda: metric(http, "lmi_requests_running") == 3, 30, poll_s=0.05)
        joining = send(url, INVOCATIONS, {"inputs": "Zebras are", "parameters": {"max_new_tokens": 32}})
        joining_stream = send(url, **stream_call("Zebras are"))
        for thread in threads:
            thread.join()
    check_faulted_whole(joining)
    check_faulted_whole(joining_stream)   # failed before its first token: a JSON error, no 200 stream
    for prompt, reply in running.items():
        check_completed(reply, solos[prompt])
    after_fault_the_server_serves(url, solos["The sky is"], kv_before)


def test_c31_ten_faulted_rounds_leak_no_kv_block_and_keep_the_same_worker(fault_server, solos):
    url = fault_server.url
    pid = fault_server.proc.pid
    with httpx.Client(base_url=url) as http:
        kv_before = metric(http, "lmi_kv_cache_blocks_used")
        short = text_of(send(url, **stream_call("The sky is", 8)))
        for _ in range(10):
            ok, hit, joined = send_all(url, [stream_call("The sky is", 8), stream_call("Water is", 8),
                                             dict(path=INVOCATIONS, body={"inputs": "Zebras are"})])
            check_completed(ok, short, tokens=8)
            check_faulted_stream(hit)
            check_faulted_whole(joined)
        wait_until(lambda: idle(http, kv_before), 5)
        assert http.get("/ping").status_code == 200
    assert fault_server.proc.poll() is None and fault_server.proc.pid == pid
