"""Small client helpers shared by the HTTP tests (real httpx requests, nothing mocked)."""
from __future__ import annotations

import json

import httpx


def invoke(client: httpx.Client, inputs, **parameters) -> httpx.Response:
    return client.post("/invocations", json={"inputs": inputs, "parameters": parameters})


def generated_text(client: httpx.Client, inputs, **parameters) -> str:
    response = invoke(client, inputs, **parameters)
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


def stream_lines(client: httpx.Client, body: dict) -> list[dict]:
    """POST with stream=true and parse the jsonlines body line by line as it arrives."""
    lines = []
    with client.stream("POST", "/invocations", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("application/jsonlines")
        for line in response.iter_lines():
            if line.strip():
                lines.append(json.loads(line))
    return lines


def streamed_text(lines: list[dict]) -> str:
    return "".join(line["token"]["text"] for line in lines)
