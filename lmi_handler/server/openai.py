"""OpenAI's routes on the bundled app: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

Owns these routes and the Model list; the request and answer shapes are protocol/openai.py's and the
plan's (Kind.OPENAI_*), serving a request serving.py's. /v1/files and /v1/batches are batch/routes.py's.
"""
from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from lmi_handler.protocol.dialects import ROUTE_CHAT, ROUTE_COMPLETIONS
from lmi_handler.server.serving import add_generation_routes


def add_openai_routes(app: FastAPI) -> None:
    add_generation_routes(app, ROUTE_CHAT, ROUTE_COMPLETIONS)

    models_created = int(time.time())      # OpenAI Model.created: unix seconds; here, when the app was built

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        """OpenAI's Model list: every served name (option.served_model_name), the answered one first, then
        each loaded LoRA adapter with `parent` = the base's name."""
        service = app.state.service
        cards = [{"id": name, "object": "model", "created": models_created, "owned_by": "lmi_handler"}
                 for name in service.served_names]
        registry = service.engine.adapters           # LoRA adapters, as vLLM lists them: parent = the base
        cards += [{"id": a.name, "object": "model", "created": models_created, "owned_by": "lmi_handler",
                   "root": str(a.path), "parent": service.model_name}
                  for a in (registry.adapters() if registry is not None else [])]
        return JSONResponse({"object": "list", "data": cards})
