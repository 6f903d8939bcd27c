"""Handed cases C23 (stream_options.include_usage) and C25 (n > 1 choices) on the OpenAI routes, as tests."""
from __future__ import annotations

import json

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


def test_c23_stream_options_without_stream_is_a_normal_answer_or_400(client):
    response = client.post("/v1/chat/completions", json={**load_case("C23")["request"], "stream": False})
    assert response.status_code in (200, 400)
    if response.status_code == 400:
        assert "stream_options" in response.text
    else:
        assert response.json()["usage"]["completion_tokens"] >= 1


def test_c23_the_openai_client_sees_the_usage_chunk_last(rolling_server):
    sdk = openai.OpenAI(base_url=rolling_server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(sdk.chat.completions.create(model="model", **load_case("C23")["request"]))
    assert chunks[-1].usage is not None and chunks[-1].choices == []


def test_c25_n_out_of_range_is_400_naming_n(client):
    for n in (0, 1000):
        response = client.post("/v1/chat/completions", json={**load_case("C25")["request"], "n": n})
        assert response.status_code == 400 and "`n`" in response.json()["error"]["message"]
