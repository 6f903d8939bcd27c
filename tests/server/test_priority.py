"""Request priority through the real server (option.scheduling_policy): the order requests leave the waiting
queue in, and the refusals of a priority the server cannot honour or parse, in each dialect's error shape.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lmi_handler.protocol.dialects import ROUTE_CHAT
from lmi_handler.protocol.errors import RequestValidationError
from tests.helpers import serve
from tests.server.helpers import metric, wait_until

pytestmark = pytest.mark.slow

NUM_LOW = 64
BATCH = 4          # max_rolling_batch_size: the other low requests wait in the front end's queue


@pytest.fixture(scope="module")
def priority_server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, "priority", scheduling_policy="priority", max_rolling_batch_size=str(BATCH),
                     num_threads="1")


def first_event_time(http: httpx.Client, body: dict, first: dict[str, float], name: str,
                     stop: threading.Event) -> None:
    """Stream a completion, noting when its first event arrived; closes the stream once `stop` is set."""
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                first.setdefault(name, time.monotonic())
            if stop.is_set():
                return


def test_a_high_priority_request_behind_64_queued_low_ones_gets_its_first_token_before_any_not_started(
        priority_server):
    first: dict[str, float] = {}
    stop = threading.Event()
    limits = httpx.Limits(max_connections=NUM_LOW + 8)
    with httpx.Client(base_url=priority_server.url, timeout=600, limits=limits) as http, \
            ThreadPoolExecutor(NUM_LOW + 1) as pool:
        # every low one a different length, so slots free one at a time: one step never admits two requests
        lows = [pool.submit(first_event_time, http, {"prompt": f"Count to {i}:", "max_tokens": 24 + i, "priority": 1,
                                                     "temperature": 0, "ignore_eos": True}, first, f"low{i}", stop)
                for i in range(NUM_LOW)]
        try:
            wait_until(lambda: len(first) == BATCH
                       and metric(http, "lmi_front_end_queue_depth") == NUM_LOW - BATCH, timeout_s=120, poll_s=0.02)
            started = set(first)
            high = pool.submit(first_event_time, http, {"prompt": "Hello", "max_tokens": 2, "priority": 0}, first,
                               "high", stop)
            wait_until(lambda: "high" in first, timeout_s=300, poll_s=0.02)
            high.result(timeout=60)
        finally:
            stop.set()
        for low in lows:
            low.result(timeout=300)
    assert len(started) == BATCH
    overtaken = [name for name in first if name not in started and name != "high"]
    assert all(first[name] > first["high"] for name in overtaken), sorted(first, key=first.get)


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "priority": "high"}),
    ("/v1/completions", {"prompt": "Hi", "priority": 1.5}),
    ("/invocations", {"inputs": "Hi", "parameters": {"priority": True}}),
    ("/generate", {"inputs": "Hi", "parameters": {"priority": [1]}}),
])
def test_a_priority_that_is_not_an_integer_answers_400_naming_the_field(priority_server, route, body):
    response = httpx.post(priority_server.url + route, json={**body, "max_tokens": 2}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    if route.startswith("/v1"):
        assert error["param"] == "priority" and "`priority`" in error["message"]
    else:
        assert "`priority`" in error and response.json()["code"] == 400


def test_under_priority_every_dialect_takes_a_priority(priority_server):
    url = priority_server.url
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 2, "priority": -5}, timeout=60)
    lmi = httpx.post(url + "/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2, "priority": 3}},
                     timeout=60)
    tgi = httpx.post(url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2, "priority": 3}},
                     timeout=60)
    assert [chat.status_code, lmi.status_code, tgi.status_code] == [200, 200, 200], (chat.text, lmi.text, tgi.text)


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 1}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": -1}),
    ("/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "priority": 2}}),
])
def test_under_fcfs_a_priority_other_than_0_answers_400_naming_the_field(app, route, body):
    response = app.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    message = error["message"] if route.startswith("/v1") else error
    assert "`priority`" in message and "option.scheduling_policy=priority" in message
    if route.startswith("/v1"):
        assert error["param"] == "priority"
    assert app.post(route, json=_with_priority(body, 0)).status_code == 200


def test_under_fcfs_a_batch_line_with_a_priority_other_than_0_is_refused_naming_the_field(app):
    with pytest.raises(RequestValidationError) as refused:
        app.service.plan_openai_body({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                      "priority": 4}, ROUTE_CHAT, "line-1")
    assert refused.value.field == "priority" and refused.value.status_code == 400
    plan = app.service.plan_openai_body({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                         "priority": 0}, ROUTE_CHAT, "line-2")
    assert plan.priority == 0


def _with_priority(body: dict, priority: int) -> dict:
    if "parameters" in body:
        return {**body, "parameters": {**body["parameters"], "priority": priority}}
    return {**body, "priority": priority}
