"""Dialects: the API family a request speaks (LMI, OpenAI, TGI), and the routes each one serves.

Owns the rule "which dialect is this?" in one place: by HTTP path before a request is planned
(`dialect_of`), by the plan's kind after (plan.RequestPlan.dialect). What each dialect's answers and
errors look like is formatters/'s and errors.py's.
"""
from __future__ import annotations

import enum

ROUTE_INVOCATIONS = "/invocations"
ROUTE_CHAT = "/v1/chat/completions"
ROUTE_COMPLETIONS = "/v1/completions"
ROUTE_RESPONSES = "/v1/responses"             # OpenAI's Responses API (protocol/responses.py)
ROUTE_GENERATE = "/generate"                  # TGI's non-streaming route
ROUTE_GENERATE_STREAM = "/generate_stream"    # TGI's streaming route (SSE)
ROUTE_TGI = "/"                               # TGI's compat route: streams when the body says stream=true
OPENAI_PREFIX = "/v1/"                        # every OpenAI-style path (files, batches, cancel, unknown routes)


class Dialect(str, enum.Enum):
    """Whose schema a request's answer and errors follow."""

    LMI = "lmi"          # /invocations (LMI schema, DESIGN §3): errors {"error", "code"}
    OPENAI = "openai"    # /v1/*: OpenAI objects; errors {"error": {message, type, param, code}}
    TGI = "tgi"          # TGI's /generate, /generate_stream and /: errors {"error", "error_type"} (TGI)


_TGI_ROUTES = (ROUTE_GENERATE, ROUTE_GENERATE_STREAM, ROUTE_TGI)


def dialect_of(path: str | None) -> Dialect:
    """The dialect of an HTTP path: OpenAI's under /v1/, TGI's on its three routes, else LMI's
    (None: an item that came without a route, as from DJL's own front end)."""
    if path in _TGI_ROUTES:
        return Dialect.TGI
    if path is not None and path.startswith(OPENAI_PREFIX):
        return Dialect.OPENAI
    return Dialect.LMI
