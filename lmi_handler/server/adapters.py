"""The LoRA adapter routes: LMI's management API (GET/POST /models/{model}/adapters, GET/DELETE
/models/{model}/adapters/{name}) and vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Owns these routes and their answers; loading and checking adapters is engine/model/lora/'s (through the
Service), the API key the middleware's (auth.py: these routes need it like every other).
"""
from __future__ import annotations

import asyncio
import json
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lmi_handler.engine.model.lora import LoraAdapter, LoraError
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.server.serving import error_response


def adapter_card(adapter: LoraAdapter) -> dict:
    """One adapter as the LMI listing shows it."""
    return {"name": adapter.name, "src": str(adapter.path), "rank": adapter.rank, "scale": adapter.scale,
            "modules": list(adapter.modules)}


# LoraError.field (LMI's query parameters name / src; "adapter" for the folder's contents) -> vLLM's body field
VLLM_FIELDS = {"name": "lora_name", "src": "lora_path", "adapter": "lora_path"}


def add_adapter_routes(app: FastAPI) -> None:
    state = app.state

    def unknown_model(model: str) -> Response | None:
        if state.service.serves(model):
            return None
        served = ", ".join(map(repr, state.service.served_names))
        return error_response(Dialect.LMI, f"model {model!r} is not served here (this server serves {served})", 404)

    async def run(call, dialect: Dialect) -> Response | object:
        """`call` off the event loop (it reads files); a LoraError becomes its answer in `dialect`, its field
        named as that API's request names it (vLLM's body: lora_name, lora_path)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, call)
        except LoraError as exc:
            field = VLLM_FIELDS.get(exc.field, exc.field) if dialect is Dialect.OPENAI else exc.field
            return error_response(dialect, str(exc), exc.status_code, field)

    @app.get("/models/{model}/adapters")
    async def list_adapters(model: str) -> Response:
        """LMI: the model's loaded adapters, least recently used first."""
        refusal = unknown_model(model)
        if refusal is not None:
            return refusal
        registry = state.service.engine.adapters
        adapters = registry.adapters() if registry is not None else []
        return JSONResponse({"adapters": [adapter_card(a) for a in adapters]})

    @app.get("/models/{model}/adapters/{name}")
    async def describe_adapter(model: str, name: str) -> Response:
        refusal = unknown_model(model)
        if refusal is not None:
            return refusal
        registry = state.service.engine.adapters
        found = next((a for a in (registry.adapters() if registry else []) if a.name == name), None)
        if found is None:
            return error_response(Dialect.LMI, f"adapter {name!r} is not loaded", 404, "name")
        return JSONResponse(adapter_card(found))

    @app.post("/models/{model}/adapters")
    async def register_adapter(model: str, request: Request) -> Response:
        """LMI: load `src` as adapter `name` (query parameters)."""
        refusal = unknown_model(model)
        if refusal is not None:
            return refusal
        name, src = request.query_params.get("name"), request.query_params.get("src")
        if not name or not src:
            missing = "name" if not name else "src"
            return error_response(Dialect.LMI, f"Missing query parameter `{missing}` (POST "
                                  f"/models/{model}/adapters?name=<adapter>&src=<folder>)", 400, missing)
        result = await run(partial(state.service.load_adapter, name, src), Dialect.LMI)
        if isinstance(result, Response):
            return result
        return JSONResponse({"status": f"Adapter {name} registered"})

    @app.delete("/models/{model}/adapters/{name}")
    async def unregister_adapter(model: str, name: str) -> Response:
        refusal = unknown_model(model)
        if refusal is not None:
            return refusal
        result = await run(partial(state.service.unload_adapter, name), Dialect.LMI)
        if isinstance(result, Response):
            return result
        return JSONResponse({"status": f"Adapter {name} unregistered"})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM: body {"lora_name", "lora_path"}; answers plain text as vLLM does."""
        body = await _body(request, ("lora_name", "lora_path"))
        if isinstance(body, Response):
            return body
        result = await run(partial(state.service.load_adapter, body["lora_name"], body["lora_path"]), Dialect.OPENAI)
        if isinstance(result, Response):
            return result
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM: body {"lora_name"}."""
        body = await _body(request, ("lora_name",))
        if isinstance(body, Response):
            return body
        result = await run(partial(state.service.unload_adapter, body["lora_name"]), Dialect.OPENAI)
        if isinstance(result, Response):
            return result
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


async def _body(request: Request, fields: tuple[str, ...]) -> dict | Response:
    """The JSON body with each of `fields` a non-empty string, or the 400 (OpenAI's error shape) naming one."""
    try:
        body = json.loads(await request.body() or b"null")
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return error_response(Dialect.OPENAI, f"the body must be a JSON object with {', '.join(fields)}", 400, "body")
    for name in fields:
        if not isinstance(body.get(name), str) or not body[name]:
            return error_response(Dialect.OPENAI, f"Invalid parameter `{name}`: must be a non-empty string, got "
                                  f"{body.get(name)!r}", 400, name)
    return body
