"""The pooling routes' request bodies (embeddings, rerank, score, classify) and the embedding answers.

Owns parsing every pooling body into one EmbedQuery / ScoreQuery / ClassifyQuery (a 400 naming the field
for a bad one) and the embedding answers of each dialect: OpenAI's /v1/embeddings (float or base64), TEI's
/embed, LMI's /invocations, vLLM's /pooling. Scores and labels are answered by rerank.py; tokenizing and
running them is pooling_service.py's. Imports no torch: vectors arrive as lists of floats.
"""
from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any

from lmi_handler.protocol.errors import RequestValidationError

MAX_INPUTS = 2048          # inputs in one request (OpenAI's limit for /v1/embeddings)
ENCODING_FORMATS = ("float", "base64")


@dataclass
class EmbedQuery:
    """Texts (or token id lists) to embed and how: normalize None = the server's default; dimensions None = the
    full vector; prompt_name / prompt: sentence-transformers' named prompt, or a literal text, put before each
    input; truncate: an input over the model's length is cut to it instead of refused."""

    inputs: list[str | list[int]]
    normalize: bool | None = None
    dimensions: int | None = None
    prompt_name: str | None = None
    truncate: bool = False
    encoding_format: str = "float"
    model: str | None = None
    single: bool = False          # the body sent one input, not a list (LMI answers one vector then)
    field: str = "input"          # the inputs' field as the body names it (errors name it)


def load_body(data: bytes) -> dict:
    """The JSON object of a body. Raises RequestValidationError (field "body") otherwise."""
    try:
        body = json.loads(data or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestValidationError("body", f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise RequestValidationError("body", "the body must be a JSON object")
    return body


def bool_field(body: dict, name: str, default: bool | None) -> bool | None:
    value = body.get(name, default)
    if value is not None and not isinstance(value, bool):
        raise RequestValidationError(name, f"{name} must be true or false, got {value!r}")
    return value


def positive_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise RequestValidationError(name, f"{name} must be a positive integer, got {value!r}")
    return value


def inputs_field(value: Any, name: str, ids_allowed: bool) -> list[str | list[int]]:
    """An input field as a list of items: a string, a list of strings, or (ids_allowed) a list of token ids or
    a list of such lists. Raises RequestValidationError naming `name`."""
    if isinstance(value, str):
        return [value]
    if ids_allowed and isinstance(value, list) and value and all(is_token_id(v) for v in value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        items: list[str | list[int]] = list(value)
    elif ids_allowed and isinstance(value, list) and value and all(
            isinstance(v, list) and v and all(is_token_id(t) for t in v) for v in value):
        items = [list(v) for v in value]
    else:
        kinds = "a string, a list of strings, a list of token ids or a list of such lists" if ids_allowed \
            else "a string or a list of strings"
        raise RequestValidationError(name, f"{name} must be {kinds} (non-empty), got {shown(value)}")
    if len(items) > MAX_INPUTS:
        raise RequestValidationError(name, f"{name} holds {len(items)} inputs, more than {MAX_INPUTS}")
    return items


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_openai_embeddings(data: bytes) -> EmbedQuery:
    """OpenAI's POST /v1/embeddings: input (required), model, encoding_format, dimensions, user; vLLM's
    extras normalize, truncate_prompt_tokens (any value: truncate to the model's length)."""
    body = load_body(data)
    if "input" not in body:
        raise RequestValidationError("input", "input is required")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise RequestValidationError("encoding_format", f"encoding_format must be one of {list(ENCODING_FORMATS)}, "
                                                        f"got {shown(fmt)}")
    return EmbedQuery(inputs_field(body["input"], "input", True), bool_field(body, "normalize", None),
                      positive_int(body, "dimensions"), None, body.get("truncate_prompt_tokens") is not None, fmt,
                      body.get("model"))


def parse_tei_embed(data: bytes) -> EmbedQuery:
    """TEI's POST /embed: inputs (str or [str]), normalize (default true), truncate, prompt_name, dimensions."""
    body = load_body(data)
    if "inputs" not in body:
        raise RequestValidationError("inputs", "inputs is required")
    prompt_name = body.get("prompt_name")
    if prompt_name is not None and not isinstance(prompt_name, str):
        raise RequestValidationError("prompt_name", f"prompt_name must be a string, got {shown(prompt_name)}")
    return EmbedQuery(inputs_field(body["inputs"], "inputs", False), bool_field(body, "normalize", True),
                      positive_int(body, "dimensions"), prompt_name, bool(bool_field(body, "truncate", False)),
                      single=isinstance(body["inputs"], str), field="inputs")


def parse_lmi_embed(data: bytes) -> EmbedQuery:
    """LMI's /invocations for text-embedding: {"inputs": str | [str], "parameters"?: {normalize, dimensions,
    prompt_name, truncate}} (LMI's embedding guide: answered with a vector, or a list of them)."""
    body = load_body(data)
    if "inputs" not in body:
        raise RequestValidationError("inputs", "inputs is required")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestValidationError("parameters", "parameters must be a JSON object")
    query = parse_tei_embed(json.dumps({**params, "inputs": body["inputs"]}).encode())
    query.normalize = bool_field(params, "normalize", None)
    return query


def openai_embeddings(vectors: list[list[float]], fmt: str, model: str, num_tokens: int) -> dict:
    """OpenAI's CreateEmbeddingResponse: {object: list, data: [{object: embedding, index, embedding}], model,
    usage}; base64: the float32 little-endian bytes of each vector (what the openai package decodes)."""
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if fmt == "base64" else v}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def vllm_pooling(vectors: list[list[float]], model: str, num_tokens: int) -> dict:
    """vLLM's /pooling answer: {id, object: list, created, model, data: [{index, object: pooling, data}], usage}."""
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "pooling", "data": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}
