"""Serving one HTTP request on a generation route: refuse early, plan once, hand it to the front end, answer.

Owns a request's life on the HTTP side: the 4xx/5xx refusals before inference (size, draining, a full
queue, a bad body), planning in the one validation thread, collecting or streaming the chunks, and
error bodies in the request's dialect (errors.error_body). The routes are app.py's, tgi.py's, openai.py's
and responses.py's; the loops that run requests are frontend/'s.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FrameworkValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from lmi_handler.frontend.loops import DRAINING_MESSAGE, FrontEnd
from lmi_handler.frontend.requests import Chunk, ClientRequest
from lmi_handler.protocol.dialects import Dialect, dialect_of
from lmi_handler.protocol.encoder import encode, encode_bytes
from lmi_handler.protocol.errors import RequestValidationError, error_body
from lmi_handler.protocol.formatters import stream_failure
from lmi_handler.protocol.plan import RequestPlan
from lmi_handler.server.metrics import RequestTracker
from lmi_handler.server.ops import request_timeout
from lmi_handler.service import ADAPTER_HEADER, Service

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # 8 MiB: far past any prompt the context could hold
# One thread plans (parses and tokenizes) requests: a large body never stalls the event loop (and the
# streams it serves), and the Service's tokenizer is never used by two HTTP requests at once.
_VALIDATION = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validate")


def error_response(dialect: Dialect, message: str, code: int, field: str | None = None) -> Response:
    """An error answered before the answer began, in the request's dialect (errors.error_body)."""
    body = encode_bytes(error_body(dialect, message, code, param=field))
    return Response(body, status_code=code, media_type="application/json")


async def answer_in_thread(body: bytes, dialect: Dialect, answer_of: Callable[[bytes], Any]) -> Response:
    """A route that needs no engine (the token routes): `answer_of(body)`'s object as JSON, computed off the
    event loop (a long text never stalls the streams), or the 4xx it raised in `dialect`'s error shape."""
    if len(body) > MAX_BODY_BYTES:
        return error_response(dialect, f"request body is over {MAX_BODY_BYTES} bytes", 413, "body")
    try:
        answer = await asyncio.get_running_loop().run_in_executor(None, answer_of, body)
    except RequestValidationError as exc:
        return error_response(dialect, str(exc), exc.status_code, exc.field)
    return Response(encode_bytes(answer), media_type="application/json")


def answer_framework_errors(app: FastAPI) -> None:
    """404/405/422 raised by the framework itself (no such route, wrong method) in the error shape of the
    path's dialect: an OpenAI error object under /v1, LMI's {"error", "code"} elsewhere."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} on this server"
        response = error_response(dialect_of(request.url.path), message, exc.status_code)
        for key, value in (exc.headers or {}).items():       # 405 carries its Allow header
            response.headers[key] = value
        return response

    @app.exception_handler(FrameworkValidationError)
    async def validation_error(request: Request, exc: FrameworkValidationError) -> Response:
        return error_response(dialect_of(request.url.path), f"invalid request: {exc.errors()[:1]}", 422)


def add_generation_routes(app: FastAPI, *routes: str) -> None:
    """Mount `POST route` for each of `routes`, answered by serve(request, route) (what the plan is made for)."""
    for route in routes:
        app.add_api_route(route, _serving(route), methods=["POST"], name=f"generate:{route}")


def _serving(route: str):
    async def endpoint(request: Request) -> Response:
        return await serve(request, route)
    return endpoint


async def serve(request: Request, route: str, **plan_options: Any) -> Response:
    """Answer a generation route (`route`: the path the plan is made for) with the app's front end and
    service (app.state); every refusal before inference is a 4xx/5xx in the route's dialect. `plan_options`
    go to Service.plan (/v1/responses: its responses_store)."""
    state = request.app.state
    front_end, tracker, dialect = state.front_end, state.tracker, dialect_of(route)
    refusal = await _refusal(front_end, request, dialect)
    if isinstance(refusal, Response):
        return refusal
    body = refusal
    if not front_end.reserve():  # refused at once, before any work (job_queue_size)
        return _queue_full(front_end, dialect)
    try:
        client = await _plan(front_end, state.service, request, route, body, plan_options)
        if isinstance(client, Response):
            return client
        front_end.track(client)
        accepted = front_end.submit(client)
    finally:
        front_end.unreserve()
    if not accepted:
        return _queue_full(front_end, dialect)
    if tracker is not None:       # counted once accepted: a 503 refusal is no finished request
        tracker.arrived(client.request_id, route)
    return await _answer(request, client, front_end, tracker)


async def _refusal(front_end: FrontEnd, request: Request, dialect: Dialect) -> bytes | Response:
    """The request's body, or the answer refusing it before any parsing (engine down, too large, draining)."""
    if not front_end.alive:   # fail fast: nothing would ever answer a request queued now
        return error_response(dialect, f"the engine is not running (see /ping): {front_end.failure}", 503)
    too_large = error_response(dialect, f"request body is over {MAX_BODY_BYTES} bytes", 413, "body")
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        return too_large
    try:
        body = await request.body()
    except ClientDisconnect:      # gone before its body arrived: nothing to plan or count
        return Response(status_code=499)
    if len(body) > MAX_BODY_BYTES:
        return too_large
    if front_end.draining:
        return error_response(dialect, DRAINING_MESSAGE, 503)
    return body


