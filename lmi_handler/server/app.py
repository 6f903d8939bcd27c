"""The bundled HTTP front end (FastAPI): one app per loaded model, its state on `app.state`.

Owns the wiring (settings parsed once, the Handler and the front-end loop that drives it, the Batch API,
metrics, API keys) and DJL's own routes: /ping, /invocations, /predictions/{model}, /models and /metrics. OpenAI's
routes are openai.py's (the Responses API's responses.py's), TGI's tgi.py's, /tokenize and /detokenize
tokens.py's, serving a generation request serving.py's.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lmi_handler.batch.server import BatchApi
from lmi_handler.config import ConfigError, Settings
from lmi_handler.frontend.loops import make_front_end
from lmi_handler.handler import Handler
from lmi_handler.pooling_service import served_task
from lmi_handler.protocol.dialects import ROUTE_INVOCATIONS, Dialect
from lmi_handler.server.adapters import add_adapter_routes
from lmi_handler.server.auth import RequireApiKey, log_access_rule, open_paths
from lmi_handler.server.metrics import CountRequests, Metrics
from lmi_handler.server.openai import add_openai_routes
from lmi_handler.server.ops import RequestIds, add_cancel_route, exit_when_dead
from lmi_handler.server.pooling import create_pooling_app
from lmi_handler.server.responses import add_responses_routes
from lmi_handler.server.serving import add_generation_routes, answer_framework_errors, error_response, serve
from lmi_handler.server.tgi import add_tgi_routes
from lmi_handler.server.tokens import add_token_routes


def create_app(properties: dict[str, str]) -> FastAPI:
    """Build the app from serving.properties' keys; the model loads in the front end's thread at startup
    (handle()'s init call), then `app.state.service` is the loaded Service every route uses.

    app.state: settings (parsed here, once), front_end, service (None until the model is loaded),
    tracker (rolling batch: the per-request metrics the handler feeds), metrics, responses_store (the
    finished /v1/responses answers kept, server/responses.py).
    """
    settings = Settings.from_properties(properties)
    if served_task(settings) != "text-generation":       # embeddings, rerank, classification: server/pooling.py
        return create_pooling_app(settings)
    app = FastAPI(title="lmi_handler", lifespan=_lifespan)
    metrics = Metrics(lambda: app.state.service.engine if app.state.service is not None else None,
                      lambda: app.state.front_end)
    tracker = metrics.tracker if settings.is_rolling else None    # dynamic batch: gauges and HTTP counts only
    handler = Handler(settings, observers=[tracker.on_step] if tracker is not None else [])
    app.state.settings, app.state.metrics, app.state.tracker = settings, metrics, tracker
    app.state.handler, app.state.service = handler, None
    app.state.front_end = make_front_end(handler.handle, settings, properties, engine_failure=handler.failure)
    app.state.batch_api = BatchApi(settings, app.state.front_end)

    if settings.api_keys:      # innermost: a 401 is still counted (route "unmatched") and carries x-request-id
        app.add_middleware(RequireApiKey, keys=settings.api_keys, open_paths=open_paths(settings.metrics_require_key))
    app.add_middleware(CountRequests, counter=metrics.requests)
    app.include_router(app.state.batch_api.router)
    app.add_middleware(RequestIds)
    add_cancel_route(app)
    answer_framework_errors(app)
    _add_djl_routes(app)
    add_openai_routes(app)
    add_responses_routes(app, settings.responses_store_size)
    add_tgi_routes(app)
    add_token_routes(app)
    add_adapter_routes(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state = app.state
    log_access_rule(state.settings.api_keys, open_paths(state.settings.metrics_require_key))
    state.front_end.start()
    await asyncio.get_running_loop().run_in_executor(None, state.front_end.ready.wait)
    if isinstance(state.front_end.init_error, ConfigError):
        raise state.front_end.init_error    # a setting refused: cli.py says it in one line, status 2
    if state.front_end.init_error is not None:
        raise RuntimeError(f"model initialization failed: {state.front_end.init_error}")
    state.service = state.handler.service
    await state.batch_api.start(state.service)
    if state.settings.engine_dead_exit_s > 0:
        exit_when_dead(state.front_end, state.settings.engine_dead_exit_s)
    yield
    await state.batch_api.stop()
    state.front_end.stop()


def _add_djl_routes(app: FastAPI) -> None:
    """DJL Serving's routes: health, inference (both paths), the management listing, Prometheus metrics."""
    state = app.state

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/ping")
    async def ping() -> JSONResponse:
        """Unhealthy (503, with the reason) once the engine is dead or its loop is down, and while draining
        after SIGTERM (so a load balancer stops routing here while accepted requests finish); a full queue
        and client errors are not unhealthy."""
        front_end = state.front_end
        if front_end.alive and front_end.draining:
            return JSONResponse({"status": "Draining"}, status_code=503)
        if front_end.alive:
            return JSONResponse({"status": "Healthy"})
        return JSONResponse({"status": "Unhealthy", "reason": front_end.failure}, status_code=503)

    add_generation_routes(app, ROUTE_INVOCATIONS)

    @app.post("/predictions/{model_name}")
    async def predictions(model_name: str, request: Request) -> Response:
        if not state.service.serves(model_name):  # DJL: an unknown model name is a 404
            served = ", ".join(map(repr, state.service.served_names))
            return error_response(Dialect.LMI, f"model {model_name!r} is not served here (this server serves "
                                  f"{served})", 404)
        return await serve(request, ROUTE_INVOCATIONS)

    @app.get("/models")
    async def djl_models() -> JSONResponse:
        """DJL's management listing: each served name, READY while the engine loop runs."""
        status = "READY" if state.front_end.alive else "UNHEALTHY"
        registry = state.service.engine.adapters
        adapters = [a.name for a in registry.adapters()] if registry is not None else []
        return JSONResponse({"models": [{"modelName": name, "modelUrl": str(state.settings.model_path),
                                         "status": status, "adapters": adapters}
                                        for name in state.service.served_names]})
