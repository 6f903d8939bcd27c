"""server/auth.py: API keys. Every route of the real app without a key answers 401 in its dialect's shape,
/ping and /health stay open (and /metrics unless option.metrics_require_key); then a real server with keys,
used by the real clients (the openai SDK's api_key, the TGI client's headers, submit_batch(api_key=...)),
and the key never reaches its log.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from lmi_handler.batch import create_batch, submit_batch
from lmi_handler.config import read_serving_properties
from lmi_handler.protocol.dialects import Dialect, dialect_of
from lmi_handler.server.app import create_app
from lmi_handler.server.auth import key_matches
from tests.helpers import REPO
from tests.server.helpers import PROMPT, run_tgi_client, start_server

KEYS = ("sk-first-8f2e61c0", "sk-second-41ab77d9")
KEYS_BYTES = tuple(key.encode() for key in KEYS)


def test_a_key_matches_only_as_a_bearer_token_equal_to_one_of_the_keys():
    assert key_matches("Bearer sk-first-8f2e61c0", KEYS_BYTES) and key_matches("bearer  sk-second-41ab77d9 ", KEYS_BYTES)
    for header in (None, "", "Bearer", "Bearer ", "sk-first-8f2e61c0", "Basic sk-first-8f2e61c0",
                   "Bearer sk-first-8f2e61c", "Bearer sk-first-8f2e61c0x", "Bearer sk-first-8f2e61c0,sk-second-41ab77d9",
                   "Bearer \udcff", "Bearer " + "x" * 10_000):
        assert not key_matches(header, KEYS_BYTES), header


def app_with(tmp_path, **options: str):
    """The real app (its routes and middleware; no model loaded: a refused request never reaches one)."""
    properties = read_serving_properties(REPO / "serving.properties", environ={})
    return create_app({**properties, "batch_dir": str(tmp_path / "batches"), "api_key": ",".join(KEYS), **options})


def every_route(app) -> list[tuple[str, str]]:
    """(method, path) of each route the app serves (its OpenAPI document lists them, the Batch API's included;
    the document and its pages besides), path parameters filled in."""
    calls = [("GET", "/openapi.json"), ("GET", "/docs")]
    for template, methods in app.openapi()["paths"].items():
        path = template.replace("{model_name}", "m").replace("{file_id}", "file-x").replace(
            "{batch_id}", "batch_x").replace("{request_id}", "r")
        calls += [(method.upper(), path) for method in sorted(methods)]
    return calls


def ask(app, calls: list[tuple[str, str]], headers: dict | None = None) -> list[httpx.Response]:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            return [await http.request(method, path, json={}, headers=headers) for method, path in calls]
    return asyncio.run(run())


def check_401(path: str, response: httpx.Response) -> None:
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", path
    body = response.json()
    if dialect_of(path) is Dialect.OPENAI:
        assert body["error"]["code"] == 401 and body["error"]["type"] == "invalid_request_error", path
        assert "API key" in body["error"]["message"]
    else:                      # LMI's, and TGI's for a refusal before inference: {"error", "code"}
        assert body["code"] == 401 and "API key" in body["error"], path


def test_every_route_but_ping_health_and_metrics_answers_401_without_a_valid_key(tmp_path):
    app = app_with(tmp_path)
    calls = every_route(app)
    paths = {path for _, path in calls}
    assert {"/invocations", "/predictions/m", "/v1/chat/completions", "/v1/completions", "/v1/models", "/generate",
            "/generate_stream", "/", "/info", "/models", "/v1/files", "/v1/batches", "/v1/requests/r/cancel"} <= paths
    guarded = [(m, p) for m, p in calls if p not in ("/ping", "/health", "/metrics")]
    for headers in (None, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEYS[0]}"}):
        for (_, path), response in zip(guarded, ask(app, guarded, headers)):
            check_401(path, response)
    unknown = ask(app, [("GET", "/nowhere")])[0]          # not even a 404 tells a stranger what is here
    check_401("/nowhere", unknown)


def test_metrics_requires_the_key_only_with_metrics_require_key(tmp_path):
    assert ask(app_with(tmp_path), [("GET", "/metrics")])[0].status_code == 200
    guarded = app_with(tmp_path, metrics_require_key="true")
    check_401("/metrics", ask(guarded, [("GET", "/metrics")])[0])
    assert ask(guarded, [("GET", "/metrics")], {"Authorization": f"Bearer {KEYS[1]}"})[0].status_code == 200


# ---- a real server with keys, and the real clients --------------------------------------------------------

@pytest.fixture(scope="module")
def keyed_server(model_dir, tmp_path_factory):
    """Keys from the environment (LMI_API_KEY, as a secret would come), not from the properties; tgi_compat, as
    TGI's client needs for its chat stream (no [DONE])."""
    batch_dir = tmp_path_factory.mktemp("keyed-batches")
    server = start_server(tmp_path_factory, "keyed", env={"LMI_API_KEY": ",".join(KEYS)}, batch_dir=str(batch_dir),
                          tgi_compat="true")
    yield server
    server.stop()


@pytest.mark.slow
def test_with_the_key_every_client_works_as_before_and_without_it_gets_401(keyed_server):
    url = keyed_server.url
    assert httpx.get(url + "/ping").status_code == 200 and httpx.get(url + "/health").status_code == 200
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}
    expected = httpx.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"},
                          timeout=300).json()["generated_text"]
    for path in ("/invocations", "/generate"):
        check_401(path, httpx.post(url + path, json=body, timeout=60))
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[1], timeout=300)
    answer = sdk.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
    assert answer.choices[0].text == expected
    assert [m.id for m in sdk.models.list()]
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", timeout=60).completions.create(
            model="m", prompt=PROMPT, max_tokens=8)
    assert refused.value.status_code == 401 and "API key" in refused.value.message
    tgi = run_tgi_client(url, PROMPT, 8, api_key=KEYS[0])
    assert tgi["generated_text"] == expected and "max_new_tokens" in tgi["bad_request"]


@pytest.mark.slow
def test_submit_batch_with_api_key_runs_a_job_on_a_keyed_server(keyed_server, tmp_path):
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": text}], "max_completion_tokens": 4}}
             for i, text in enumerate(["Say hi.", "Name a color."])]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch = create_batch(path)
    with pytest.raises(RuntimeError, match="401"):
        submit_batch(batch, tmp_path / "refused.jsonl", base_url=keyed_server.url + "/v1", api_key="sk-wrong")
    result = submit_batch(batch, tmp_path / "out.jsonl", base_url=keyed_server.url + "/v1", api_key=KEYS[0],
                          poll_s=0.2, timeout_s=300, progress=False)
    assert (result.status, result.completed, result.failed) == ("completed", 2, 0)
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in records) == ["q0", "q1"]


@pytest.mark.slow
def test_the_key_never_appears_in_the_servers_log_and_start_up_says_whether_the_server_is_open(
        keyed_server, rolling_server):
    wrong = "sk-wrong-c0ffee-5e11"
    for key in (KEYS[0], wrong):
        httpx.post(keyed_server.url + "/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1},
                   headers={"Authorization": f"Bearer {key}"}, timeout=120)
    httpx.get(keyed_server.url + "/v1/files", timeout=30)                   # no key at all
    log = keyed_server.log_path.read_text()
    assert "API key required (2 keys accepted)" in log and "401" in log
    for secret in (*KEYS, wrong, "sk-first", "41ab77d9"):
        assert secret not in log, secret
    assert "every route is open" in rolling_server.log_path.read_text()
