"""The container front end's batching loops, in-process: they drive handle() exactly as DJL Serving does.

Owns the active batch, batch_NNN Input building and fanning each entry back to its client;
what the entries mean is handler.py's, HTTP is app.py's.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from lmi_handler.djl import OwnInput, OwnOutput, PairList, binary_decode
from lmi_handler.engine.sequence import random_seed
from lmi_handler.handler import CANCEL_PROPERTY, PLAN_KEY, ROUTE_PROPERTY
from lmi_handler.protocol.errors import GENERATION_ERROR_CODE
from lmi_handler.protocol.plan import RequestPlan

logger = logging.getLogger(__name__)


@dataclass
class Chunk:
    """One piece of a response: text to send, and whether it is the last.

    A failure carries a status `code` and either an `error` message (the app builds the body) or,
    with `error` None, its whole body in `data` (dynamic batch items answer their own error body).
    """

    data: str
    last: bool
    code: int | None = None
    error: str | None = None


@dataclass
class ClientRequest:
    """An accepted HTTP request waiting for (or inside) the active batch.

    `plan` is the RequestPlan the app built from `body` (under `request_id`); it travels to the handler
    beside the bytes, so the request is not parsed again. Without one the handler parses `body`.
    """

    body: bytes
    loop: asyncio.AbstractEventLoop
    route: str = "/invocations"
    content_type: str = "application/json"
    plan: RequestPlan | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False

    @property
    def stream(self) -> bool:
        """A streamed answer (dynamic batch sends a streaming request alone)."""
        return self.plan is not None and self.plan.stream

    def push(self, chunk: Chunk) -> None:
        """Thread-safe: hand a chunk to the client's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.chunks.put_nowait, chunk)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass


class FrontEnd:
    """A daemon thread that owns every handle() call; HTTP handlers only submit and read chunks."""

    def __init__(self, handle: Callable, properties: dict[str, str]):
        self.handle = handle
        self.properties = properties
        self.pending: queue.Queue[ClientRequest] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self.stopped = threading.Event()
        self.ready = threading.Event()
        self.init_error: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.pending.put(None)  # type: ignore[arg-type]  (wakes a blocked get)
        self.thread.join(timeout=10)

    def submit(self, request: ClientRequest) -> None:
        self.pending.put(request)

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and self.thread.is_alive() and self.init_error is None

    def _run(self) -> None:
        try:  # the initialization call: properties only, empty content (DESIGN §2)
            self.handle(OwnInput(self.properties))
        except BaseException as exc:  # noqa: BLE001 - reported by /ping and the server start
            logger.exception("model initialization failed")
            self.init_error = exc
            self.ready.set()
            return
        self.ready.set()
        while not self.stopped.is_set():
            self.loop_once()

    def loop_once(self) -> None:
        raise NotImplementedError


class RollingFrontEnd(FrontEnd):
    """DJL's rolling-batch loop: one handle() call per step with the whole active batch.

    Running requests come first in their order with empty data, new ones are appended with
    their body and a random seed; entries are read by position; items whose `last` is true
    leave the batch. A bad reply fails every request and the next call carries reset_rollingbatch.
    """

    def __init__(self, handle: Callable, properties: dict[str, str], max_batch_size: int):
        super().__init__(handle, properties)
        self.max_batch_size = max_batch_size
        self.active: list[ClientRequest] = []
        self.num_running = 0          # leading items of `active` the handler has already seen
        self.reset_next = False

    def loop_once(self) -> None:
        self._admit(block=not self.active)
        if not self.active:
            return
        call = self._build_input()
        try:
            output = self.handle(call)
            entries = self._read_entries(output)
        except Exception as exc:  # noqa: BLE001 - the loop must survive anything
            logger.exception("rolling batch step failed")
            self._fail_all(f"inference failed: {exc}")
            return
        self.active = [c for c, entry in zip(self.active, entries) if not self._deliver(c, entry)]
        self.num_running = len(self.active)

    def _admit(self, block: bool) -> None:
        """Append waiting clients (never past max_batch_size); clients already gone are dropped."""
        while len(self.active) < self.max_batch_size:
            try:
                client = self.pending.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            if client is None:
                return
            if not client.cancelled:
                self.active.append(client)
            block = False

    def _build_input(self) -> OwnInput:
        """Running items first with empty data, then the new ones with body, properties and seed."""
        properties = {"batch_size": str(len(self.active))}
        if self.reset_next:
            properties["reset_rollingbatch"] = "true"
            self.reset_next = False
            self.num_running = 0
        content = PairList()
        for index, client in enumerate(self.active):
            prefix = f"batch_{index:03d}."
            is_new = index >= self.num_running
            content.add(prefix + "data", client.body if is_new else b"")
            if client.cancelled and not is_new:
                properties[prefix + CANCEL_PROPERTY] = "true"
            if is_new:
                properties[prefix + "Content-Type"] = client.content_type
                properties[prefix + "requestId"] = client.request_id
                properties[prefix + ROUTE_PROPERTY] = client.route
                content.add(prefix + "seed", str(random_seed()).encode())
                _hand_over(content, prefix, client)
        return OwnInput(properties, content)

    def _read_entries(self, output: OwnOutput | None) -> list[dict[str, str]]:
        if output is None or output.code != 200:
            raise RuntimeError(f"handler answered code {getattr(output, 'code', None)}")
        if output.content.size() != len(self.active):
            raise RuntimeError(f"handler answered {output.content.size()} entries for {len(self.active)} requests")
        return [binary_decode(output.content.value_at(i)) for i in range(len(self.active))]

    @staticmethod
    def _deliver(client: ClientRequest, entry: dict[str, str]) -> bool:
        """Send one entry's data to its client; True when the request is done."""
        last = entry.get("last", "false").lower() == "true"
        if "code" in entry:
            client.push(Chunk(entry.get("data", ""), True, int(entry["code"]), entry.get("error", "")))
            return True
        if entry.get("data") or last:
            client.push(Chunk(entry.get("data", ""), last))
        return last

    def _fail_all(self, message: str) -> None:
        for client in self.active:
            client.push(Chunk("", True, GENERATION_ERROR_CODE, message))
        self.active = []
        self.reset_next = True


