"""Response formats chosen by configuration (LMI output_formatter, tgi_compat), on real servers."""
from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow

BODY = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6, "details": True}}


def sse_events(http: httpx.Client, body: dict) -> list[dict]:
    events = []
    with http.stream("POST", "/invocations", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
            else:
                assert line == "", f"unexpected SSE line {line!r}"
    return events


def test_tgi_compat_wraps_answers_in_a_list_and_streams_sse_by_default(tgi_server):
    with httpx.Client(base_url=tgi_server.url, timeout=300) as http:
        plain = http.post("/invocations", json=BODY).json()
        assert isinstance(plain, list) and len(plain) == 1
        answer = plain[0]
        assert answer["details"]["finish_reason"] == "length"
        assert all({"id", "text", "logprob", "special"} <= set(t) for t in answer["details"]["tokens"])
        events = sse_events(http, {**BODY, "stream": True})
        assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == answer["generated_text"]
        bad = http.post("/invocations", json={**BODY, "parameters": {"top_p": 2}})
        assert bad.status_code == 400 and "top_p" in bad.json()["error"]


def test_output_formatter_sse_streams_every_response_as_server_sent_events(sse_server):
    with httpx.Client(base_url=sse_server.url, timeout=300) as http:
        events = sse_events(http, BODY)  # no "stream": the server-wide formatter streams anyway
        assert len(events) == 6
        assert all("generated_text" not in e for e in events[:-1])
        assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"]
        assert events[-1]["details"]["generated_tokens"] == 6
