"""The bundled HTTP front end (FastAPI): /ping, /invocations, /predictions/{model}, /models, OpenAI routes,
TGI's routes (server/tgi.py) and /metrics.

Owns HTTP only: each request is planned once (parse + tokenize, in the validation thread) and its
errors become 4xx before inference; the plan goes with the request to the front-end loop
(frontend.py) that drives handle(); shapes are protocol/'s.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FrameworkValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from lmi_handler.batch.server import mount_batch_api
from lmi_handler.config import Settings
from lmi_handler.handler import get_state, handle
from lmi_handler.protocol.encoder import encode, encode_bytes
from lmi_handler.protocol.errors import RequestValidationError, error_object
from lmi_handler.protocol.formatters import stream_failure
from lmi_handler.protocol.plan import ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_INVOCATIONS, RequestPlan
from lmi_handler.server.frontend import Chunk, ClientRequest, DynamicFrontEnd, FrontEnd, RollingFrontEnd
from lmi_handler.server.metrics import CountRequests, Metrics, RequestTracker
from lmi_handler.server.ops import RequestIds, add_cancel_route, request_timeout
from lmi_handler.server.tgi import add_tgi_routes

logger = logging.getLogger(__name__)


def make_front_end(properties: dict[str, str]) -> FrontEnd:
    settings = Settings.from_properties(properties)
    handler_props = {k: v for k, v in properties.items()
                     if k not in ("batch_size", "max_batch_delay", "job_queue_size")}
    if settings.is_rolling:
        front_end: FrontEnd = RollingFrontEnd(handle, handler_props, settings.max_rolling_batch_size,
                                              settings.job_queue_size)
    else:
        front_end = DynamicFrontEnd(handle, handler_props, settings.batch_size, settings.max_batch_delay,
                                    settings.job_queue_size)
    front_end.request_timeout_s = settings.request_timeout_s
    return front_end


def create_app(properties: dict[str, str]) -> FastAPI:
    """Build the app; the model loads in the front end's thread at startup (handle()'s init call)."""
    front_end = make_front_end(properties)
    batch_jobs = mount_batch_api(Settings.from_properties(properties), front_end, lambda: get_state().service)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        front_end.start()
        await asyncio.get_running_loop().run_in_executor(None, front_end.ready.wait)
        if front_end.init_error is not None:
            raise RuntimeError(f"model initialization failed: {front_end.init_error}")
        await batch_jobs.start()
        state = get_state()
        if state.settings.is_rolling:     # dynamic batch: gauges and HTTP counts only
            state.rolling.observers.append(metrics.tracker.on_step)
            app.state.tracker = metrics.tracker
        yield
        await batch_jobs.stop()
        front_end.stop()

    app = FastAPI(title="lmi_handler", lifespan=lifespan)
    app.state.front_end = front_end
    app.state.shutdown_grace_s = Settings.from_properties(properties).shutdown_grace_s
    app.state.tracker = None
    metrics = Metrics(lambda: getattr(get_state().service, "engine", None), lambda: front_end)
    app.state.metrics = metrics

    app.add_middleware(CountRequests, counter=metrics.requests)
    app.include_router(batch_jobs.router)
    app.add_middleware(RequestIds)
    add_cancel_route(app, front_end)
    _answer_framework_errors(app)

    async def serve(request: Request, route: str) -> Response:
        return await _serve(front_end, request, route, app.state.tracker)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/ping")
    async def ping() -> JSONResponse:
        """Unhealthy (503) while the engine loop is down, and while draining after SIGTERM (so a load
        balancer stops routing here while accepted requests finish); a full queue is not unhealthy."""
        if front_end.draining:
            return JSONResponse({"status": "Draining"}, status_code=503)
        healthy = front_end.alive
        return JSONResponse({"status": "Healthy" if healthy else "Unhealthy"}, status_code=200 if healthy else 503)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        return await serve(request, ROUTE_INVOCATIONS)

    @app.post("/predictions/{model_name}")
    async def predictions(model_name: str, request: Request) -> Response:
        served = get_state().service.served_names
        if model_name not in served:  # DJL: an unknown model name is a 404
            return error_response(f"model {model_name!r} is not served here (this server serves "
                                  f"{', '.join(map(repr, served))})", 404)
        return await serve(request, ROUTE_INVOCATIONS)

    @app.get("/models")
    async def djl_models() -> JSONResponse:
        """DJL's management listing: each served name, READY while the engine loop runs."""
        status = "READY" if front_end.alive else "UNHEALTHY"
        return JSONResponse({"models": [{"modelName": name, "modelUrl": str(get_state().settings.model_path),
                                         "status": status} for name in get_state().service.served_names]})

    add_tgi_routes(app, serve, lambda: get_state().service, lambda: front_end.alive and not front_end.draining)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ROUTE_CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, ROUTE_COMPLETIONS)

    models_created = int(time.time())      # OpenAI Model.created: unix seconds; here, when the app was built

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        names = get_state().service.served_names
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": models_created,
                                                         "owned_by": "lmi_handler"} for name in names]})

    return app


