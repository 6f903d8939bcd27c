"""The real app in this process, driven over httpx's ASGI transport (no sockets, no subprocess)."""
from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Iterator

import httpx

from lmi_handler import handler
from lmi_handler.config import read_serving_properties
from lmi_handler.server.app import create_app
from tests.helpers import REPO


class InProcessServer:
    """create_app() with its lifespan running on a private event loop; post() sends one request."""

    def __init__(self, **options: str):
        properties = read_serving_properties(REPO / "serving.properties", environ={})
        self.app = create_app({**properties, "max_rolling_batch_size": "4", **options})
        self.loop = asyncio.new_event_loop()
        self.lifespan = self.app.router.lifespan_context(self.app)
        self.loop.run_until_complete(self.lifespan.__aenter__())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://app",
                                        timeout=300)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.loop.run_until_complete(self.client.post(path, **kwargs))

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.loop.run_until_complete(self.client.get(path, **kwargs))

    def gather(self, *requests) -> list[httpx.Response]:
        """Run coroutines made with self.client concurrently (e.g. several posts at once)."""
        async def run():
            return await asyncio.gather(*requests)
        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self.lifespan.__aexit__(None, None, None))
        self.loop.close()


@contextmanager
def fresh_server(**options: str) -> Iterator[InProcessServer]:
    """An InProcessServer with a handler state of its own (its own model, like a fresh worker)."""
    saved = handler._STATE
    handler._STATE = handler.HandlerState()
    server = InProcessServer(**options)
    try:
        yield server
    finally:
        server.close()
        handler._STATE = saved
