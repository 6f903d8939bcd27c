"""A bounded load test on loopback: 200 concurrent clients against one real server process (half streaming,
a tenth disconnecting early), 8 greedy tokens each: every other request completes with exactly its solo
answer (nothing mixed between requests), the KV blocks are all free afterwards and the metrics agree."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import serve

pytestmark = pytest.mark.slow

NUM_CLIENTS = 200
MAX_NEW_TOKENS = 8        # CI has 2 cores: short answers keep the whole run well under 2 minutes
PROMPTS = ["The sky is", "Water is", "Cats are", "Music is", "My favourite food is", "The river",
           "In the city", "Long ago", "Three colors:", "def add(a, b):"]
FINISH_REASONS = ("length", "eos_token", "stop_sequence", "error", "abort")


def body(prompt: str, stream: bool = False) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, "details": True},
            "stream": stream}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def finished_total(samples: dict) -> float:
    return sum(value(samples, "lmi_requests_finished_total", finish_reason=r) for r in FINISH_REASONS)


async def one_client(http: httpx.AsyncClient, index: int) -> tuple[str, str, int | None]:
    """Client `index`: ("done", text, generated_tokens) or ("left", "", None) for one that disconnects."""
    prompt, stream, leaves = PROMPTS[index % len(PROMPTS)], index % 2 == 0, index % 20 in (3, 8)
    if not stream:
        try:        # one that leaves gives up after 0.2 s: its connection is closed
            response = await asyncio.wait_for(http.post("/invocations", json=body(prompt)), 0.2 if leaves else None)
        except asyncio.TimeoutError:
            return "left", "", None
        assert response.status_code == 200, response.text
        doc = response.json()
        return "done", doc["generated_text"], doc["details"]["generated_tokens"]
    async with http.stream("POST", "/invocations", json=body(prompt, stream=True)) as response:
        assert response.status_code == 200
        lines = []
        async for line in response.aiter_lines():
            if line.strip():
                lines.append(json.loads(line))
                if leaves:
                    return "left", "", None           # leaves after the first token line
    final = lines[-1]
    assert "".join(line["token"]["text"] for line in lines) == final["generated_text"]
    return "done", final["generated_text"], final["details"]["generated_tokens"]


async def run_clients(url: str) -> list[tuple[str, str, int | None]]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        return await asyncio.gather(*(one_client(http, i) for i in range(NUM_CLIENTS)))


@pytest.fixture(scope="module")
def load_server(model_dir, tmp_path_factory):
    """One batch of up to 32; one PyTorch thread (2 CI cores: the HTTP side needs the other)."""
    yield from serve(tmp_path_factory, "load", max_rolling_batch_size="32", num_threads="1")


def test_200_concurrent_clients_get_their_solo_answers_and_leave_nothing_behind(load_server):
    url = load_server.url
    solo = {}
    for prompt in PROMPTS:      # each distinct prompt alone, once
        doc = httpx.post(url + "/invocations", json=body(prompt), timeout=300).json()
        solo[prompt] = (doc["generated_text"], doc["details"]["generated_tokens"])
    before = scrape(url)
    start = time.monotonic()
    results = asyncio.run(run_clients(url))
    elapsed = time.monotonic() - start
    assert elapsed < 120, f"200 clients took {elapsed:.1f} s"
    left = 0
    for index, (outcome, text, tokens) in enumerate(results):
        prompt = PROMPTS[index % len(PROMPTS)]
        if outcome == "left":
            left += 1
            continue
        assert (text, tokens) == solo[prompt], (index, prompt, text)     # nothing mixed in from a neighbour
    assert left == NUM_CLIENTS // 10

    deadline, after = time.monotonic() + 15, scrape(url)
    while time.monotonic() < deadline and (finished_total(after) - finished_total(before) < NUM_CLIENTS - left
                                           or value(after, "lmi_requests_running") > 0
                                           or value(after, "lmi_kv_cache_blocks_used") > 0):
        time.sleep(0.5)
        after = scrape(url)
    for gauge in ("lmi_requests_running", "lmi_requests_waiting", "lmi_front_end_queue_depth",
                  "lmi_kv_cache_blocks_used"):
        assert value(after, gauge) == 0, gauge
    # every request counted once, aborted ones included (one that left before its body was read never arrived)
    finished = finished_total(after) - finished_total(before)
    assert NUM_CLIENTS - left <= finished <= NUM_CLIENTS
    aborted = value(after, "lmi_requests_finished_total", finish_reason="abort") - \
        value(before, "lmi_requests_finished_total", finish_reason="abort")
    assert 0 <= aborted <= left and finished - aborted >= NUM_CLIENTS - left   # a leaver may have finished first
    assert value(after, "lmi_e2e_request_latency_seconds_count") - \
        value(before, "lmi_e2e_request_latency_seconds_count") == finished
    completed_tokens = sum(solo[PROMPTS[i % len(PROMPTS)]][1] for i, r in enumerate(results) if r[0] == "done")
    generated = value(after, "lmi_generation_tokens_total") - value(before, "lmi_generation_tokens_total")
    assert completed_tokens <= generated <= completed_tokens + left * MAX_NEW_TOKENS
    assert httpx.get(url + "/ping", timeout=30).status_code == 200
    logged = [json.loads(line[line.index("{"):]) for line in load_server.log_path.read_text().splitlines()
              if '"event": "request_finished"' in line]
    assert len({entry["request_id"] for entry in logged}) >= finished     # one structured line per request
