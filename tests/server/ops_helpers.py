"""Helpers of the operating tests (limits, deadlines, cancel, faults): servers, metrics, concurrent clients."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from tests.helpers import REPO, ServerProcess


def start_server(tmp_path_factory, name: str, env: dict[str, str] | None = None, **options: str) -> ServerProcess:
    """A started `lmi-handler serve` (OPTION_* overrides, extra env); the caller stops it."""
    log_path = tmp_path_factory.mktemp("logs") / f"{name}.log"
    server = ServerProcess({"num_threads": "1", **options}, log_path, REPO / "serving.properties", env=env)
    return server.__enter__()


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def wait_until(check, timeout_s: float, poll_s: float = 0.1) -> float:
    """Seconds until check() is true; AssertionError after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return time.monotonic() - start
        time.sleep(poll_s)
    raise AssertionError(f"not true within {timeout_s} s")


def idle(client: httpx.Client, kv_used: float = 0) -> bool:
    return (metric(client, "lmi_requests_running") == 0 and metric(client, "lmi_requests_waiting") == 0
            and metric(client, "lmi_front_end_queue_depth") == 0 and metric(client, "lmi_kv_cache_blocks_used") == kv_used)


@dataclass
class Reply:
    """One response as a client saw it: status, seconds from sending to the status line and to the end."""

    status: int = 0
    headers: dict = field(default_factory=dict)
    head_s: float = 0.0
    total_s: float = 0.0
    body: bytes = b""
    lines: list[str] = field(default_factory=list)
    error: str | None = None

    def json(self):
        return json.loads(self.body)

    @property
    def events(self) -> list[dict]:
        """Parsed stream lines (jsonlines or `data:` SSE lines; [DONE] left out)."""
        out = []
        for line in self.lines:
            line = line[len("data:"):].strip() if line.startswith("data:") else line.strip()
            if line and line != "[DONE]":
                out.append(json.loads(line))
        return out


def send(url: str, path: str, body: dict, headers: dict | None = None, timeout_s: float = 300,
         stream: bool = False, http: httpx.Client | None = None) -> Reply:
    """POST and read the whole answer, timing the status line and the end (`http`: a client built
    beforehand, closed here; building one costs CPU, so it happens before the clock starts)."""
    reply = Reply()
    http = http or httpx.Client(base_url=url, timeout=timeout_s)
    start = time.monotonic()
    try:
        with http:
            with http.stream("POST", path, json=body, headers=headers or {}) as response:
                reply.status, reply.headers = response.status_code, dict(response.headers)
                reply.head_s = time.monotonic() - start
                if stream and response.status_code == 200:
                    reply.lines = [line for line in response.iter_lines() if line.strip()]
                else:
                    reply.body = response.read()
    except httpx.HTTPError as exc:
        reply.error = repr(exc)
    reply.total_s = time.monotonic() - start
    return reply


def send_all(url: str, calls: list[dict]) -> list[Reply]:
    """Send each call (send()'s keyword arguments: path, body, headers, stream) from its own thread,
    all released together; returns the replies in the calls' order."""
    replies: list[Reply | None] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int, call: dict, http: httpx.Client) -> None:
        barrier.wait()
        replies[i] = send(url, **call, http=http)

    clients = [httpx.Client(base_url=url, timeout=call.get("timeout_s", 300)) for call in calls]
    threads = [threading.Thread(target=run, args=(i, call, http)) for i, (call, http) in enumerate(zip(calls, clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return replies  # type: ignore[return-value]