MAX_BODY_BYTES = 8 << 20  # 8 MiB: far past any prompt the context could hold
# One thread plans (parses and tokenizes) requests: a large body never stalls the event loop (and the
# streams it serves), and the Service's tokenizer is never used by two HTTP requests at once.
_VALIDATION = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validate")


def error_response(message: str, code: int, openai: bool = False, field: str | None = None) -> Response:
    """Errors before the answer began: LMI's {"error", "code"}, or an OpenAI error object on OpenAI routes."""
    body = encode_bytes(error_object(message, code, openai=openai, param=field))
    return Response(body, status_code=code, media_type="application/json")


def _answer_framework_errors(app: FastAPI) -> None:
    """404/405/422 raised by the framework itself (no such route, wrong method) in our error shapes:
    an OpenAI error object under /v1, LMI's {"error", "code"} elsewhere (TGI's clients read `error`)."""

    def openai_path(request: Request) -> bool:
        return request.url.path.startswith("/v1/")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} on this server"
        response = error_response(message, exc.status_code, openai_path(request))
        for key, value in (exc.headers or {}).items():       # 405 carries its Allow header
            response.headers[key] = value
        return response

    @app.exception_handler(FrameworkValidationError)
    async def validation_error(request: Request, exc: FrameworkValidationError) -> Response:
        return error_response(f"invalid request: {exc.errors()[:1]}", 422, openai_path(request))


def _failed(chunk: Chunk, plan: RequestPlan) -> Response:
    if chunk.error is None and chunk.data:  # the handler answered the item's own error body
        return Response(chunk.data, status_code=chunk.code, media_type="application/json")
    return error_response(chunk.error or "inference failed", chunk.code, plan.is_openai)


async def _serve(front_end: FrontEnd, request: Request, route: str, tracker: RequestTracker | None) -> Response:
    openai_route = route in (ROUTE_CHAT, ROUTE_COMPLETIONS)
    if not front_end.alive:   # fail fast: nothing would ever answer a request queued now
        return error_response("the engine is not running (see /ping)", 503, openai_route)
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        return error_response(f"request body is over {MAX_BODY_BYTES} bytes", 413, openai_route, "body")
    try:
        body = await request.body()
    except ClientDisconnect:      # gone before its body arrived: nothing to plan or count
        return Response(status_code=499)
    if len(body) > MAX_BODY_BYTES:
        return error_response(f"request body is over {MAX_BODY_BYTES} bytes", 413, openai_route, "body")
    if front_end.draining:
        return error_response("the server is shutting down and takes no new requests", 503, openai_route)
    if not front_end.reserve():  # refused at once, before any work (job_queue_size)
        return _queue_full(front_end, openai_route)
    try:
        client = await _plan(front_end, request, route, body, openai_route)
        if isinstance(client, Response):
            return client
        front_end.track(client)
        accepted = front_end.submit(client)
    finally:
        front_end.unreserve()
    if not accepted:              # the batch filled between reserve() and submit(): refused, and not live
        front_end.forget(client)
        return _queue_full(front_end, openai_route)
    if tracker is not None:       # counted once accepted: a 503 refusal is no finished request
        tracker.arrived(client.request_id, route)
    streaming, status = False, 499
    try:
        first = await _next_chunk(request, client)
        if first is None:
            return Response(status_code=499)
        if first.code is not None:
            status = first.code
            return _failed(first, client.plan)
        if not client.plan.stream:
            response = await _collect(request, client, first, client.plan)
            status = response.status_code
            return response
        streaming = True          # the stream reports its own end to the tracker
        return StreamingResponse(_stream(client, first, client.plan, front_end, tracker),
                                 media_type=client.plan.content_type)
    finally:
        if not streaming:
            client.cancelled = True   # an answer cut short (e.g. the task cancelled) stops its sequences
            front_end.forget(client)
            if tracker is not None:
                tracker.closed(client.request_id, status)


