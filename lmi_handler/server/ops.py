"""Operating the server: request ids on every response, per-request deadlines, cancel by id, SIGTERM drain,
and exiting once the engine is dead.

Owns the `x-request-id` and `X-Request-Timeout` headers, `POST /v1/requests/{id}/cancel`, the uvicorn
server that drains before it exits and the dead-engine exit (option.engine_dead_exit_s); the front end
(frontend/) does the ending, serving.py the answering.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import uuid
from typing import Callable

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from lmi_handler.config import ConfigError
from lmi_handler.frontend.loops import FrontEnd
from lmi_handler.frontend.requests import ENGINE_DEAD_CODE
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.encoder import encode_bytes
from lmi_handler.protocol.errors import RequestValidationError, error_body

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
TIMEOUT_HEADER = "x-request-timeout"
MAX_TIMEOUT_S = 7 * 24 * 3600.0
_VALID_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_of(headers) -> str:
    """The client's `x-request-id` when it is 1-128 characters of [A-Za-z0-9._:-], else a new uuid4 hex."""
    given = headers.get(REQUEST_ID_HEADER, "")
    return given if _VALID_ID.fullmatch(given) else uuid.uuid4().hex


class RequestIds:
    """Pure ASGI middleware: every HTTP response carries `x-request-id` (the client's, or one made here).

    The id is in `request.state.request_id` for the route; pure ASGI (not BaseHTTPMiddleware) so that
    request.is_disconnected() still sees the client go away.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        request_id = request_id_of(headers)
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (REQUEST_ID_HEADER.encode(), request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_timeout(headers, default_s: float | None) -> float | None:
    """Seconds the request may take: the `X-Request-Timeout` header (a number in (0, 604800]) when sent,
    else option.request_timeout_s (None = no deadline). Raises RequestValidationError for a bad header."""
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return default_s
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT_S:
        raise RequestValidationError("X-Request-Timeout", f"Invalid header `X-Request-Timeout`: must be a number "
                                     f"of seconds in (0, {MAX_TIMEOUT_S:g}], got {raw[:40]!r}")
    return value


def add_cancel_route(app: FastAPI) -> None:
    """`POST /v1/requests/{id}/cancel`: the live request(s) with that x-request-id end within one step.

    Answers 200 `{"id", "object": "request.cancel", "cancelled": true}`; 404 (OpenAI error object) for an id
    that is unknown or already finished. The cancelled request's own client gets its error (frontend/).
    """

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel_request(request_id: str) -> Response:
        if app.state.front_end.cancel(request_id):
            body = {"id": request_id, "object": "request.cancel", "cancelled": True}
            return Response(encode_bytes(body), media_type="application/json")
        message = f"no request {request_id!r} is in progress (unknown, or already finished)"
        return Response(encode_bytes(error_body(Dialect.OPENAI, message, 404, param="request_id")), status_code=404,
                        media_type="application/json")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM/SIGINT: new requests get 503 while the accepted ones finish
    (up to `grace_s` seconds), then uvicorn's own shutdown runs. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, front_end: FrontEnd, grace_s: float):
        super().__init__(config)
        self.front_end = front_end
        self.grace_s = grace_s

    def handle_exit(self, sig, frame) -> None:
        if self.front_end.draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        logger.info("signal %s: draining %d accepted requests (grace %g s)", sig, self.front_end.num_live,
                    self.grace_s)
        self.front_end.draining = True
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while self.front_end.num_live and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.front_end.num_live:
            logger.warning("grace period over: exiting with %d requests unfinished", self.front_end.num_live)
        else:
            logger.info("all accepted requests finished: exiting")
        self.should_exit = True


def serve(app: FastAPI, host: str, port: int, log_level: str) -> None:
    """Run `app` under uvicorn with the SIGTERM drain (app.state.front_end, option.shutdown_grace_s)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    logging.getLogger("uvicorn.error").addFilter(_no_refusal_traceback)
    DrainingServer(config, app.state.front_end, app.state.settings.shutdown_grace_s).run()


def _no_refusal_traceback(record: logging.LogRecord) -> bool:
    """Drop the traceback uvicorn logs when start-up ends on a refused setting (the app's lifespan raises the
    ConfigError; starlette hands uvicorn its formatted traceback): the front end has logged the refusal and
    cli.py prints it as one line. Other start-up failures keep theirs."""
    message = record.getMessage()
    last = message.rsplit("\nTraceback (most recent call last):", 1)[-1]      # the error raised, not its causes
    return not (message.startswith("Traceback") and re.search(_CONFIG_ERROR_LINE, last, re.M))


# the last line of a ConfigError's traceback, by the class's own module (config/ moved it once: named, not typed)
_CONFIG_ERROR_LINE = rf"^{re.escape(f'{ConfigError.__module__}.{ConfigError.__qualname__}')}: "


# The process's exit status once the engine is dead: non-zero, so the container's supervisor restarts it, and
# distinct from a crash (1) and a bad command line (2) in the supervisor's logs.
ENGINE_DEAD_EXIT_CODE = 3


def exit_when_dead(front_end: FrontEnd, exit_s: float, poll_s: float = 0.2,
                   exit_process: Callable[[int], None] = os._exit) -> threading.Thread:
    """Watch `front_end` from a daemon thread: once it fails while not stopped (the engine dead, its loop
    thread gone), end every in-flight HTTP request with a 503 naming the failure (a stream with its error
    line: the loop thread may be stuck inside the step that found it, e.g. a collective waiting on a
    tensor-parallel rank that died), wait `exit_s` seconds (the answers go out, /ping says 503), then end the
    process with ENGINE_DEAD_EXIT_CODE (os._exit: a dead CUDA context can hang a normal shutdown). vLLM shuts
    its server down the same way when its engine dies."""

    def watch() -> None:
        while not front_end.stopped.wait(poll_s):
            failure = front_end.failure
            if front_end.ready.is_set() and failure is not None:
                logger.critical("exiting in %g s with status %d so the supervisor restarts this server: %s",
                                exit_s, ENGINE_DEAD_EXIT_CODE, failure)
                front_end.end_live(ENGINE_DEAD_CODE, failure)
                time.sleep(exit_s)
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
                exit_process(ENGINE_DEAD_EXIT_CODE)
                return

    thread = threading.Thread(target=watch, name="engine-dead-exit", daemon=True)
    thread.start()
    return thread
