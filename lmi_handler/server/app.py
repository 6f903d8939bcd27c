"""The bundled HTTP front end (FastAPI): /ping, /invocations, /predictions/{model}, OpenAI routes.

Owns HTTP only: validation errors become 4xx before inference, accepted requests go to the
front-end loop (frontend.py) that drives handle(); formats are protocol/'s.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lmi_handler.batch.server import mount_batch_api
from lmi_handler.config import Settings
from lmi_handler.handler import get_state, handle
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.formatters import CONTENT_TYPES, error_body, stream_failure
from lmi_handler.protocol.invocations import ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_INVOCATIONS
from lmi_handler.protocol.openai import openai_error
from lmi_handler.server.metrics import CountRequests, Metrics
from lmi_handler.server.frontend import Chunk, ClientRequest, DynamicFrontEnd, FrontEnd, RollingFrontEnd

logger = logging.getLogger(__name__)


def make_front_end(properties: dict[str, str]) -> FrontEnd:
    settings = Settings.from_properties(properties)
    handler_props = {k: v for k, v in properties.items() if k not in ("batch_size", "max_batch_delay")}
    if settings.is_rolling:
        return RollingFrontEnd(handle, handler_props, settings.max_rolling_batch_size)
    return DynamicFrontEnd(handle, handler_props, settings.batch_size, settings.max_batch_delay)


def create_app(properties: dict[str, str]) -> FastAPI:
    """Build the app; the model loads in the front end's thread at startup (handle()'s init call)."""
    front_end = make_front_end(properties)
    batch_jobs = mount_batch_api(Settings.from_properties(properties), front_end, lambda: get_state().service)
    for name in PROTOCOL_LOGGERS:
        logger_ = logging.getLogger(name)
        if not any(isinstance(f, QuietValidation) for f in logger_.filters):
            logger_.addFilter(QuietValidation())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        front_end.start()
        await asyncio.get_running_loop().run_in_executor(None, front_end.ready.wait)
        if front_end.init_error is not None:
            raise RuntimeError(f"model initialization failed: {front_end.init_error}")
        await batch_jobs.start()
        yield
        await batch_jobs.stop()
        front_end.stop()

    app = FastAPI(title="lmi_handler", lifespan=lifespan)
    app.state.front_end = front_end
    metrics = Metrics(lambda: getattr(get_state().service, "engine", None), lambda: front_end)

    app.add_middleware(CountRequests, counter=metrics.requests)
    app.include_router(batch_jobs.router)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/ping")
    async def ping() -> JSONResponse:
        healthy = front_end.alive
        return JSONResponse({"status": "Healthy" if healthy else "Unhealthy"}, status_code=200 if healthy else 503)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        return await _serve(front_end, request, ROUTE_INVOCATIONS)

    @app.post("/predictions/{model_name}")
    async def predictions(model_name: str, request: Request) -> Response:
        served = get_state().service.model_name
        if model_name != served:  # DJL: an unknown model name is a 404
            return error_response(f"model {model_name!r} is not served here (this server serves {served!r})", 404)
        return await _serve(front_end, request, ROUTE_INVOCATIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(front_end, request, ROUTE_CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(front_end, request, ROUTE_COMPLETIONS)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        service = get_state().service
        return JSONResponse({"object": "list", "data": [{"id": service.model_name, "object": "model",
                                                         "owned_by": "lmi_handler"}]})

    return app


MAX_BODY_BYTES = 8 << 20  # 8 MiB: far past any prompt the context could hold
# One thread parses and tokenizes requests: a large body never stalls the event loop (and the
# streams it serves), and that thread keeps one tokenizer of its own (service.tokenizer is per thread).
_VALIDATION = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validate")


class QuietValidation(logging.Filter):
    """The HTTP pre-validation parses each request before the handler parses it again: warnings about
    a request (e.g. unknown parameters) are logged once, by the handler, not twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.threadName.startswith("validate")


PROTOCOL_LOGGERS = ("lmi_handler.protocol.params", "lmi_handler.protocol.invocations", "lmi_handler.protocol.openai")


