"""Bad input everywhere: thousands of generated bad bodies (hypothesis, derandomized in tests/conftest.py) on
/invocations, TGI's routes and the OpenAI routes never get a 5xx or a 424, always a JSON answer, and the
server still answers /ping and a normal request afterwards. Mostly in-process (the real app over ASGI),
plus a shorter run against a real server process."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.server.fuzz_bodies import OPENAI_ROUTES, ROUTES, bad_bodies, nested, nested_in_field
from tests.server.inprocess import fresh_server

pytestmark = pytest.mark.slow

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def app():
    with fresh_server(max_rolling_batch_size="4", num_threads="1") as server:
        yield server


def check_answer(route: str, response: httpx.Response) -> None:
    """No 5xx, no 424; an error is JSON naming the problem in our shape for the route."""
    assert response.status_code < 500 and response.status_code != 424, (route, response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        message = error["message"] if route in OPENAI_ROUTES else error
        assert isinstance(message, str) and message


def post(server, route: str, body: bytes, content_type: str | None = "application/json") -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    return server.post(route, content=body, headers=headers)


def check_still_serving(server) -> None:
    assert server.get("/ping").status_code == 200
    response = server.post("/invocations", json={"inputs": "The sky is", "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 200 and response.json()["generated_text"]


@pytest.mark.parametrize("route", ROUTES)
def test_generated_bad_bodies_get_a_4xx_naming_the_problem(app, route):
    @FUZZ
    @given(request=bad_bodies(route))
    def fuzz(request):
        check_answer(route, post(app, route, *request))

    fuzz()
    check_still_serving(app)


@pytest.mark.parametrize("route", ["/invocations", "/generate", "/v1/chat/completions", "/v1/completions"])
def test_every_nesting_depth_from_900_to_1100_is_a_400(app, route):
    for depth in range(900, 1101):
        for body in (nested(depth, route), nested_in_field(depth, route)):
            response = post(app, route, body)
            assert response.status_code == 400, (depth, response.status_code, response.text[:200])
            check_answer(route, response)
    check_still_serving(app)


@pytest.fixture(scope="module")
def real(rolling_server):
    with httpx.Client(base_url=rolling_server.url, timeout=300) as http:
        yield http


@pytest.mark.parametrize("route", ["/invocations", "/generate_stream", "/v1/chat/completions"])
def test_bad_bodies_against_the_real_server_process(real, route):
    @settings(FUZZ, max_examples=60)
    @given(request=bad_bodies(route))
    def fuzz(request):
        body, content_type = request
        headers = {"content-type": content_type} if content_type else {}
        check_answer(route, real.post(route, content=body, headers=headers))

    fuzz()
    for depth in (900, 983, 984, 985, 986, 1000, 1100):
        check_answer(route, real.post(route, content=nested(depth, route)))
    assert real.get("/ping").status_code == 200
    normal = real.post("/invocations", json={"inputs": "The sky is", "parameters": {"max_new_tokens": 2}})
    assert normal.status_code == 200 and json.loads(normal.text)["generated_text"]
