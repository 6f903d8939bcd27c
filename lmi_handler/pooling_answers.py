"""What each pooling route answers: a route's body -> its answer object, for the bundled app
(server/pooling.py) and for handle() (pooling_handler.py) alike.

Owns the table of pooling routes (OpenAI's /v1/embeddings, TEI's /embed, /rerank, /predict, vLLM's /pooling,
/score, /classify, /rerank, /v1/rerank, /v2/rerank, LMI's /invocations by task) and the served-model rule of
their `model` field; parsing is protocol/embeddings.py's and protocol/rerank.py's, running pooling_service.py's.
"""
from __future__ import annotations

from typing import Any, Callable

from lmi_handler.pooling_service import PoolingService
from lmi_handler.protocol import embeddings, rerank
from lmi_handler.protocol.errors import RequestValidationError

ROUTE_INVOCATIONS = "/invocations"
# route -> the PoolingAnswers method answering it
ROUTES = {"/v1/embeddings": "embed_openai", "/embed": "embed_tei", "/pooling": "pooling", "/score": "score",
          "/v1/score": "score", "/classify": "classify", "/predict": "predict", ROUTE_INVOCATIONS: "invocations",
          "/rerank": "rerank_tei", "/v1/rerank": "rerank_vllm", "/v2/rerank": "rerank_vllm"}


class PoolingAnswers:
    """answer(route, body) -> the route's answer object (a dict or a list, JSON-ready). Raises
    RequestValidationError (a 4xx naming the field) and the service's QueueFull."""

    def __init__(self, service: PoolingService, served_names: tuple[str, ...]):
        self.service, self.served_names = service, served_names
        self.routes: dict[str, Callable[[bytes], Any]] = {path: getattr(self, name) for path, name in ROUTES.items()}

    def answer(self, route: str | None, body: bytes) -> Any:
        """The answer of `body` sent to `route` (None: /invocations, as DJL's own front end sends it)."""
        answer_of = self.routes.get(route or ROUTE_INVOCATIONS)
        if answer_of is None:
            raise RequestValidationError("route", f"no pooling route {route}", 404)
        return answer_of(body)

    def model_name(self, asked: str | None) -> str:
        if asked is not None and asked not in self.served_names:
            raise RequestValidationError("model", f"model {asked!r} is not served here (this server serves "
                                                  f"{', '.join(map(repr, self.served_names))})", 404)
        return asked or self.served_names[0]

    def embed_openai(self, body: bytes) -> dict:
        query = embeddings.parse_openai_embeddings(body)
        vectors, num_tokens = self.service.embed(query)
        return embeddings.openai_embeddings(vectors, query.encoding_format, self.model_name(query.model), num_tokens)

    def embed_tei(self, body: bytes) -> list:
        return self.service.embed(embeddings.parse_tei_embed(body))[0]

    def pooling(self, body: bytes) -> dict:
        query = embeddings.parse_openai_embeddings(body)
        vectors, num_tokens = self.service.embed(query)
        return embeddings.vllm_pooling(vectors, self.model_name(query.model), num_tokens)

    def rerank_vllm(self, body: bytes) -> dict:
        query = rerank.parse_rerank(body)
        scores, num_tokens = self.service.score(query)
        return rerank.vllm_rerank(scores, query, self.model_name(query.model), num_tokens)

    def rerank_tei(self, body: bytes) -> list:
        query = rerank.parse_rerank(body)
        return rerank.tei_rerank(self.service.score(query)[0], query)

    def score(self, body: bytes) -> dict:
        query = rerank.parse_score(body)
        scores, num_tokens = self.service.score(query)
        return rerank.vllm_score(scores, self.model_name(query.model), num_tokens)

    def classify(self, body: bytes) -> dict:
        query = rerank.parse_classify(body)
        probs, num_tokens = self.service.classify(query)
        return rerank.vllm_classify(probs, self.service.pooler.id2label, self.model_name(query.model), num_tokens)

    def predict(self, body: bytes):
        query = rerank.parse_classify(body, "inputs")
        probs, _ = self.service.classify(query)
        answers = [rerank.labelled(p, self.service.pooler.id2label) for p in probs]
        return answers[0] if query.single else answers

    def invocations(self, body: bytes):
        """LMI: text-embedding answers {"inputs"} with a vector (a list of them for a list); rerank {"query",
        "texts"} with TEI's ranked scores; classification (and rerank's {"inputs"}) with labels."""
        task = self.service.task
        if task == "text-embedding":
            query = embeddings.parse_lmi_embed(body)
            vectors = self.service.embed(query)[0]
            return vectors[0] if query.single else vectors
        if task == "rerank" and "query" in embeddings.load_body(body):
            return self.rerank_tei(body)
        return self.predict(body)
