"""The bundled app of a pooling model (option.task text-embedding, rerank, classification, or auto resolved to
one): OpenAI's /v1/embeddings, TEI's /embed, /rerank and /predict, vLLM's /pooling, /score, /rerank,
/v1/rerank, /v2/rerank and /classify, LMI's /invocations, beside /ping, /health and /v1/models.

Owns these routes and the pooling app's wiring (API keys, request ids, the framework's errors in each path's
dialect, the model loaded at start-up in a worker thread); bodies and answers are protocol/embeddings.py's and
protocol/rerank.py's, running them pooling_service.py's. Errors take the path's dialect (an OpenAI error object
under /v1/, LMI's {"error", "code"} elsewhere), a bad body a 400 naming the field.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmi_handler.config import Settings
from lmi_handler.pooling_service import PoolingService, QueueFull
from lmi_handler.protocol import embeddings, rerank
from lmi_handler.protocol.dialects import dialect_of
from lmi_handler.protocol.encoder import encode_bytes
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.server.auth import RequireApiKey, log_access_rule, open_paths
from lmi_handler.server.ops import RequestIds
from lmi_handler.server.serving import answer_framework_errors, error_response

RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")


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
    yield
    state.pooling.stop()


def add_pooling_routes(app: FastAPI) -> None:
    """Mount the pooling routes on `app` (its state: settings, pooling)."""
    state = app.state
    created = int(time.time())

    def model_name(asked: str | None) -> str:
        names = state.settings.served_model_names
        if asked is not None and asked not in names:
            raise RequestValidationError("model", f"model {asked!r} is not served here (this server serves "
                                                  f"{', '.join(map(repr, names))})", 404)
        return asked or names[0]

    def embed_openai(body: bytes) -> dict:
        query = embeddings.parse_openai_embeddings(body)
        vectors, num_tokens = state.pooling.embed(query)
        return embeddings.openai_embeddings(vectors, query.encoding_format, model_name(query.model), num_tokens)

    def embed_plain(parse: Callable[[bytes], embeddings.EmbedQuery]) -> Callable[[bytes], Any]:
        def answer(body: bytes):
            query = parse(body)
            vectors, _ = state.pooling.embed(query)
            return vectors[0] if query.single and parse is embeddings.parse_lmi_embed else vectors
        return answer

    def pooling(body: bytes) -> dict:
        query = embeddings.parse_openai_embeddings(body)
        vectors, num_tokens = state.pooling.embed(query)
        return embeddings.vllm_pooling(vectors, model_name(query.model), num_tokens)

    def rerank_vllm(body: bytes) -> dict:
        query = rerank.parse_rerank(body)
        scores, num_tokens = state.pooling.score(query)
        return rerank.vllm_rerank(scores, query, model_name(query.model), num_tokens)

    def rerank_tei(body: bytes) -> list:
        query = rerank.parse_rerank(body)
        return rerank.tei_rerank(state.pooling.score(query)[0], query)

    def score(body: bytes) -> dict:
        query = rerank.parse_score(body)
        scores, num_tokens = state.pooling.score(query)
        return rerank.vllm_score(scores, model_name(query.model), num_tokens)

    def classify(body: bytes) -> dict:
        query = rerank.parse_classify(body)
        probs, num_tokens = state.pooling.classify(query)
        return rerank.vllm_classify(probs, state.pooling.pooler.id2label, model_name(query.model), num_tokens)

    def predict(body: bytes):
        query = rerank.parse_classify(body, "inputs")
        probs, _ = state.pooling.classify(query)
        answers = [rerank.labelled(p, state.pooling.pooler.id2label) for p in probs]
        return answers[0] if query.single else answers

    def invocations(body: bytes):
        """LMI: text-embedding answers {"inputs"} with vectors; rerank {"query", "texts"} with TEI's ranked
        scores; classification {"inputs"} with labels."""
        if state.pooling.task == "text-embedding":
            return embed_plain(embeddings.parse_lmi_embed)(body)
        if state.pooling.task == "rerank" and b'"query"' in body:
            return rerank_tei(body)
        return predict(body)

    routes = {"/v1/embeddings": embed_openai, "/embed": embed_plain(embeddings.parse_tei_embed),
              "/pooling": pooling, "/score": score, "/v1/score": score, "/classify": classify,
              "/predict": predict, "/invocations": invocations, "/rerank": rerank_tei,
              "/v1/rerank": rerank_vllm, "/v2/rerank": rerank_vllm}
    for path, answer_of in routes.items():
        app.add_api_route(path, _endpoint(path, answer_of), methods=["POST"], name=f"pool:{path}")

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


def _endpoint(path: str, answer_of: Callable[[bytes], Any]):
    dialect = dialect_of(path)

    async def endpoint(request: Request) -> Response:
        body = await request.body()
        try:
            answer = await asyncio.get_running_loop().run_in_executor(None, answer_of, body)
        except RequestValidationError as exc:
            return error_response(dialect, str(exc), exc.status_code, exc.field)
        except QueueFull as exc:
            return error_response(dialect, str(exc), 503)
        return Response(encode_bytes(answer), media_type="application/json")
    return endpoint
