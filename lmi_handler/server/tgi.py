"""TGI's native routes on the bundled app: POST /generate, /generate_stream and / (TGI's compat route),
GET /info and /health, as text-generation-inference serves them, and TGI's body of POST /tokenize.

Owns these routes and TGI's /info document. The TGI dialect is the worked example of docs/architecture.md's
"Adding an output dialect": its kinds and rules are plan.py's (Kind.TGI_*), its formatters formatters/tgi.py's
(TgiDocument, TgiStream) with their rows in formatters/answers.py, its error shape errors.py's (Dialect.TGI); serving
a request is serving.py's.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from lmi_handler.frontend.loops import DRAINING_MESSAGE
from lmi_handler.protocol import tokens
from lmi_handler.protocol.dialects import ROUTE_GENERATE, ROUTE_GENERATE_STREAM, ROUTE_TGI, Dialect
from lmi_handler.protocol.params import MAX_STOP_SEQUENCES
from lmi_handler.server.serving import add_generation_routes, answer_in_thread
from lmi_handler.service import Service


def add_tgi_routes(app: FastAPI) -> None:
    """Mount TGI's routes on `app` (its state: the front end, the service). POST / is TGI's compat route:
    /generate_stream when the body says stream=true, else [/generate's answer] (the plan's Kind.TGI_COMPAT)."""
    state = app.state
    add_generation_routes(app, ROUTE_TGI, ROUTE_GENERATE, ROUTE_GENERATE_STREAM)

    @app.get("/health")
    async def health() -> Response:
        """TGI: 200 with an empty body when the model answers; else 503 with TGI's {"error", "error_type":
        "healthcheck"} body (the error says why: the engine dead, the loop down, or draining)."""
        front_end = state.front_end
        if front_end.alive and not front_end.draining:
            return Response(status_code=200)
        reason = front_end.failure or DRAINING_MESSAGE
        return JSONResponse({"error": reason, "error_type": "healthcheck"}, status_code=503)

    @app.get("/info")
    async def info() -> JSONResponse:
        return JSONResponse(info_document(state.service))


async def tokenize(service: Service, body: bytes) -> Response:
    """TGI's POST /tokenize ({"inputs", "parameters"?}): one {id, text, start, stop} per token, start and stop
    character offsets into `inputs`; errors in TGI's shape. Mounted by tokens.py, which owns the path (vLLM's
    body is answered there)."""
    def answer(data: bytes) -> list[dict]:
        text = tokens.parse_tgi_tokenize(data)
        return tokens.tgi_tokens(text, *service.encode(text, "inputs"))

    return await answer_in_thread(body, Dialect.TGI, answer)


def info_document(service: Service) -> dict:
    """TGI's Info object, filled from this server's settings (fields TGI has and we do not are null)."""
    settings, engine = service.settings, service.engine
    try:
        ours = version("lmi_handler")
    except PackageNotFoundError:
        ours = None
    return {"model_id": service.model_name, "model_sha": None, "model_dtype": str(engine.runner.dtype),
            "model_device_type": engine.device.type, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": settings.max_rolling_batch_size, "max_best_of": settings.max_rolling_batch_size,
            "max_stop_sequences": MAX_STOP_SEQUENCES, "max_input_tokens": engine.max_model_len - 1,
            "max_input_length": engine.max_model_len - 1, "max_total_tokens": engine.max_model_len,
            "max_batch_total_tokens": settings.max_rolling_batch_prefill_tokens,
            "max_batch_size": settings.max_rolling_batch_size, "waiting_served_ratio": None,
            "max_waiting_tokens": None, "validation_workers": 1, "max_client_batch_size": 1,
            "router": "lmi_handler", "version": ours, "sha": None, "docker_label": None}
