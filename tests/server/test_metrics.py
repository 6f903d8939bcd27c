"""server/metrics.py: gauges read from the live engine and front end at each scrape, requests counted once by
route and status (fast, hand-made), then a real server's metrics against its answers.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest

from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig
from lmi_handler.engine.sequence import SamplingParams, Sequence
from lmi_handler.engine.speculative import SpecDecodeStats
from lmi_handler.frontend.loops import RollingFrontEnd
from lmi_handler.frontend.requests import ClientRequest
from lmi_handler.server.metrics import CountRequests, Metrics
from tests.helpers import SMALL_KV_CACHE_BYTES
from tests.server.helpers import fresh_server, metric


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels or None)


def test_gauges_are_read_from_the_live_engine_and_front_end_at_each_scrape():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), allocator)
    engine = SimpleNamespace(scheduler=scheduler, allocator=allocator)
    front_end = RollingFrontEnd(lambda inputs: None, {}, max_batch_size=4)      # a real one, not started
    loop = asyncio.new_event_loop()
    for index in range(3):
        client = ClientRequest(b"{}", loop, request_id=f"r{index}", public_id=f"r{index}")
        front_end.track(client)
        front_end.submit(client)
    metrics = Metrics(lambda: engine, lambda: front_end)
    assert sample(metrics, "lmi_requests_waiting") == 0
    scheduler.add(Sequence("a", [1, 2, 3], SamplingParams()))
    assert sample(metrics, "lmi_requests_waiting") == 1
    assert sample(metrics, "lmi_front_end_queue_depth") == 3 and sample(metrics, "lmi_front_end_live_requests") == 3
    allocator.allocate(2)
    assert sample(metrics, "lmi_kv_cache_blocks_used") == 2 and sample(metrics, "lmi_kv_cache_blocks_total") == 8
    assert sample(metrics, "lmi_kv_cache_usage_ratio") == 0.25
    assert sample(metrics, "lmi_front_end_active") == 0
    loop.close()


def test_speculative_decodings_counters_are_read_from_the_engines_speculator():
    stats = SpecDecodeStats(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=5, accepted_per_pos=[3, 2, 0])
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    engine = SimpleNamespace(scheduler=Scheduler(SchedulerConfig(4, 64), allocator), allocator=allocator,
                             adapters=None, speculator=SimpleNamespace(stats=stats))
    metrics = Metrics(lambda: engine, lambda: RollingFrontEnd(lambda inputs: None, {}, max_batch_size=4))
    assert sample(metrics, "lmi_spec_decode_num_drafts_total") == 3
    assert sample(metrics, "lmi_spec_decode_num_draft_tokens_total") == 9
    assert sample(metrics, "lmi_spec_decode_num_accepted_tokens_total") == 5
    assert sample(metrics, "lmi_spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
    stats.num_accepted_tokens += 2
    assert sample(metrics, "lmi_spec_decode_num_accepted_tokens_total") == 7


def test_no_engine_yet_exports_no_gauges():
    metrics = Metrics(lambda: None, lambda: None)
    assert b"lmi_requests_running" not in generate_latest(metrics.registry)


def test_requests_are_counted_by_route_template_and_status_and_metrics_scrapes_are_not():
    metrics = Metrics(lambda: None, lambda: None)
    app = FastAPI()
    app.add_middleware(CountRequests, counter=metrics.requests)

    @app.post("/predictions/{model_name}")
    async def predictions(model_name: str) -> JSONResponse:
        return JSONResponse({}, status_code=200 if model_name == "m" else 404)

    @app.get("/metrics")
    async def scrape() -> JSONResponse:
        return JSONResponse({})

    async def drive() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            for path in ("/predictions/m", "/predictions/m", "/predictions/x"):
                await http.post(path)
            await http.get("/metrics")
            await http.get("/nowhere")

    asyncio.run(drive())
    assert sample(metrics, "lmi_http_requests_total", route="/predictions/{model_name}", code="200") == 2
    assert sample(metrics, "lmi_http_requests_total", route="/predictions/{model_name}", code="404") == 1
    assert sample(metrics, "lmi_http_requests_total", route="unmatched", code="404") == 1
    assert sample(metrics, "lmi_http_requests_total", route="/metrics", code="200") is None


def _request(rid: str, done: bool = False, cancelled: bool = False, error: str | None = None):
    from lmi_handler.protocol.plan import Prompt

    plan = SimpleNamespace(prompts=(Prompt(rid, "p", (1, 2, 3), SamplingParams()),))
    return SimpleNamespace(request_id=rid, plan=plan, members=[SimpleNamespace(request_id=rid)], done=done,
                           cancelled=cancelled, error=error)


def _out(rid: str, num_tokens: int, finished: bool = False):
    from lmi_handler.engine.sequence import FinishReason, TokenOutput

    tokens = [TokenOutput(i, "x", -0.1, False) for i in range(num_tokens)]
    return SimpleNamespace(request_id=rid, new_tokens=tokens, finished=finished,
                           finish_reason=FinishReason.LENGTH if finished else None)


def test_each_request_is_counted_once_whichever_side_sees_its_end_first():
    metrics = Metrics(lambda: None, lambda: None)
    tracker = metrics.tracker
    for rid in ("done", "gone", "queued"):
        tracker.arrived(rid, "/invocations")
    tracker.on_step([_request("done"), _request("gone")], {"done": _out("done", 1), "gone": _out("gone", 1)})
    tracker.on_step([_request("done", done=True), _request("gone")],
                    {"done": _out("done", 2, finished=True), "gone": _out("gone", 1)})
    tracker.closed("done", 200)                 # the handler counted it already
    tracker.closed("gone", 499)                 # the client left first: "abort" now ...
    tracker.on_step([_request("gone", done=True, cancelled=True)], {})   # ... and not again when the step sees it
    tracker.closed("queued", 499)               # left while queued: the handler never saw it
    assert sample(metrics, "lmi_requests_finished_total", finish_reason="length") == 1
    assert sample(metrics, "lmi_requests_finished_total", finish_reason="abort") == 2
    assert sample(metrics, "lmi_e2e_request_latency_seconds_count") == 3
    assert sample(metrics, "lmi_generation_tokens_total") == 5 and sample(metrics, "lmi_prompt_tokens_total") == 6
    assert sample(metrics, "lmi_time_to_first_token_seconds_count") == 2
    assert sample(metrics, "lmi_time_per_output_token_seconds_count") == 3      # tokens after each first one
    # only the one the handler may still report is remembered (bounded: metrics._MAX_REMEMBERED)
    assert not tracker._timings and list(tracker._finished) == ["queued"]




@pytest.mark.slow
def test_metrics_export_engine_gauges_and_request_counts(client):
    assert client.post("/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
    text = client.get("/metrics").text
    assert metric(client, "lmi_kv_cache_blocks_total") > 0
    assert 'lmi_http_requests_total{code="200",route="/invocations"}' in text


PARAMS = {"max_new_tokens": 4, "do_sample": False}


def app_sample(app, name: str, **labels: str) -> float:
    """A sample of the in-process app's registry (0 when absent)."""
    value = app.app.state.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