class DynamicFrontEnd(FrontEnd):
    """DJL's dynamic batcher: up to batch_size requests or max_batch_delay ms, one handle() call per batch."""

    def __init__(self, handle: Callable, properties: dict[str, str], batch_size: int, max_batch_delay_ms: int):
        super().__init__(handle, properties)
        self.batch_size = batch_size
        self.max_batch_delay_s = max_batch_delay_ms / 1000
        self.carry: ClientRequest | None = None   # a streaming client met while filling a batch

    def loop_once(self) -> None:
        batch = self._collect()
        if not batch:
            return
        try:
            output = self.handle(self._build_input(batch))
            streamed = getattr(output, "stream_content", None) is not None
            if output is None or output.code != 200 or (output.content.size() != len(batch) and not streamed):
                raise RuntimeError("handler answered a malformed batch")
        except Exception as exc:  # noqa: BLE001 - the loop must survive anything
            logger.exception("dynamic batch failed")
            for client in batch:
                client.push(Chunk("", True, GENERATION_ERROR_CODE, f"inference failed: {exc}"))
            return
        if getattr(output, "stream_content", None) is not None:
            self._pump(batch[0], output.stream_content[0])
            return
        for index, client in enumerate(batch):
            code = output.properties.get(f"batch_{index}_code")
            text = output.content.value_at(index).decode("utf-8")
            client.push(Chunk(text, True, int(code)) if code is not None else Chunk(text, True))

    def _collect(self) -> list[ClientRequest]:
        """Up to batch_size requests within max_batch_delay; a streaming request always goes alone."""
        first, self.carry = self.carry, None
        if first is None:
            try:
                first = self.pending.get(timeout=0.5)
            except queue.Empty:
                return []
        if first is None or first.cancelled:
            return []
        if first.stream:
            return [first]
        batch, deadline = [first], time.monotonic() + self.max_batch_delay_s
        while len(batch) < self.batch_size:
            remaining = deadline - time.monotonic()
            try:
                client = self.pending.get(timeout=max(remaining, 0)) if remaining > 0 else self.pending.get_nowait()
            except queue.Empty:
                break
            if client is None:
                break
            if client.stream:
                self.carry = client
                break
            batch.append(client)
        return [c for c in batch if not c.cancelled]

    @staticmethod
    def _pump(client: ClientRequest, pieces) -> None:
        """Send a streamed answer piece by piece; a client that went away closes the stream early."""
        try:
            for piece in pieces:
                if client.cancelled:
                    break
                client.push(Chunk(piece, False))
            client.push(Chunk("", True))
        except Exception as exc:  # noqa: BLE001 - the loop must survive anything
            logger.exception("dynamic stream failed")
            client.push(Chunk("", True, GENERATION_ERROR_CODE, f"inference failed: {exc}"))
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()

    @staticmethod
    def _build_input(batch: list[ClientRequest]) -> OwnInput:
        if len(batch) == 1:  # DESIGN §2: a batch of one arrives unbatched
            content = PairList([("data", batch[0].body)])
            _hand_over(content, "", batch[0])
            return OwnInput({"Content-Type": batch[0].content_type, "requestId": batch[0].request_id,
                             ROUTE_PROPERTY: batch[0].route}, content)
        properties = {"batch_size": str(len(batch))}
        content = PairList()
        for index, client in enumerate(batch):
            properties[f"batch_{index:03d}.Content-Type"] = client.content_type
            properties[f"batch_{index:03d}.requestId"] = client.request_id
            properties[f"batch_{index:03d}.{ROUTE_PROPERTY}"] = client.route
            content.add(f"batch_{index:03d}.data", client.body)
            _hand_over(content, f"batch_{index:03d}.", client)
        return OwnInput(properties, content)


def _hand_over(content: PairList, prefix: str, client: ClientRequest) -> None:
    """In-process only: the plan built from the client's bytes goes beside them (handler.PLAN_KEY)."""
    if client.plan is not None:
        content.add(prefix + PLAN_KEY, client.plan)
