"""The rerank, score and classify bodies and answers: TEI's /rerank and /predict, vLLM's /score, /rerank
(also Jina's /v1/rerank and Cohere's /v2/rerank) and /classify, LMI's /invocations for rerank and
classification.

Owns ScoreQuery / ClassifyQuery (a 400 naming the field for a bad body) and each route's answer object;
the shared field rules are embeddings.py's. Imports no torch: scores arrive as lists of floats.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from lmi_handler.protocol.embeddings import bool_field, inputs_field, load_body, positive_int, shown
from lmi_handler.protocol.errors import RequestValidationError


@dataclass
class ScoreQuery:
    """(query, text) pairs for a cross-encoder. raw_scores: logits instead of their activation; top_n: the
    best n only (rerank); return_text: each answer repeats its text."""

    pairs: list[tuple[str, str]]
    raw_scores: bool = False
    truncate: bool = False
    top_n: int | None = None
    return_text: bool = False
    model: str | None = None


@dataclass
class ClassifyQuery:
    """Texts (or TEI's [text, text_pair] pairs) to classify; raw_scores: logits instead of probabilities."""

    inputs: list[str | tuple[str, str]]
    raw_scores: bool = False
    truncate: bool = False
    single: bool = False
    model: str | None = None


def _string(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise RequestValidationError(name, f"{name} must be a string, got {shown(value)}" if name in body
                                     else f"{name} is required")
    return value


def parse_rerank(data: bytes) -> ScoreQuery:
    """A rerank body: TEI's {query, texts, raw_scores, return_text, truncate} or vLLM / Jina / Cohere's
    {query, documents, top_n, return_documents, model} (documents as strings or {"text"} objects)."""
    body = load_body(data)
    query = _string(body, "query")
    name = "texts" if "texts" in body else "documents"
    docs = body.get(name)
    if isinstance(docs, list):
        docs = [d.get("text") if isinstance(d, dict) else d for d in docs]
    texts = inputs_field(docs, name, False) if name in body else None
    if texts is None:
        raise RequestValidationError("texts", "texts (or documents) is required")
    return ScoreQuery([(query, t) for t in texts], bool(bool_field(body, "raw_scores", False)),
                      bool(bool_field(body, "truncate", False)), positive_int(body, "top_n"),
                      bool(bool_field(body, "return_text", False) or bool_field(body, "return_documents", False)),
                      body.get("model"))


def parse_score(data: bytes) -> ScoreQuery:
    """vLLM's /score: text_1 (or queries) and text_2 (or documents / items), each a string or a list; one
    text_1 is paired with every text_2, two lists of the same length pair by position."""
    body = load_body(data)
    first_name = "text_1" if "text_1" in body else "queries"
    second_name = next((n for n in ("text_2", "documents", "items") if n in body), "text_2")
    if first_name not in body:
        raise RequestValidationError("text_1", "text_1 is required")
    if second_name not in body:
        raise RequestValidationError("text_2", "text_2 is required")
    first = inputs_field(body[first_name], first_name, False)
    second = inputs_field(body[second_name], second_name, False)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise RequestValidationError(second_name, f"{first_name} has {len(first)} texts and {second_name} "
                                                  f"{len(second)}: one, or as many as {second_name}")
    return ScoreQuery(list(zip(first, second)), model=body.get("model"),
                      truncate=body.get("truncate_prompt_tokens") is not None)


def parse_classify(data: bytes, field: str = "input") -> ClassifyQuery:
    """vLLM's /classify ({input, model}); TEI's /predict and LMI's /invocations ({inputs: str | [str] |
    [text, pair] | [[text, pair], ...], raw_scores, truncate}) with field "inputs"."""
    body = load_body(data)
    if field not in body:
        raise RequestValidationError(field, f"{field} is required")
    value = body[field]
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        if not all(len(v) == 2 and all(isinstance(t, str) for t in v) for v in value):
            raise RequestValidationError(field, f"{field} pairs must be [text, text_pair] strings")
        items: list = [tuple(v) for v in value]
    else:
        items = inputs_field(value, field, False)
    return ClassifyQuery(items, bool(bool_field(body, "raw_scores", False)), bool(bool_field(body, "truncate", False)),
                         single=isinstance(value, str), model=body.get("model"))


def tei_rerank(scores: list[float], query: ScoreQuery) -> list[dict]:
    """TEI's /rerank answer: [{index, score, text?}] best first (top_n of them when asked)."""
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:query.top_n]
    return [{"index": i, "score": scores[i], **({"text": query.pairs[i][1]} if query.return_text else {})}
            for i in ranked]


def vllm_rerank(scores: list[float], query: ScoreQuery, model: str, num_tokens: int) -> dict:
    """vLLM's (Jina / Cohere) rerank answer: {id, model, usage, results: [{index, document: {text},
    relevance_score}]} best first, top_n of them when asked."""
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:query.top_n]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": num_tokens},
            "results": [{"index": i, "document": {"text": query.pairs[i][1]}, "relevance_score": scores[i]}
                        for i in ranked]}


def vllm_score(scores: list[float], model: str, num_tokens: int) -> dict:
    """vLLM's /score answer: {id, object: list, created, model, data: [{index, object: score, score}], usage}."""
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}


def labelled(scores: list[float], id2label: dict[int, str]) -> list[dict]:
    """TEI's /predict (and LMI's classification) answer for one input: [{label, score}] best first."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [{"label": id2label.get(i, f"LABEL_{i}"), "score": scores[i]} for i in order]


def vllm_classify(probs: list[list[float]], id2label: dict[int, str], model: str, num_tokens: int) -> dict:
    """vLLM's /classify answer: {id, object: list, created, model, data: [{index, label, probs, num_classes}],
    usage}; label is the most probable class's."""
    data = [{"index": i, "label": id2label.get(max(range(len(p)), key=p.__getitem__), "LABEL_0"), "probs": p,
             "num_classes": len(p)} for i, p in enumerate(probs)]
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}
