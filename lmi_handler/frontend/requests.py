"""The requests the bundled front end holds: ClientRequest (its chunks, deadline and cancel), the bounded
waiting queue (job_queue_size).

Owns how a request ends early (deadlines: request_timeout_s / X-Request-Timeout; cancel by id; a client
gone) and in which order requests wait; the loops that drive handle() are loops.py's, HTTP is server/'s.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lmi_handler.protocol.dialects import ROUTE_INVOCATIONS
from lmi_handler.protocol.plan import RequestPlan

logger = logging.getLogger(__name__)

# A request the server ended before its answer was complete: the status of its JSON error when nothing
# was sent yet; a stream already under way ends with its error line (finish_reason "error") instead.
TIMEOUT_CODE = 504     # its deadline passed (option.request_timeout_s or the X-Request-Timeout header)
CANCELLED_CODE = 409   # POST /v1/requests/{id}/cancel
ENGINE_DEAD_CODE = 503  # the engine can no longer generate (engine/health.py): the process is about to restart


@dataclass
class Chunk:
    """One piece of a response: text to send, and whether it is the last.

    A failure carries a status `code` and either an `error` message (the app builds the body with
    errors.error_body) or, with `error` None, its whole body in `data` (a dynamic-batch item's error body,
    which the handler built with the same function: DJL's dynamic batch answers each item's body).
    """

    data: str
    last: bool
    code: int | None = None
    error: str | None = None
    param: str | None = None   # the request field a failure names (OpenAI's `param`), where there is one


@dataclass
class ClientRequest:
    """An accepted HTTP request waiting for (or inside) the active batch.

    `plan` is the RequestPlan the app built from `body` (under `request_id`); it travels to the handler
    beside the bytes (handler.Handover), so the request is not parsed again. Without one the handler parses
    `body`. `answer` is the whole answer's object once the handler has it (in-process callers such as the
    batch jobs read it instead of the JSON text the chunks carry); `internal` marks such a caller's request
    (FrontEnd.has_room lets live requests go first).
    """

    body: bytes
    loop: asyncio.AbstractEventLoop
    route: str = ROUTE_INVOCATIONS
    content_type: str = "application/json"
    plan: RequestPlan | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False           # nobody wants the answer any more: stop its sequences
    public_id: str = ""               # the x-request-id the client sees (cancel looks it up); "" = request_id
    timeout_s: float | None = None    # its deadline, seconds after `arrival`; None = none
    arrival: float = field(default_factory=time.monotonic)
    abort: tuple[int, str] | None = None   # (status, message) asked by a cancel, acted on by the loop thread
    ended: bool = False               # the loop sent its last chunk early (deadline, cancel)
    internal: bool = False            # sent by this process (a batch job's line), not by an HTTP client
    answer: Any = None                # the whole answer's object (handler.Handover.answered)

    def __post_init__(self) -> None:
        self.public_id = self.public_id or self.request_id

    @property
    def priority(self) -> int:
        """Its plan's `priority` (0 without a plan): lower leaves the waiting queue first."""
        return self.plan.priority if self.plan is not None else 0

    @property
    def stream(self) -> bool:
        """A streamed answer (dynamic batch sends a streaming request alone)."""
        return self.plan is not None and self.plan.stream

    def answered(self, body: Any) -> None:
        """Loop thread, before the last chunk is pushed: the whole answer as an object (not streamed)."""
        self.answer = body

    def push(self, chunk: Chunk) -> None:
        """Thread-safe: hand a chunk to the client's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.chunks.put_nowait, chunk)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def due(self, now: float) -> tuple[int, str] | None:
        """(status, message) when the request must end now (cancelled by id, or past its deadline)."""
        if self.abort is not None:
            return self.abort
        if self.timeout_s is not None and now - self.arrival >= self.timeout_s:
            return TIMEOUT_CODE, (f"request timed out: its deadline of {self.timeout_s:g} s passed "
                                  "(option.request_timeout_s / X-Request-Timeout)")
        return None

    def end_if_due(self, now: float) -> bool:
        """Loop thread: end the request now if it is due (its last chunk is the error).

        True when the request is over: ended now or before, or its client gone."""
        if self.ended or self.cancelled:
            return True
        reason = self.due(now)
        if reason is None:
            return False
        code, message = reason
        logger.info("request %s ended early (%d): %s", self.public_id, code, message)
        self.push(Chunk("", True, code, message))
        self.ended = self.cancelled = True
        return True


class WaitingQueue:
    """Accepted requests waiting for a batch slot, in arrival order within each priority (DJL's job queue).

    A request of a lower `priority` value goes ahead of every waiting request of a higher one (vLLM's
    priority order, option.scheduling_policy=priority; under fcfs every request is priority 0, refused
    otherwise by service.py, so the order is arrival alone). Bounded by `capacity` (job_queue_size): `put`
    refuses past it, so overload answers 503 at once instead of queueing without limit. Thread-safe;
    `qsize()` is what /metrics reads.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: deque[ClientRequest] = deque()
        self.cond = threading.Condition()

    def put(self, client: ClientRequest) -> bool:
        """Queue `client`; False (not queued) when the queue is full. Clients already gone make room."""
        with self.cond:
            if len(self.items) >= self.capacity:
                self.items = deque(c for c in self.items if not c.cancelled)
            if len(self.items) >= self.capacity:
                return False
            bisect.insort_right(self.items, client, key=_priority)     # behind its equals: arrival order
            self.cond.notify()
            return True

    def get(self, timeout: float | None) -> ClientRequest | None:
        """The first client (the oldest of the best priority), waiting up to `timeout` seconds (0/None: do not wait); None if none came."""
        with self.cond:
            if not self.items and timeout:
                self.cond.wait(timeout)
            return self.items.popleft() if self.items else None

    def get_before(self, priority: int) -> ClientRequest | None:
        """The first client if its priority value is below `priority` (it ranks before), else None; no wait."""
        with self.cond:
            return self.items.popleft() if self.items and self.items[0].priority < priority else None

    def end_due(self, now: float) -> None:
        """Drop the clients that are gone, and end (with their error) the ones due (deadline, cancel)."""
        with self.cond:
            if not any(c.cancelled or c.abort is not None or c.timeout_s is not None for c in self.items):
                return
            kept = deque()
            for client in self.items:
                if not client.end_if_due(now):
                    kept.append(client)
            self.items = kept

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def qsize(self) -> int:
        return len(self.items)

    def only_internal(self) -> bool:
        """No request of an HTTP client waits (batch jobs' lines may)."""
        with self.cond:
            return all(client.internal for client in self.items)




def _priority(client: ClientRequest) -> int:
    return client.priority
