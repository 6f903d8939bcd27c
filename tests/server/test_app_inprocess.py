"""The real app in this process, driven over httpx's ASGI transport: each request is tokenized exactly once,
deep JSON is a 400 at any depth, and TGI's /generate answers TGI's shape."""
from __future__ import annotations

import json
import threading

import pytest

from lmi_handler import handler
from tests.server.inprocess import InProcessServer

pytestmark = pytest.mark.slow


class CountingTokenizer:
    """The real tokenizer, counting the calls that turn text into token ids (and from which threads)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encodes = 0
        self.threads: set[str] = set()

    def _count(self) -> None:
        self.encodes += 1
        self.threads.add(threading.current_thread().name)

    def encode(self, *args, **kwargs):
        self._count()
        return self._tokenizer.encode(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self._count()
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        if kwargs.get("tokenize", True):
            self._count()
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def app_server(model_dir):
    saved = handler._STATE
    handler._STATE = handler.HandlerState()      # this module's own model, like a fresh worker
    server = InProcessServer()
    service = handler.get_state().service
    counters = (CountingTokenizer(service.tokenizer), CountingTokenizer(service.engine.tokenizer))
    service.tokenizer, service.engine.tokenizer = counters
    yield server, counters
    server.close()
    handler._STATE = saved


@pytest.mark.parametrize("path, body", [
    ("/invocations", {"inputs": "The sky is", "parameters": {"max_new_tokens": 3}}),
    ("/invocations", {"inputs": "The sky is", "stream": True, "parameters": {"max_new_tokens": 3}}),
    ("/invocations", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    ("/v1/completions", {"prompt": "The sky is", "max_tokens": 3}),
    ("/generate", {"inputs": "The sky is", "parameters": {"max_new_tokens": 3}}),
])
def test_each_request_is_tokenized_once_in_the_validation_thread(app_server, path, body):
    server, (service_tokenizer, engine_tokenizer) = app_server
    before = service_tokenizer.encodes + engine_tokenizer.encodes
    response = server.post(path, json=body)
    assert response.status_code == 200, response.text
    assert service_tokenizer.encodes + engine_tokenizer.encodes - before == 1
    assert service_tokenizer.threads == {"validate_0"}   # the handler never parses the bytes again


@pytest.mark.parametrize("depth", [900, 950, 990, 1000, 1100, 100_000])
def test_deep_json_under_an_ignored_key_is_a_400_at_every_depth(app_server, depth):
    server, _ = app_server
    body = '{"inputs": "Hi", "ignored": ' + "[" * depth + "]" * depth + "}"
    response = server.post("/invocations", content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert "body" in response.json()["error"]


def test_generate_answers_tgi_shape_with_details_and_seed(app_server):
    server, _ = app_server
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


def test_generate_refuses_chat_messages_with_a_400_naming_them(app_server):
    server, _ = app_server
    response = server.post("/generate", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 400 and "messages" in json.loads(response.text)["error"]
