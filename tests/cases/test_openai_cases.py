"""Request cases on the OpenAI routes: stream_options.include_usage (C23) and n > 1 choices (C25).
"""
from __future__ import annotations

import json
from collections import Counter

import httpx
import openai
import pytest

from tests.helpers import load_case

pytestmark = pytest.mark.slow


def sse_events(client, path: str, body: dict) -> list:
    """The `data:` payloads of a streamed answer, parsed (the last one is the string "[DONE]")."""
    events = []
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.strip():
                assert line.startswith("data: ")
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def check_usage_stream(client, path: str, body: dict, text_of) -> None:
    events = sse_events(client, path, body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    with_usage = [i for i, c in enumerate(chunks) if c.get("usage") is not None]
    assert with_usage == [len(chunks) - 1] and chunks[-1]["choices"] == []
    plain = client.post(path, json={**body, "stream": False, "stream_options": None}).json()
    usage = chunks[-1]["usage"]
    assert usage == plain["usage"] and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    with_choices = [c for c in chunks if c["choices"]]
    assert "".join(text_of(c["choices"][0]) for c in with_choices) == text_of(plain["choices"][0], final=True)
    reason = with_choices[-1]["choices"][0]["finish_reason"]
    assert reason == plain["choices"][0]["finish_reason"]
    if usage["completion_tokens"] == body["max_tokens"]:
        assert reason == "length"


def chat_text(choice: dict, final: bool = False) -> str:
    return choice["message"]["content"] if final else choice["delta"].get("content") or ""


def completion_text(choice: dict, final: bool = False) -> str:
    return choice["text"]


def test_c23_include_usage_sends_one_final_usage_chunk_with_empty_choices(client):
    body = load_case("C23")["request"]
    check_usage_stream(client, "/v1/chat/completions", body, chat_text)
    completion = {"prompt": "The sky is", "max_tokens": 8, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    check_usage_stream(client, "/v1/completions", completion, completion_text)


@pytest.mark.parametrize("options", [{"include_usage": False}, {}, None])
def test_c23_no_usage_chunk_unless_asked(client, options):
    body = {**load_case("C23")["request"], "stream_options": options}
    chunks = sse_events(client, "/v1/chat/completions", body)[:-1]
    assert all(c.get("usage") is None and c["choices"] for c in chunks)


def test_c23_stream_options_without_stream_is_a_400_naming_it(client):
    """The case allows a normal answer or a 400; ours is vLLM's 400 (protocol/openai.py), named in the body."""
    response = client.post("/v1/chat/completions", json={**load_case("C23")["request"], "stream": False})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options"


def test_c23_the_openai_client_sees_the_usage_chunk_last(rolling_server):
    sdk = openai.OpenAI(base_url=rolling_server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(sdk.chat.completions.create(model="model", **load_case("C23")["request"]))
    assert chunks[-1].usage is not None and chunks[-1].choices == []


def test_c25_n_out_of_range_is_400_naming_n(client):
    for n in (0, 1000):
        response = client.post("/v1/chat/completions", json={**load_case("C25")["request"], "n": n})
        assert response.status_code == 400 and "`n`" in response.json()["error"]["message"]


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
