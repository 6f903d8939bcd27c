"""Handed cases C23 (stream_options.include_usage) and C25 (n > 1 choices) of ../shared/cases, as tests
against the running server, over raw HTTP (every event checked) and with the openai client."""
from __future__ import annotations

import json
from collections import Counter

import httpx
import openai
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


def check_one_final_usage_chunk(chunks: list[dict], whole: dict) -> None:
    with_usage = [c for c in chunks if c.get("usage") is not None]
    assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage == whole["usage"] and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_c23_include_usage_sends_exactly_one_final_usage_chunk_only_when_asked(client, rolling_server):
    request = load_case("C23")["request"]
    chunks, _ = sse(client, "/v1/chat/completions", request)
    whole = client.post("/v1/chat/completions", json={**request, "stream": False}).json()   # stream_options kept
    check_one_final_usage_chunk(chunks, whole)
    with_choices = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices) == \
        whole["choices"][0]["message"]["content"]
    assert with_choices[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    if whole["usage"]["completion_tokens"] == request["max_tokens"]:
        assert whole["choices"][0]["finish_reason"] == "length"
    for options in ({"stream_options": {"include_usage": False}}, {"stream_options": {}}, {}):
        body = {k: v for k, v in request.items() if k != "stream_options"} | options
        unasked, _ = sse(client, "/v1/chat/completions", body)
        assert all(c.get("usage") is None and c["choices"] for c in unasked)
    completion = {"prompt": "The sky is", "max_tokens": 8, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    chunks, _ = sse(client, "/v1/completions", completion)
    check_one_final_usage_chunk(chunks, client.post("/v1/completions", json={**completion, "stream": False}).json())
    sdk = openai.OpenAI(base_url=rolling_server.url + "/v1", api_key="unused", max_retries=0)
    last = list(sdk.chat.completions.create(model="model", **request))[-1]
    assert last.usage is not None and last.choices == []


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
