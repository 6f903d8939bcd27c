"""Handed cases C23 (stream_options.include_usage) and C25 (n > 1 choices) of ../shared/cases, as tests
against the running server, over raw HTTP (every event checked) and with the openai client."""
from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from tests.helpers import load_case

pytestmark = pytest.mark.slow


def sse(client: httpx.Client, route: str, body: dict) -> tuple[list[dict], list[str]]:
    """The chunks of a streamed OpenAI answer and its raw event texts (each must be `data: ...`)."""
    with client.stream("POST", route, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]], events


def test_c25_n_choices_are_distinct_seeded_indexed_and_finish_once_each(client):
    request = load_case("C25")["request"]
    whole = client.post("/v1/chat/completions", json=request).json()
    choices = whole["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    assert all(c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
               and c["finish_reason"] in ("stop", "length") for c in choices)
    contents = [c["message"]["content"] for c in choices]
    assert len(set(contents)) >= 2
    assert [c["message"]["content"] for c in client.post("/v1/chat/completions", json=request).json()["choices"]] \
        == contents
    single = client.post("/v1/chat/completions", json={**request, "n": 1}).json()
    assert whole["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    with_logprobs = client.post("/v1/chat/completions", json={**request, "logprobs": True}).json()
    assert with_logprobs["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"])
                                                              for c in with_logprobs["choices"])
    greedy = client.post("/v1/chat/completions", json={**request, "n": 2, "temperature": 0}).json()["choices"]
    assert greedy[0]["message"]["content"] == greedy[1]["message"]["content"]

    chunks, _ = sse(client, "/v1/chat/completions", {**request, "stream": True})
    texts: dict[int, str] = {}
    finished: dict[int, int] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            index = choice["index"]
            assert index in (0, 1, 2)
            content = choice["delta"].get("content") or ""
            assert not (index in finished and content), "content after the finish_reason of its choice"
            texts[index] = texts.get(index, "") + content
            if choice["finish_reason"] is not None:
                finished[index] = finished.get(index, 0) + 1
    assert finished == {0: 1, 1: 1, 2: 1}
    assert Counter(texts.values()) == Counter(contents)

    completion = client.post("/v1/completions", json={"prompt": "Once upon a time", "n": 2, "temperature": 1.0,
                                                      "seed": 3, "max_tokens": 8}).json()
    assert [c["index"] for c in completion["choices"]] == [0, 1]
    assert all(isinstance(c["text"], str) and c["finish_reason"] for c in completion["choices"])
    for n in (0, 1000):
        response = client.post("/v1/chat/completions", json={**request, "n": n})
        assert response.status_code == 400 and "`n`" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "n"
