"""The token routes on the bundled app: POST /tokenize (vLLM's body; TGI's is tgi.py's) and POST /detokenize.

Owns these routes and vLLM's answers; the bodies are protocol/tokens.py's, tokenizing the service's (its
tokenizer, under its lock). Nothing here reaches the engine: the routes answer while generation runs.
"""
from __future__ import annotations

from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import Response

from lmi_handler.protocol import tokens
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.server import tgi
from lmi_handler.server.serving import answer_in_thread
from lmi_handler.service import Service


def add_token_routes(app: FastAPI) -> None:
    state = app.state

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM: {"prompt" | "messages", "add_special_tokens"?, "return_token_strs"?} -> {count, max_model_len,
        tokens, token_strs}; TGI's {"inputs"} -> [{id, text, start, stop}] (tgi.py)."""
        body = await request.body()
        if tokens.is_tgi_tokenize(body):
            return await tgi.tokenize(state.service, body)
        return await answer_in_thread(body, Dialect.OPENAI, partial(tokenize_answer, state.service))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM: {"tokens": [ids]} -> {"prompt": text}."""
        return await answer_in_thread(await request.body(), Dialect.OPENAI, partial(detokenize_answer, state.service))


def tokenize_answer(service: Service, body: bytes) -> dict:
    """vLLM's TokenizeResponse of `body`. Raises RequestValidationError naming the field."""
    request = tokens.parse_tokenize(body)
    field = "prompt" if request.messages is None else "messages"
    text = request.text if request.messages is None else service.apply_chat_template(request.messages)
    token_ids, _ = service.encode(text, field, request.add_special_tokens)
    token_strs = service.token_strs(token_ids) if request.return_token_strs else None
    return tokens.tokenize_answer(token_ids, service.engine.max_model_len, token_strs)


def detokenize_answer(service: Service, body: bytes) -> dict:
    """vLLM's DetokenizeResponse {"prompt"}. Raises RequestValidationError naming `tokens`."""
    return {"prompt": service.decode(tokens.parse_detokenize(body))}