async def _plan(front_end: FrontEnd, request: Request, route: str, body: bytes,
                openai_route: bool) -> ClientRequest | Response:
    """The request's ClientRequest with its plan (parsed and tokenized once, off the event loop), or the
    4xx/5xx answer when the request is bad."""
    service = get_state().service
    try:
        timeout_s = request_timeout(request.headers, front_end.request_timeout_s)
    except RequestValidationError as exc:
        return error_response(str(exc), exc.status_code, openai_route, exc.field)
    content_type = request.headers.get("content-type", "application/json")
    public_id = request.state.request_id
    # the engine's id is the client's x-request-id, unless a live request holds it already
    engine_id = public_id if not front_end.is_live(public_id) else f"{public_id}-{uuid.uuid4().hex[:8]}"
    client = ClientRequest(body, asyncio.get_running_loop(), route=route, content_type=content_type,
                           request_id=engine_id, public_id=public_id, timeout_s=timeout_s)
    try:  # plan before inference: a bad request never reaches the batch
        client.plan = await asyncio.get_running_loop().run_in_executor(
            _VALIDATION, partial(service.plan, body, route=route, content_type=request.headers.get("content-type"),
                                 request_id=client.request_id))
    except RequestValidationError as exc:
        return error_response(str(exc), exc.status_code, openai_route, exc.field)
    except Exception as exc:  # a bug, never the client's fault: still a JSON answer, and the server goes on
        logger.exception("request validation failed")
        return error_response(f"internal error while reading the request: {type(exc).__name__}", 500, openai_route)
    return client


def _queue_full(front_end: FrontEnd, openai_route: bool) -> Response:
    response = error_response(f"the server is busy: {front_end.pending.capacity} requests are waiting already "
                              "(job_queue_size); retry later", 503, openai_route)
    response.headers["Retry-After"] = "1"
    return response


async def _next_chunk(request: Request, client: ClientRequest, poll_s: float = 0.5) -> Chunk | None:
    """The client's next chunk; None (and the request marked cancelled) once its connection is gone."""
    while True:
        try:
            return await asyncio.wait_for(client.chunks.get(), poll_s)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                client.cancelled = True
                return None


async def _collect(request: Request, client: ClientRequest, first: Chunk, plan: RequestPlan) -> Response:
    parts = [first.data]
    chunk = first
    while not chunk.last:
        chunk = await _next_chunk(request, client)
        if chunk is None:
            return Response(status_code=499)  # nobody is listening any more
        if chunk.code is not None:
            return _failed(chunk, plan)
        parts.append(chunk.data)
    return Response("".join(parts), media_type=plan.content_type)


async def _stream(client: ClientRequest, first: Chunk, plan: RequestPlan,
                  front_end: FrontEnd | None = None, tracker: RequestTracker | None = None) -> AsyncIterator[str]:
    """Send each chunk as it comes; a failure after the 200 went out ends the stream in the plan's format."""
    chunk, status = first, 499
    try:
        while True:
            if chunk.code is not None:
                status = chunk.code
                yield encode(stream_failure(chunk.error or "inference failed", chunk.code, plan), plan.wire)
                return
            if chunk.data:
                yield chunk.data
            if chunk.last:
                status = 200
                return
            chunk = await client.chunks.get()
    finally:
        client.cancelled = True
        if front_end is not None:
            front_end.forget(client)
        if tracker is not None:
            tracker.closed(client.request_id, status)