async def _answer(request: Request, client: ClientRequest, front_end: FrontEnd,
                  tracker: RequestTracker | None) -> Response:
    """The accepted request's answer: its first chunk decides between an error, a whole body and a stream."""
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


async def _plan(front_end: FrontEnd, service: Service, request: Request, route: str,
                body: bytes, plan_options: dict[str, Any]) -> ClientRequest | Response:
    """The request's ClientRequest with its plan (parsed and tokenized once, off the event loop), or the
    4xx/5xx answer when the request is bad."""
    dialect = dialect_of(route)
    try:
        timeout_s = request_timeout(request.headers, front_end.request_timeout_s)
    except RequestValidationError as exc:
        return error_response(dialect, str(exc), exc.status_code, exc.field)
    content_type = request.headers.get("content-type", "application/json")
    public_id = request.state.request_id
    # the engine's id is the client's x-request-id, unless a live request holds it already
    engine_id = public_id if not front_end.is_live(public_id) else f"{public_id}-{uuid.uuid4().hex[:8]}"
    client = ClientRequest(body, asyncio.get_running_loop(), route=route, content_type=content_type,
                           request_id=engine_id, public_id=public_id, timeout_s=timeout_s)
    try:  # plan before inference: a bad request never reaches the batch
        client.plan = await asyncio.get_running_loop().run_in_executor(
            _VALIDATION, partial(service.plan, body, route=route, content_type=content_type,
                                 request_id=client.request_id, adapter_header=request.headers.get(ADAPTER_HEADER),
                                 **plan_options))
    except RequestValidationError as exc:
        return error_response(dialect, str(exc), exc.status_code, exc.field)
    except Exception as exc:  # a bug, never the client's fault: still a JSON answer, and the server goes on
        logger.exception("request validation failed")
        return error_response(dialect, f"internal error while reading the request: {type(exc).__name__}", 500)
    return client


def _queue_full(front_end: FrontEnd, dialect: Dialect) -> Response:
    response = error_response(dialect, f"the server is busy: {front_end.pending.capacity} requests are waiting "
                              "already (job_queue_size); retry later", 503)
    response.headers["Retry-After"] = "1"
    return response


def _failed(chunk: Chunk, plan: RequestPlan) -> Response:
    if chunk.error is None and chunk.data:  # the handler answered the item's own error body
        return Response(chunk.data, status_code=chunk.code, media_type="application/json")
    return error_response(plan.dialect, chunk.error or "inference failed", chunk.code, chunk.param)


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