@pytest.mark.slow
def test_metrics_agree_with_the_answers_and_gauges_return_to_zero(app):
    before = {name: app_sample(app, name) for name in ("lmi_prompt_tokens_total", "lmi_generation_tokens_total",
                                                    "lmi_e2e_request_latency_seconds_count",
                                                    "lmi_time_to_first_token_seconds_count")}
    finished_before = sum(app_sample(app, "lmi_requests_finished_total", finish_reason=r)
                          for r in ("length", "eos_token", "stop_sequence", "error", "abort"))
    bodies = [{"inputs": f"Count to {i}:", "parameters": {"max_new_tokens": 3 + i, "details": True,
                                                          "decoder_input_details": True}} for i in range(4)]
    answers = app.gather(*(app.client.post("/invocations", json=b) for b in bodies))
    docs = [a.json() for a in answers]
    assert app.post("/invocations", json={"inputs": "Hi", "parameters": {"top_p": 5}}).status_code == 400
    generated = sum(d["details"]["generated_tokens"] for d in docs)
    prompt = sum(len(d["details"]["prefill"]) for d in docs)
    assert app_sample(app, "lmi_generation_tokens_total") - before["lmi_generation_tokens_total"] == generated
    assert app_sample(app, "lmi_prompt_tokens_total") - before["lmi_prompt_tokens_total"] == prompt
    finished = sum(app_sample(app, "lmi_requests_finished_total", finish_reason=r)
                   for r in ("length", "eos_token", "stop_sequence", "error", "abort"))
    assert finished - finished_before == 4          # the 400 never reached the engine
    for name in ("lmi_e2e_request_latency_seconds_count", "lmi_time_to_first_token_seconds_count"):
        assert app_sample(app, name) - before[name] == 4
    assert app_sample(app, "lmi_time_per_output_token_seconds_count") >= generated - 4
    text = app.get("/metrics").text
    assert 'lmi_http_requests_total{code="400",route="/invocations"}' in text
    for gauge in ("lmi_requests_running", "lmi_requests_waiting", "lmi_front_end_queue_depth",
                  "lmi_front_end_live_requests", "lmi_kv_cache_blocks_used", "lmi_kv_cache_usage_ratio"):
        assert app_sample(app, gauge) == 0, gauge
    assert app_sample(app, "lmi_kv_cache_blocks_total") > 0


@pytest.mark.slow
def test_a_burst_past_the_queue_leaves_no_request_live_once_answered():
    """A request refused between reserve() and submit() (the batch filled meanwhile) once stayed in the front
    end's live table for good: its body and plan leaked, and draining waited for it (issue 15's soak)."""
    with fresh_server(max_rolling_batch_size="1", job_queue_size="1", num_threads="1",
                      kv_cache_bytes=str(SMALL_KV_CACHE_BYTES)) as server:
        body = {"inputs": "The sky is", "parameters": {"max_new_tokens": 2}}
        replies = server.gather(*(server.client.post("/invocations", json=body) for _ in range(24)))
        assert {r.status_code for r in replies} == {200, 503}
        assert server.app.state.front_end.num_live == 0
        assert app_sample(server, "lmi_front_end_live_requests") == 0
