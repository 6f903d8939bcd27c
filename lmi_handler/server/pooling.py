"""The bundled app of a pooling model (option.task text-embedding, rerank, classification, or auto resolved to
one): OpenAI's /v1/embeddings, TEI's /embed, /rerank and /predict, vLLM's /pooling, /score, /rerank,
/v1/rerank, /v2/rerank and /classify, LMI's /invocations, beside /ping, /health and /v1/models.

Owns these routes and the pooling app's wiring (API keys, request ids, the framework's errors in each path's
dialect, the model loaded at start-up in a worker thread); what each route answers is pooling_answers.py's,
running it pooling_service.py's. Errors take the path's dialect (an OpenAI error object
under /v1/, LMI's {"error", "code"} elsewhere), a bad body a 400 naming the field.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmi_handler.config import Settings
from lmi_handler.pooling_answers import ROUTES, PoolingAnswers
from lmi_handler.pooling_service import PoolingService, QueueFull
from lmi_handler.protocol.dialects import dialect_of
from lmi_handler.protocol.encoder import encode_bytes
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.server.auth import RequireApiKey, log_access_rule, open_paths
from lmi_handler.server.ops import RequestIds
from lmi_handler.server.serving import answer_framework_errors, error_response


def create_pooling_app(settings: Settings) -> FastAPI:
    """The app of a pooling model; `app.state.pooling` is the loaded PoolingService once started."""
    app = FastAPI(title="lmi_handler", lifespan=_lifespan)
    app.state.settings, app.state.pooling = settings, None
    if settings.api_keys:
        app.add_middleware(RequireApiKey, keys=settings.api_keys, open_paths=open_paths(settings.metrics_require_key))
    app.add_middleware(RequestIds)
    answer_framework_errors(app)
    add_pooling_routes(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state = app.state
    log_access_rule(state.settings.api_keys, open_paths(state.settings.metrics_require_key))
    state.pooling = await asyncio.get_running_loop().run_in_executor(None, PoolingService, state.settings)
    state.answers = PoolingAnswers(state.pooling, state.settings.served_model_names)
    yield
    state.pooling.stop()


def add_pooling_routes(app: FastAPI) -> None:
    """Mount the pooling routes on `app` (its state: settings, pooling, answers)."""
    state = app.state
    created = int(time.time())
    for path in ROUTES:
        app.add_api_route(path, _endpoint(path), methods=["POST"], name=f"pool:{path}")

    @app.get("/ping")
    async def ping() -> JSONResponse:
        return JSONResponse({"status": "Healthy"})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                                         "owned_by": "lmi_handler"}
                                                        for name in state.settings.served_model_names]})


def _endpoint(path: str):
    dialect = dialect_of(path)

    async def endpoint(request: Request) -> Response:
        body = await request.body()
        answers = request.app.state.answers
        try:
            answer = await asyncio.get_running_loop().run_in_executor(None, answers.answer, path, body)
        except RequestValidationError as exc:
            return error_response(dialect, str(exc), exc.status_code, exc.field)
        except QueueFull as exc:
            return error_response(dialect, str(exc), 503)
        return Response(encode_bytes(answer), media_type="application/json")
    return endpoint
