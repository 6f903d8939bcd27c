"""The token routes on the bundled app: POST /tokenize (vLLM's body and TGI's) and POST /detokenize (vLLM's).

Owns these routes; the bodies and answers are protocol/tokens.py's, tokenizing the service's (its tokenizer,
under its lock). Nothing here reaches the engine: the routes answer while generation runs.
"""
from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmi_handler.protocol import tokens
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.server.serving import MAX_BODY_BYTES, error_response
from lmi_handler.service import Service


def add_token_routes(app: FastAPI) -> None:
    state = app.state

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM: {"prompt" | "messages", "add_special_tokens"?, "return_token_strs"?} -> {count, max_model_len,
        tokens, token_strs}; TGI: {"inputs"} -> [{id, text, start, stop}]."""
        body = await request.body()
        return await _answer(body, tokens.dialect_of_tokenize(body), partial(tokenize_answer, state.service))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM: {"tokens": [ids]} -> {"prompt": text}."""
        return await _answer(await request.body(), Dialect.OPENAI, partial(detokenize_answer, state.service))


async def _answer(body: bytes, dialect: Dialect, answer_of: Callable[[bytes], Any]) -> Response:
    """`answer_of(body)` off the event loop (a long text's tokenizing never stalls the streams), or the 4xx in
    `dialect`'s error shape."""
    if len(body) > MAX_BODY_BYTES:
        return error_response(dialect, f"request body is over {MAX_BODY_BYTES} bytes", 413, "body")
    try:
        answer = await asyncio.get_running_loop().run_in_executor(None, answer_of, body)
    except RequestValidationError as exc:
        return error_response(dialect, str(exc), exc.status_code, exc.field)
    return JSONResponse(answer)


def tokenize_answer(service: Service, body: bytes) -> dict | list[dict]:
    """The /tokenize answer of `body` in its server's shape. Raises RequestValidationError naming the field."""
    request = tokens.parse_tokenize(body)
    if request.dialect is Dialect.TGI:
        token_ids, offsets = service.encode(request.text, "inputs")
        return tokens.tgi_tokens(request.text, token_ids, offsets)
    field = "prompt" if request.messages is None else "messages"
    text = request.text if request.messages is None else service.apply_chat_template(request.messages)
    token_ids, _ = service.encode(text, field, request.add_special_tokens)
    token_strs = service.token_strs(token_ids) if request.return_token_strs else None
    return tokens.tokenize_answer(token_ids, service.engine.max_model_len, token_strs)


def detokenize_answer(service: Service, body: bytes) -> dict:
    """vLLM's DetokenizeResponse {"prompt"}. Raises RequestValidationError naming `tokens`."""
    return {"prompt": service.decode(tokens.parse_detokenize(body))}
