"""API keys: who may use the server's routes (option.api_key / LMI_API_KEY, several comma-separated).

Owns the rule "this request needs `Authorization: Bearer <key>`, and has it", as pure ASGI middleware (so
request.is_disconnected() still works behind it), and the 401 in the path's dialect (errors.error_body).
The keys themselves are config/serving.py's; nothing here logs a key, the one sent or the ones accepted.
"""
from __future__ import annotations

import hmac
import logging

from lmi_handler.protocol.dialects import dialect_of
from lmi_handler.protocol.encoder import encode_bytes
from lmi_handler.protocol.errors import error_body

logger = logging.getLogger(__name__)

# Open whatever the keys: a load balancer's and an orchestrator's health checks carry no key (vLLM: /health).
OPEN_PATHS = ("/ping", "/health")
METRICS_PATH = "/metrics"          # open too unless option.metrics_require_key (Prometheus scrapes without one)
UNAUTHORIZED = 401


def open_paths(metrics_require_key: bool) -> tuple[str, ...]:
    """The paths answered without a key."""
    return OPEN_PATHS if metrics_require_key else (*OPEN_PATHS, METRICS_PATH)


def key_matches(authorization: str | None, keys: tuple[bytes, ...]) -> bool:
    """Whether an `Authorization` header value is `Bearer <one of keys>` (the scheme's case ignored, RFC 6750).

    Every key is compared, each in constant time (hmac.compare_digest), so the time taken says nothing about
    which key, or how much of one, matched.
    """
    scheme, _, sent = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    sent_bytes = sent.strip().encode("utf-8", "surrogateescape")
    return any([hmac.compare_digest(sent_bytes, key) for key in keys])   # a list: no early exit


class RequireApiKey:
    """Pure ASGI middleware: every HTTP request but those to `open_paths` must carry a valid key, else it is
    answered 401 in its path's error shape (OpenAI's under /v1/, TGI's and LMI's {"error", "code"} elsewhere)
    with `WWW-Authenticate: Bearer`, before any route (or body read) runs."""

    def __init__(self, app, keys: tuple[str, ...], open_paths: tuple[str, ...]):
        self.app = app
        self.keys = tuple(key.encode("utf-8") for key in keys)
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = next((value.decode("latin-1") for name, value in scope.get("headers", [])
                              if name.lower() == b"authorization"), None)
        if key_matches(authorization, self.keys):
            await self.app(scope, receive, send)
            return
        await _unauthorized(scope["path"], authorization is None, send)


async def _unauthorized(path: str, missing: bool, send) -> None:
    message = ("this server requires an API key: send `Authorization: Bearer <key>`" if missing
               else "invalid API key (the Authorization header's Bearer key is not one this server accepts)")
    body = encode_bytes(error_body(dialect_of(path), message, UNAUTHORIZED))
    await send({"type": "http.response.start", "status": UNAUTHORIZED,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})


def log_access_rule(keys: tuple[str, ...], open_paths: tuple[str, ...]) -> None:
    """Say at start-up who may use the server (how many keys, never which)."""
    if not keys:
        logger.warning("no API key is set (option.api_key / LMI_API_KEY): every route is open to anyone who can "
                       "reach this port")
        return
    logger.info("API key required (%d key%s accepted) on every route but %s", len(keys), "" if len(keys) == 1
                else "s", ", ".join(open_paths))