def error_response(message: str, code: int, route: str = ROUTE_INVOCATIONS, field: str | None = None) -> Response:
    """Errors before inference: LMI's {"error", "code"}, or an OpenAI error object on OpenAI routes."""
    if route in (ROUTE_CHAT, ROUTE_COMPLETIONS):
        kind = "invalid_request_error" if code < 424 else "server_error"  # 424: the generation failed
        return JSONResponse(openai_error(message, code, param=field, error_type=kind), status_code=code)
    return Response(error_body(message, code), status_code=code, media_type="application/json")


def _validate(service, body: bytes, route: str, content_type: str | None):
    """Parse and tokenize (in the validation thread). Raises RequestValidationError."""
    parsed = service.parse(body, route=route, content_type=content_type)
    service.prepare(parsed)
    if parsed.is_openai and parsed.openai_model not in (None, service.model_name):
        raise RequestValidationError("model", f"The model `{parsed.openai_model}` does not exist (this server "
                                     f"serves `{service.model_name}`)", status_code=404)
    return parsed


async def _serve(front_end: FrontEnd, request: Request, route: str) -> Response:
    service = get_state().service
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        return error_response(f"request body is over {MAX_BODY_BYTES} bytes", 413, route, "body")
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        return error_response(f"request body is over {MAX_BODY_BYTES} bytes", 413, route, "body")
    try:  # validate before inference: a bad request never reaches the batch
        parsed = await asyncio.get_running_loop().run_in_executor(
            _VALIDATION, _validate, service, body, route, request.headers.get("content-type"))
    except RequestValidationError as exc:
        return error_response(str(exc), exc.status_code, route, exc.field)
    except Exception as exc:  # a bug, never the client's fault: still a JSON answer, and the server goes on
        logger.exception("request validation failed")
        return error_response(f"internal error while reading the request: {type(exc).__name__}", 500, route)
    stream = service.is_streaming(parsed)
    content_type = _content_type(service, parsed, stream)
    client = ClientRequest(body, asyncio.get_running_loop(), route=route,
                           content_type=request.headers.get("content-type", "application/json"), stream=stream)
    front_end.submit(client)
    first = await _next_chunk(request, client)
    if first is None:
        return Response(status_code=499)
    if first.code is not None:
        return error_response(first.error or "inference failed", first.code, route)
    if not stream:
        return await _collect(request, client, first, content_type, route)
    failure = partial(stream_failure, output_formatter=service.output_formatter(True, parsed.is_openai),
                      openai_route=parsed.is_openai)
    return StreamingResponse(_stream(client, first, failure), media_type=content_type)


def _content_type(service, parsed, stream: bool) -> str:
    if not stream:
        return "application/json"
    if not service.settings.is_rolling:  # LMI dynamic batch streams {"outputs": [...]} lines
        return CONTENT_TYPES["jsonlines"]
    return CONTENT_TYPES[service.output_formatter(True, parsed.is_openai)]


async def _next_chunk(request: Request, client: ClientRequest, poll_s: float = 1.0) -> Chunk | None:
    """The client's next chunk; None (and the request marked cancelled) once its connection is gone."""
    while True:
        try:
            return await asyncio.wait_for(client.chunks.get(), poll_s)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                client.cancelled = True
                return None


async def _collect(request: Request, client: ClientRequest, first: Chunk, content_type: str,
                   route: str) -> Response:
    parts = [first.data]
    chunk = first
    while not chunk.last:
        chunk = await _next_chunk(request, client)
        if chunk is None:
            return Response(status_code=499)  # nobody is listening any more
        if chunk.code is not None:
            return error_response(chunk.error or "inference failed", chunk.code, route)
        parts.append(chunk.data)
    return Response("".join(parts), media_type=content_type)


async def _stream(client: ClientRequest, first: Chunk, failure: Callable[[str, int], str]) -> AsyncIterator[str]:
    """Send each chunk as it comes; a failure after the 200 went out ends the stream with `failure`'s text."""
    chunk = first
    try:
        while True:
            if chunk.code is not None:
                yield failure(chunk.error or "inference failed", chunk.code)
                return
            if chunk.data:
                yield chunk.data
            if chunk.last:
                return
            chunk = await client.chunks.get()
    finally:
        client.cancelled = True
