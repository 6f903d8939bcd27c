"""The container front end's batching loops, in-process: they drive handle() exactly as DJL Serving does.

Owns the active batch, batch_NNN Input building and fanning each entry back to its client, and the
places a request may take (reserve, has_room); the requests themselves (queue, deadlines, cancel) are
requests.py's, what the entries mean is handler.py's, HTTP is server/'s.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from lmi_handler.config import ConfigError, Settings
from lmi_handler.djl import OwnInput, OwnOutput, PairList, binary_decode
from lmi_handler.engine.health import EngineDead
from lmi_handler.engine.sequence import random_seed
from lmi_handler.frontend.requests import CANCELLED_CODE, ENGINE_DEAD_CODE, Chunk, ClientRequest, WaitingQueue
from lmi_handler.handler import CANCEL_PROPERTY, HANDOVER_KEY, ROUTE_PROPERTY, Handover
from lmi_handler.protocol.errors import GENERATION_ERROR_CODE

logger = logging.getLogger(__name__)

# The front end's own keys: they never reach the handler's properties (DJL reads them itself).
FRONT_END_KEYS = ("batch_size", "max_batch_delay", "job_queue_size")
# Why a draining front end (FrontEnd.draining: SIGTERM) refuses a request, and why TGI's /health is 503 then.
DRAINING_MESSAGE = "the server is shutting down and takes no new requests"


def make_front_end(handle: Callable, settings: Settings, properties: dict[str, str],
                   engine_failure: Callable[[], BaseException | None] | None = None) -> "FrontEnd":
    """The loop `settings` ask for (rolling unless option.rolling_batch=disable), calling `handle` with
    `properties` (less the front end's own keys) on its first call, as DJL does. `engine_failure` (the
    Handler's failure()) names the error that ended the engine for good, for `alive`."""
    handler_props = {k: v for k, v in properties.items() if k not in FRONT_END_KEYS}
    if settings.is_rolling:
        front_end: FrontEnd = RollingFrontEnd(handle, handler_props, settings.max_rolling_batch_size,
                                              settings.job_queue_size)
    else:
        front_end = DynamicFrontEnd(handle, handler_props, settings.batch_size, settings.max_batch_delay,
                                    settings.job_queue_size)
    front_end.request_timeout_s = settings.request_timeout_s
    if engine_failure is not None:
        front_end.engine_failure = engine_failure
    return front_end


class FrontEnd:
    """A daemon thread that owns every handle() call; HTTP handlers only submit and read chunks."""

    def __init__(self, handle: Callable, properties: dict[str, str], job_queue_size: int = 1000):
        self.handle = handle
        self.properties = properties
        self.pending = WaitingQueue(job_queue_size)
        self.thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self.stopped = threading.Event()
        self.ready = threading.Event()
        self.init_error: BaseException | None = None
        self.engine_dead: EngineDead | None = None     # set once handle() raised EngineDead; never cleared
        self.request_timeout_s: float | None = None   # option.request_timeout_s (the app sets each deadline)
        # the error that ended the engine for good (a tensor-parallel rank failed: engine/health.EngineFatal)
        self.engine_failure: Callable[[], BaseException | None] = lambda: None
        self.draining = False            # SIGTERM: new requests are refused, accepted ones finish
        self.live: dict[str, list[ClientRequest]] = {}   # public id -> its HTTP requests still answering
        self.live_lock = threading.Lock()
        self.admitting = 0               # requests between reserve() and unreserve() (being planned)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.pending.wake()
        self.thread.join(timeout=10)

    def submit(self, request: ClientRequest) -> bool:
        """Queue an accepted request; False when the waiting queue is full (the app answers 503).

        A refused request is forgotten at once: the queue can fill between reserve() and submit(), and a
        request left in the live table would stay there for good (its body and plan held, SIGTERM's drain
        waiting on it for the whole grace; found by issue 15's storm)."""
        if self.pending.put(request):
            return True
        self.forget(request)
        return False

    @property
    def max_batch_size(self) -> int:
        """Most requests one handle() call holds (max_rolling_batch_size, or the dynamic batch_size)."""
        raise NotImplementedError

    @property
    def num_active(self) -> int:
        """Requests in the active batch between calls (0 for the dynamic batcher, which holds none)."""
        return 0

    @property
    def free_slots(self) -> int:
        """Places in the batch a new request could take without waiting (0 for the dynamic batcher)."""
        return 0

    def has_room(self, reserve: int) -> bool:
        """Room for one more internal request (a batch job's line) without delaying live ones: no HTTP
        client's request waits, and the active batch plus the waiting queue leave `reserve` places free.
        A racy read (the loop thread moves requests meanwhile): a hint for the batch jobs' pacing. Never
        while the front end cannot answer (a dead engine): the jobs wait, and resume after the restart."""
        return self.failure is None and self.pending.only_internal() and self.num_active + self.pending.qsize() <= self.max_batch_size - reserve

    def reserve(self) -> bool:
        """Event loop: hold a place for a request about to be planned; False (refuse it) when the places
        left (free batch slots + room in the waiting queue) are all held. `submit` then `unreserve` follow.

        Counting requests still being planned is what makes overload refusals immediate: past the bound
        a request answers 503 before any parsing, instead of queueing behind the others' planning.
        """
        with self.live_lock:
            if self.admitting + self.pending.qsize() >= self.pending.capacity + self.free_slots:
                return False
            self.admitting += 1
            return True

    def unreserve(self) -> None:
        with self.live_lock:
            self.admitting -= 1

    def track(self, client: ClientRequest) -> None:
        """The app starts answering `client` (cancel finds it by public id; draining waits for it)."""
        with self.live_lock:
            self.live.setdefault(client.public_id, []).append(client)

    def forget(self, client: ClientRequest) -> None:
        """The app has finished answering `client` (or gave up on it)."""
        with self.live_lock:
            clients = self.live.get(client.public_id, [])
            if client in clients:
                clients.remove(client)
            if not clients:
                self.live.pop(client.public_id, None)

    def is_live(self, public_id: str) -> bool:
        with self.live_lock:
            return public_id in self.live

    @property
    def num_live(self) -> int:
        with self.live_lock:
            return sum(len(clients) for clients in self.live.values())

    def end_live(self, code: int, message: str) -> int:
        """Any thread: end every live HTTP request that has not ended yet with its last chunk, the error
        (`code`, `message`); returns how many it ended. For the engine-dead exit (server/ops.exit_when_dead),
        which must answer them even while the loop thread is stuck inside a step (a collective waiting on a
        tensor-parallel rank that died); the loop drops whatever that step still delivers (client.ended)."""
        with self.live_lock:
            clients = [client for group in self.live.values() for client in group]
        ended = 0
        for client in clients:
            if not client.ended:
                client.ended = client.cancelled = True
                client.push(Chunk("", True, code, message))
                ended += 1
        return ended

    def cancel(self, public_id: str) -> bool:
        """End the live requests with this id (waiting or running) within one step; False if none is live."""
        with self.live_lock:
            clients = list(self.live.get(public_id, []))
        for client in clients:
            if client.abort is None:
                client.abort = (CANCELLED_CODE, f"request {public_id} was cancelled "
                                                "(POST /v1/requests/{id}/cancel)")
        self.pending.wake()
        return bool(clients)

    @property
    def failure(self) -> str | None:
        """Why this front end can no longer answer requests (the model failed to load, the engine is dead, the
        loop thread is gone), None while it can. Draining is not a failure."""
        if self.init_error is not None:
            return f"model initialization failed: {self.init_error}"
        if self.engine_dead is not None:
            return str(self.engine_dead)
        if (failed := self.engine_failure()) is not None:     # found between steps (a tensor-parallel rank gone)
            return f"the engine cannot go on: {failed}"
        if self.ready.is_set() and not self.thread.is_alive():
            return "the engine loop has stopped"
        return None

    @property
    def alive(self) -> bool:
        """Loaded, and able to answer (/ping's 200): see `failure`."""
        return self.ready.is_set() and self.failure is None

    def _engine_died(self, dead: EngineDead, clients: list[ClientRequest]) -> None:
        """The handler raised EngineDead: every request in `clients` (those of the call), and every one still
        waiting or queued later, ends with a 503 naming the reason (a stream with its error line)."""
        if self.engine_dead is None:
            logger.critical("the engine is dead: failing every request from now on (%s)", dead.reason)
        self.engine_dead = dead
        for client in clients:
            if not client.ended:          # else its error went out already (end_live, a deadline, a cancel)
                client.ended = True
                client.push(Chunk("", True, ENGINE_DEAD_CODE, str(dead)))

    def _refuse_waiting(self) -> None:
        """After the engine died: answer whatever reaches the queue (the race past alive's check) with 503."""
        client = self.pending.get(timeout=0.5)
        if client is not None:
            client.push(Chunk("", True, ENGINE_DEAD_CODE, str(self.engine_dead)))

    def _run(self) -> None:
        try:  # the initialization call: properties only, empty content (DESIGN §2)
            self.handle(OwnInput(self.properties))
        except BaseException as exc:  # reported by /ping and the server start
            if isinstance(exc, ConfigError):    # a setting refused: its message says it all (no traceback)
                logger.error("model initialization refused: %s", exc)
            else:
                logger.exception("model initialization failed")
            self.init_error = exc
            self.ready.set()
            return
        self.ready.set()
        while not self.stopped.is_set():
            if self.engine_dead is None:
                self.loop_once()
            else:
                self._refuse_waiting()

    def loop_once(self) -> None:
        raise NotImplementedError


class RollingFrontEnd(FrontEnd):
    """DJL's rolling-batch loop: one handle() call per step with the whole active batch.

    Running requests come first in their order with empty data, new ones are appended with
    their body and a random seed; entries are read by position; items whose `last` is true
    leave the batch. A bad reply fails every request and the next call carries reset_rollingbatch.
    """

    def __init__(self, handle: Callable, properties: dict[str, str], max_batch_size: int,
                 job_queue_size: int = 1000):
        super().__init__(handle, properties, job_queue_size)
        self.batch_limit = max_batch_size
        self.active: list[ClientRequest] = []
        self.num_running = 0          # leading items of `active` the handler has already seen
        self.reset_next = False

    @property
    def max_batch_size(self) -> int:
        return self.batch_limit

    @property
    def num_active(self) -> int:
        return len(self.active)

    @property
    def free_slots(self) -> int:
        return max(self.max_batch_size - len(self.active), 0)   # a racy read: a hint for reserve() only

    def loop_once(self) -> None:
        now = time.monotonic()
        self.pending.end_due(now)
        for client in self.active:   # their sequences stop in this very call (CANCEL_PROPERTY)
            client.end_if_due(now)
        self._admit(block=not self.active)
        if not self.active:
            return
        call = self._build_input()
        try:
            output = self.handle(call)
            entries = self._read_entries(output)
        except EngineDead as dead:
            self._engine_died(dead, self.active)
            self.active = []
            return
        except Exception as exc:  # the loop must survive anything
            logger.exception("rolling batch step failed")
            self._fail_all(f"inference failed: {exc}")
            return
        self.active = [c for c, entry in zip(self.active, entries) if not self._deliver(c, entry)]
        self.num_running = len(self.active)

    def _admit(self, block: bool) -> None:
        """Append waiting clients (up to max_batch_size, then those overtaking); clients already gone or due
        are dropped."""
        while len(self.active) < self.max_batch_size:
            client = self.pending.get(timeout=0.5 if block else None)
            if client is None:
                break
            if not client.end_if_due(time.monotonic()):
                self.active.append(client)
            block = False
        self._admit_overtaking()

    def _admit_overtaking(self) -> None:
        """Request priority: a waiting client of a better priority than an active one joins the full batch
        anyway (up to max_batch_size more), rather than wait for a place: the engine, whose max_num_seqs it
        does not raise, preempts the worst-ranked running request for it (recomputed later, its tokens
        unchanged; engine/scheduler.py). Under fcfs every priority is 0 and nothing overtakes."""
        while self.active and len(self.active) < 2 * self.max_batch_size:
            client = self.pending.get_before(max(c.priority for c in self.active))
            if client is None:
                return
            if not client.end_if_due(time.monotonic()):
                self.active.append(client)

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
            raise RuntimeError(f"handler answered code {None if output is None else output.code}")
        if output.content.size() != len(self.active):
            raise RuntimeError(f"handler answered {output.content.size()} entries for {len(self.active)} requests")
        return [binary_decode(output.content.value_at(i)) for i in range(len(self.active))]

    @staticmethod
    def _deliver(client: ClientRequest, entry: dict[str, str]) -> bool:
        """Send one entry's data to its client; True when the request is done."""
        last = entry.get("last", "false").lower() == "true"
        if client.ended:  # its last chunk went out already (deadline, cancel): drop the rest
            return last or "code" in entry
        if "code" in entry:
            client.push(Chunk(entry.get("data", ""), True, int(entry["code"]), entry.get("error", ""),
                              entry.get("param")))
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

    def __init__(self, handle: Callable, properties: dict[str, str], batch_size: int, max_batch_delay_ms: int,
                 job_queue_size: int = 1000):
        super().__init__(handle, properties, job_queue_size)
        self.batch_size = batch_size
        self.max_batch_delay_s = max_batch_delay_ms / 1000
        self.carry: ClientRequest | None = None   # a streaming client met while filling a batch

    @property
    def max_batch_size(self) -> int:
        return self.batch_size

    def loop_once(self) -> None:
        batch = self._collect()
        if not batch:
            return
        try:
            output = self.handle(self._build_input(batch))
            streamed = output is not None and output.stream_content is not None
            if output is None or output.code != 200 or (output.content.size() != len(batch) and not streamed):
                raise RuntimeError("handler answered a malformed batch")
        except EngineDead as dead:
            self._engine_died(dead, batch)
            return
        except Exception as exc:  # the loop must survive anything
            logger.exception("dynamic batch failed")
            for client in batch:
                client.push(Chunk("", True, GENERATION_ERROR_CODE, f"inference failed: {exc}"))
            return
        if streamed:
            self._pump(batch[0], output.stream_content[0])
            return
        for index, client in enumerate(batch):
            code = output.properties.get(f"batch_{index}_code")
            text = output.content.value_at(index).decode("utf-8")
            client.push(Chunk(text, True, int(code)) if code is not None else Chunk(text, True))

    def _collect(self) -> list[ClientRequest]:
        """Up to batch_size requests within max_batch_delay; a streaming request always goes alone."""
        self.pending.end_due(time.monotonic())
        first, self.carry = self.carry, None
        if first is None:
            first = self.pending.get(timeout=0.5)
        if first is None or first.end_if_due(time.monotonic()):
            return []
        if first.stream:
            return [first]
        batch, deadline = [first], time.monotonic() + self.max_batch_delay_s
        while len(batch) < self.batch_size:
            remaining = deadline - time.monotonic()
            client = self.pending.get(timeout=remaining if remaining > 0 else None)
            if client is None:
                break
            if client.stream:
                self.carry = client
                break
            batch.append(client)
        now = time.monotonic()
        return [c for c in batch if not c.end_if_due(now)]

    def _pump(self, client: ClientRequest, pieces) -> None:
        """Send a streamed answer piece by piece; a client that went away closes the stream early."""
        try:
            for piece in pieces:
                if client.end_if_due(time.monotonic()):
                    return
                client.push(Chunk(piece, False))
            client.push(Chunk("", True))
        except EngineDead as dead:
            self._engine_died(dead, [client])
        except Exception as exc:  # the loop must survive anything
            logger.exception("dynamic stream failed")
            client.push(Chunk("", True, GENERATION_ERROR_CODE, f"inference failed: {exc}"))
        finally:
            pieces.close()      # a generator (handler.DynamicBatch): its sequences stop with it

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
    """In-process only: the plan built from the client's bytes goes beside them, with where its whole
    answer goes (handler.Handover)."""
    if client.plan is not None:
        content.add(prefix + HANDOVER_KEY, Handover(client.plan, client.answered))
