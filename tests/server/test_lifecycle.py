"""Server lifecycle on the real model: /metrics, and clients that go away mid-request."""
from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def gauge(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def wait_idle(client: httpx.Client, timeout_s: float = 60) -> float:
    """Seconds until no sequence runs or waits; fails after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if gauge(client, "lmi_requests_running") == 0 and gauge(client, "lmi_requests_waiting") == 0:
            return time.monotonic() - start
        time.sleep(0.25)
    raise AssertionError("the engine still holds sequences")


def test_metrics_export_engine_gauges_and_request_counts(client):
    assert client.post("/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
    text = client.get("/metrics").text
    assert gauge(client, "lmi_kv_cache_blocks_total") > 0
    assert 'lmi_http_requests_total{code="200",route="/invocations"}' in text


def test_a_streaming_client_that_disconnects_stops_its_generation(client):
    wait_idle(client)
    body = {"inputs": "Tell me a very long story.", "stream": True,
            "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    with client.stream("POST", "/invocations", json=body) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert gauge(client, "lmi_requests_running") == 1
    # 2000 tokens would take minutes on this CPU; the abandoned request must leave within seconds
    wait_idle(client, timeout_s=30)
    assert gauge(client, "lmi_kv_cache_blocks_used") == 0


def test_a_non_streaming_client_that_times_out_stops_its_generation(rolling_server, client):
    wait_idle(client)
    body = {"inputs": "Tell me a very long story.", "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.Client(base_url=rolling_server.url, timeout=3) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/invocations", json=body)
    wait_idle(client, timeout_s=30)
    assert client.get("/ping").status_code == 200
