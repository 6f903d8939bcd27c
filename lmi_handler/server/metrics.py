"""Prometheus metrics of the bundled front end (/metrics) and the per-request log line.

Owns what is exported, its names (vLLM/TGI-dashboard style: the names carry `running`, `waiting`,
`kv_cache`, `prompt_tokens`, `generation_tokens`, `time_to_first_token`, `time_per_output_token`,
`e2e_request_latency`, and the finished-request counter a `finish_reason` label) and when each
request is timed. Gauges are read from the engine and front end at scrape time; counters and
histograms are fed by RequestTracker, which the handler calls once per rolling step with its
outputs (where tokens leave for the client), and by the HTTP side for arrivals and the requests
that end without the handler answering them (disconnected in the queue, a failed step).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lmi_handler.engine.sequence import FinishReason

logger = logging.getLogger("lmi_handler.requests")

# Finish reasons of the finished-request counter: the LMI ones, plus "abort" for a client that went away.
ABORT = "abort"
ERROR = "error"

_MAX_REMEMBERED = 100_000   # finished ids kept until the other side reports them (a few MB at most)

# Buckets in seconds, as vLLM's (CPU serving is slower, so the tails go further).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 40, 60, 120, 300, 600)


class EngineCollector(Collector):
    """Gauges read from the live engine and front end at every scrape (plain int reads, no lock)."""

    def __init__(self, get_engine: Callable, get_front_end: Callable):
        self.get_engine = get_engine
        self.get_front_end = get_front_end

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        engine, front_end = self.get_engine(), self.get_front_end()
        if engine is None:
            return
        scheduler, allocator = engine.scheduler, engine.allocator
        yield GaugeMetricFamily("lmi_requests_running", "Sequences in the running batch", len(scheduler.running))
        yield GaugeMetricFamily("lmi_requests_waiting", "Sequences waiting for admission (engine queue)",
                                len(scheduler.waiting))
        yield GaugeMetricFamily("lmi_front_end_queue_depth", "Accepted HTTP requests not yet in the active batch",
                                front_end.pending.qsize())
        yield GaugeMetricFamily("lmi_front_end_active", "Requests in the front end's active batch",
                                front_end.num_active)
        yield GaugeMetricFamily("lmi_front_end_live_requests", "Accepted HTTP requests still being answered "
                                "(waiting, running or streaming); 0 once idle", front_end.num_live)
        used, total = allocator.num_used_blocks, allocator.num_blocks
        yield GaugeMetricFamily("lmi_kv_cache_blocks_used", "KV-cache blocks in use", used)
        yield GaugeMetricFamily("lmi_kv_cache_blocks_total", "KV-cache blocks in all", total)
        yield GaugeMetricFamily("lmi_kv_cache_usage_ratio", "KV-cache blocks in use / in all (0-1)",
                                used / total if total else 0.0)
        yield from _prefix_cache(allocator.prefix_cache_stats)
        if engine.adapters is not None:
            yield from _adapters(engine.adapters)
        if engine.speculator is not None:
            yield from _spec_decode(engine.speculator.stats)


def _adapters(registry) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """LoRA adapters loaded now (of option.max_cpu_loras), and loads and evictions since start."""
    yield GaugeMetricFamily("lmi_lora_adapters_loaded", "LoRA adapters loaded", len(registry))
    yield GaugeMetricFamily("lmi_lora_adapters_max", "LoRA adapters kept loaded at most (option.max_cpu_loras)",
                            registry.limits.max_cpu_loras)
    yield CounterMetricFamily("lmi_lora_adapter_loads", "LoRA adapters loaded since start", registry.num_loads)
    yield CounterMetricFamily("lmi_lora_adapter_evictions", "LoRA adapters evicted (least recently used) since start",
                              registry.num_evictions)


def _spec_decode(stats) -> Iterator[CounterMetricFamily]:
    """vLLM's spec_decode counters (engine/speculative/speculator.py SpecDecodeStats): drafts verified, tokens
    drafted, tokens accepted, accepted tokens by draft position. Acceptance rate = accepted / draft tokens; mean
    accepted length = 1 + accepted / drafts."""
    yield CounterMetricFamily("lmi_spec_decode_num_drafts", "Rows that verified drafted tokens in a step",
                              stats.num_drafts)
    yield CounterMetricFamily("lmi_spec_decode_num_draft_tokens", "Tokens drafted and verified",
                              stats.num_draft_tokens)
    yield CounterMetricFamily("lmi_spec_decode_num_accepted_tokens", "Drafted tokens accepted (equal to the "
                              "target's own choice)", stats.num_accepted_tokens)
    per_pos = CounterMetricFamily("lmi_spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, by "
                                  "draft position (0 = the first drafted)", labels=["position"])
    for position, count in enumerate(stats.accepted_per_pos):
        per_pos.add_metric([str(position)], count)
    yield per_pos


def _prefix_cache(stats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """vLLM's prefix_cache_queries / _hits counters (tokens) and their ratio."""
    queried, hits = stats.num_queried_tokens, stats.num_hit_tokens
    yield CounterMetricFamily("lmi_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queried)
    yield CounterMetricFamily("lmi_prefix_cache_hits", "Prompt tokens found in the prefix cache", hits)
    yield GaugeMetricFamily("lmi_prefix_cache_hit_rate", "Prefix-cache hits / queries since start, in tokens (0-1)",
                            hits / queried if queried else 0.0)


@dataclass
class _Timing:
    """One request's clock, from its arrival (unix-independent time.monotonic seconds)."""

    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    last_token: dict[str, float] = field(default_factory=dict)   # per engine sequence (n / best_of members)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    route: str = ""


class RequestTracker:
    """Times and counts each request once, whichever side sees its end first.

    The handler calls `on_step(active, outputs)` after each rolling step (its ActiveRequests, already
    marked done/cancelled/error, and the step's RequestOutputs by sequence id); the HTTP side calls
    `arrived` when a planned request is submitted and `closed` when its answer is over. A request
    the handler finished is counted there (finish_reason from the engine, "abort" if cancelled,
    "error" if failed); one the handler never finished (disconnected in the queue, a failed step)
    is counted by `closed` as "abort" (status 499) or "error". Thread-safe.
    """

    def __init__(self, registry: CollectorRegistry):
        self._lock = threading.Lock()
        self._timings: dict[str, _Timing] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()   # counted; the other side's report is ignored
        self.prompt_tokens = Counter("lmi_prompt_tokens", "Prompt tokens of requests admitted", registry=registry)
        self.generation_tokens = Counter("lmi_generation_tokens", "Tokens generated and sent", registry=registry)
        self.ttft = Histogram("lmi_time_to_first_token_seconds", "Arrival to first generated token (TTFT)",
                              buckets=_TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("lmi_time_per_output_token_seconds", "Inter-token latency (ITL) per generated token "
                             "after the first", buckets=_ITL_BUCKETS, registry=registry)
        self.queue_time = Histogram("lmi_request_queue_time_seconds", "Arrival to the first engine step that "
                                    "holds the request", buckets=_TTFT_BUCKETS, registry=registry)
        self.e2e = Histogram("lmi_e2e_request_latency_seconds", "Arrival to the end of the answer",
                             buckets=_E2E_BUCKETS, registry=registry)
        self.finished = Counter("lmi_requests_finished", "Requests ended, by finish reason (abort: the client "
                                "went away or the request was cancelled)", ["finish_reason"], registry=registry)

    def arrived(self, request_id: str, route: str = "") -> None:
        with self._lock:
            self._timings.setdefault(request_id, _Timing(time.monotonic(), route=route))

    def on_step(self, active: list, outputs: dict) -> None:
        """One rolling step's ActiveRequests (handler.py) and RequestOutputs; never raises."""
        try:
            now = time.monotonic()
            with self._lock:
                for request in active:
                    self._observe(request, outputs, now)
        except Exception:  # metrics must never fail a step
            logger.exception("metrics: step not recorded")

    def _observe(self, request, outputs: dict, now: float) -> None:
        rid = request.request_id
        if rid in self._finished:                  # the HTTP side counted it (client gone, step failed)
            if request.done:
                self._finished.pop(rid, None)
            return
        timing = self._timings.setdefault(rid, _Timing(now))   # the DJL path has no HTTP arrival
        if timing.admitted is None:
            timing.admitted = now
            self.queue_time.observe(now - timing.arrival)
            if request.plan is not None:
                timing.num_prompt_tokens = len(request.plan.prompts[0].token_ids)
                self.prompt_tokens.inc(timing.num_prompt_tokens)
        for member in request.members:
            out = outputs.get(member.request_id)
            if out is not None and out.new_tokens:
                self._tokens(timing, member.request_id, len(out.new_tokens), now)
        if request.done:
            self._finish(rid, timing, _reason(request, outputs), now)

    def _tokens(self, timing: _Timing, sequence_id: str, count: int, now: float) -> None:
        self.generation_tokens.inc(count)
        timing.num_generated_tokens += count
        if timing.first_token is None:
            timing.first_token = now
            self.ttft.observe(now - timing.arrival)
        previous = timing.last_token.get(sequence_id)
        if previous is not None:
            for _ in range(count):          # several tokens in one step share its interval
                self.itl.observe((now - previous) / count)
        timing.last_token[sequence_id] = now

    def closed(self, request_id: str, status: int) -> None:
        """The HTTP answer is over (`status` 499: the client went away); counts the request as "abort"
        or "error" unless the handler already finished it."""
        with self._lock:
            if self._finished.pop(request_id, False) is not False:
                return
            timing = self._timings.get(request_id)
            if timing is not None:
                self._finish(request_id, timing, ABORT if status == 499 else ERROR, time.monotonic())

    def _finish(self, request_id: str, timing: _Timing, reason: str, now: float) -> None:
        self.finished.labels(reason).inc()
        self.e2e.observe(now - timing.arrival)
        self._timings.pop(request_id, None)
        self._finished[request_id] = None         # until the other side reports it too
        while len(self._finished) > _MAX_REMEMBERED:
            self._finished.popitem(last=False)
        logger.info(json.dumps({"event": "request_finished", "request_id": request_id, "route": timing.route,
                                "finish_reason": reason, "prompt_tokens": timing.num_prompt_tokens,
                                "generation_tokens": timing.num_generated_tokens,
                                "queue_s": _round(timing.admitted, timing.arrival),
                                "ttft_s": _round(timing.first_token, timing.arrival),
                                "e2e_s": _round(now, timing.arrival)}))


def _reason(request, outputs: dict) -> str:
    """The finish reason of a request the handler ended this step (best_of: its first sequence's)."""
    if request.cancelled:
        return ABORT
    if request.error is not None or request.plan is None:
        return ERROR
    for member in request.members:
        out = outputs.get(member.request_id)
        if out is not None and out.finished and out.finish_reason is not None:
            return FinishReason(out.finish_reason).value
    return ERROR


def _round(end: float | None, start: float) -> float | None:
    return None if end is None else round(end - start, 4)


class Metrics:
    """The registry behind /metrics: engine gauges, request timings and counts, HTTP answers by route/code."""

    def __init__(self, get_engine: Callable, get_front_end: Callable):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(get_engine, get_front_end))
        self.tracker = RequestTracker(self.registry)
        self.requests = Counter("lmi_http_requests", "HTTP requests answered", ["route", "code"],
                                registry=self.registry)


class CountRequests:
    """Pure ASGI middleware counting answered requests by route template and status code.

    Not a BaseHTTPMiddleware: that wrapper hides the client's disconnect from request.is_disconnected(),
    which the app needs to stop generating for clients that went away.
    """

    def __init__(self, app, counter: Counter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope["route"].path if scope.get("route") is not None else "unmatched"   # the template
            if route != "/metrics":
                self.counter.labels(route, str(status["code"])).inc()
