"""OpenAI's Responses routes on the bundled app: POST /v1/responses (served as the chat route is: serving.py),
GET and DELETE /v1/responses/{id} from the store of finished responses (app.state.responses_store).

Owns these routes and the store's place on the app; the request's rules are protocol/responses.py's, the
answers protocol/formatters/responses.py's.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmi_handler.protocol.dialects import ROUTE_RESPONSES, Dialect
from lmi_handler.protocol.responses import ResponseStore
from lmi_handler.server.serving import error_response, serve


def add_responses_routes(app: FastAPI, store_size: int) -> None:
    """Mount the routes; the store keeps the last `store_size` responses (option.responses_store_size)."""
    app.state.responses_store = ResponseStore(store_size)

    @app.post(ROUTE_RESPONSES)
    async def create(request: Request) -> Response:
        """A Response, whole or streamed as its events; kept (store, the default) for previous_response_id."""
        return await serve(request, ROUTE_RESPONSES, responses_store=app.state.responses_store)

    @app.get(ROUTE_RESPONSES + "/{response_id}")
    async def retrieve(response_id: str) -> Response:
        """A stored Response object; 404 in OpenAI's error shape when the store does not hold it."""
        stored = app.state.responses_store.get(response_id)
        if stored is None:
            return _not_found(app.state.responses_store, response_id)
        return JSONResponse(stored.body)

    @app.delete(ROUTE_RESPONSES + "/{response_id}")
    async def delete(response_id: str) -> Response:
        if not app.state.responses_store.delete(response_id):
            return _not_found(app.state.responses_store, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(store: ResponseStore, response_id: str) -> Response:
    why = "" if store.capacity else " (this server keeps none: option.responses_store_size=0)"
    return error_response(Dialect.OPENAI, f"Response with id '{response_id}' not found{why}", 404, "response_id")
