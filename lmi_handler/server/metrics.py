"""Prometheus metrics of the bundled front end: /metrics (prometheus_client text format).

Owns what is exported and its names; the numbers come from the engine and the front end,
read at scrape time (plain int reads, no lock needed).
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class EngineCollector(Collector):
    """Gauges read from the live engine and front end at every scrape."""

    def __init__(self, get_engine: Callable, get_front_end: Callable):
        self.get_engine = get_engine
        self.get_front_end = get_front_end

    def collect(self) -> Iterator[GaugeMetricFamily]:
        engine, front_end = self.get_engine(), self.get_front_end()
        if engine is None:
            return
        scheduler, allocator = engine.scheduler, engine.allocator
        yield GaugeMetricFamily("lmi_requests_running", "Sequences in the running batch", len(scheduler.running))
        yield GaugeMetricFamily("lmi_requests_waiting", "Sequences waiting for admission (engine queue)",
                                len(scheduler.waiting))
        yield GaugeMetricFamily("lmi_front_end_pending", "Accepted HTTP requests not yet in the active batch",
                                front_end.pending.qsize())
        yield GaugeMetricFamily("lmi_kv_cache_blocks_used", "KV-cache blocks in use", allocator.num_used_blocks)
        yield GaugeMetricFamily("lmi_kv_cache_blocks_total", "KV-cache blocks in all", allocator.num_blocks)


class Metrics:
    """The registry behind /metrics: engine gauges plus request counts by route and status code."""

    def __init__(self, get_engine: Callable, get_front_end: Callable):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(get_engine, get_front_end))
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
            route = getattr(scope.get("route"), "path", "unmatched")  # the template, not the raw path
            if route != "/metrics":
                self.counter.labels(route, str(status["code"])).inc()
