"""Values JSON and UTF-8 cannot carry back (lone surrogates anywhere, NaN/Infinity at any depth, numbers past
float or int range, nesting past 512 levels) on every generation route: only 2xx or 4xx, every answer UTF-8
and standard JSON (no NaN literals), a 4xx in its route's error shape, never a 5xx or a dropped connection
(issue 15: a `model` that is a lone surrogate gave a 500 and a reset connection, the error message echoed it).
Hypothesis, derandomized (tests/conftest.py); in-process for breadth, a real server process for the wire."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.server.fuzz_bodies import OPENAI_ROUTES, ROUTES, unencodable_bodies
from tests.server.inprocess import fresh_server

pytestmark = pytest.mark.slow

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])
CHAT = {"model": "model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
# The two bodies of the fuzz report, and their kin on the other routes.
REPORTED = [("/v1/chat/completions", b'{"model": "\\ud800", "messages": [{"role": "user", "content": "Hi"}], '
                                     b'"max_tokens": 1}'),
            ("/v1/chat/completions", b'{"model": "model", "messages": [{"role": "user", "content": "Hi"}], '
                                     b'"max_tokens": 1, "stop": {"a": {"b": [NaN, "\\udfff"]}}}'),
            ("/v1/completions", b'{"model": "x\\udc80y", "prompt": "Hi", "max_tokens": 1}'),
            ("/v1/chat/completions", b'{"model": "model", "messages": [{"role": "user", "content": "Hi"}], '
                                     b'"max_tokens": 1, "stream": true, "logit_bias": {"\\ud800": NaN}}'),
            ("/invocations", b'{"inputs": "Hi", "parameters": {"max_new_tokens": 1, "seed": "\\ud800", '
                             b'"top_p": {"x": Infinity}}}'),
            ("/generate", b'{"inputs": "Hi", "parameters": {"max_new_tokens": 1, "truncate": ' + b"9" * 4301 + b"}}"),
            ("/generate_stream", b'{"inputs": "\\ud83d", "parameters": {"max_new_tokens": 1}}')]


def _no_constants(name: str):
    raise ValueError(f"{name} is not standard JSON")


def strict_json(text: str):
    return json.loads(text, parse_constant=_no_constants)


def check_encodable(route: str, response: httpx.Response) -> None:
    """2xx or 4xx only; UTF-8 standard JSON (documents, jsonlines or SSE events); a 4xx in the route's shape."""
    assert response.status_code < 500, (route, response.status_code, response.text[:300])
    text = response.content.decode("utf-8")        # strict: a lone surrogate could not have been sent
    if response.status_code >= 400:
        error = strict_json(text)["error"]
        message = error["message"] if route in OPENAI_ROUTES else error
        assert isinstance(message, str) and message, text[:300]
        return
    if response.headers["content-type"].startswith("application/json"):
        strict_json(text)
        return
    for line in text.splitlines():                  # jsonlines, or SSE's `data: {...}` events
        line = line.removeprefix("data:").strip()
        if line and line != "[DONE]":
            strict_json(line)


@pytest.fixture(scope="module")
def app():
    with fresh_server(max_rolling_batch_size="4", num_threads="1") as server:
        yield server


def post(server, route: str, body: bytes):
    return server.post(route, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("route", "body"), REPORTED, ids=[f"{r}-{i}" for i, (r, _) in enumerate(REPORTED)])
def test_the_reported_unencodable_bodies_get_a_json_4xx(app, route, body):
    response = post(app, route, body)
    check_encodable(route, response)
    assert 400 <= response.status_code < 500


def test_a_lone_surrogate_model_is_a_404_that_names_it_escaped(app):
    response = post(app, "/v1/chat/completions", REPORTED[0][1])
    assert response.status_code == 404
    error = strict_json(response.content.decode("utf-8"))["error"]
    assert "\\ud800" in error["message"] and error["param"] == "model"


@pytest.mark.parametrize("route", ROUTES)
def test_values_json_and_utf8_cannot_carry_never_give_a_5xx_or_an_unencodable_answer(app, route):
    @FUZZ
    @given(body=unencodable_bodies(route))
    def fuzz(body):
        check_encodable(route, post(app, route, body))

    fuzz()
    assert app.get("/ping").status_code == 200
    normal = app.post("/v1/chat/completions", json=CHAT)
    assert normal.status_code == 200 and normal.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def real(rolling_server):
    with httpx.Client(base_url=rolling_server.url, timeout=300) as http:
        yield http


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/generate_stream"])
def test_unencodable_values_against_the_real_server_process(real, route):
    """Over real sockets: a dropped connection would raise httpx.RemoteProtocolError here."""
    for reported_route, body in REPORTED:
        check_encodable(reported_route, real.post(reported_route, content=body,
                                                  headers={"content-type": "application/json"}))

    @settings(FUZZ, max_examples=40)
    @given(body=unencodable_bodies(route))
    def fuzz(body):
        check_encodable(route, real.post(route, content=body, headers={"content-type": "application/json"}))

    fuzz()
    assert real.get("/ping").status_code == 200
    assert real.post("/v1/chat/completions", json=CHAT).status_code == 200
