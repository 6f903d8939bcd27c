"""protocol/dialects.py: which dialect a request speaks, by its HTTP path (before any plan exists)."""
from __future__ import annotations

import pytest

from lmi_handler.protocol.dialects import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_GENERATE,
    ROUTE_GENERATE_STREAM,
    ROUTE_INVOCATIONS,
    ROUTE_TGI,
    Dialect,
    dialect_of,
)


@pytest.mark.parametrize("path, dialect", [
    (ROUTE_INVOCATIONS, Dialect.LMI), ("/predictions/model", Dialect.LMI), (None, Dialect.LMI), ("/ping", Dialect.LMI),
    (ROUTE_CHAT, Dialect.OPENAI), (ROUTE_COMPLETIONS, Dialect.OPENAI), ("/v1/batches/b1", Dialect.OPENAI),
    ("/v1/embeddings", Dialect.OPENAI), ("/v1/requests/x/cancel", Dialect.OPENAI),
    (ROUTE_GENERATE, Dialect.TGI), (ROUTE_GENERATE_STREAM, Dialect.TGI), (ROUTE_TGI, Dialect.TGI),
    ("/generate/", Dialect.LMI), ("/v1", Dialect.LMI),
])
def test_openai_owns_v1_tgi_its_three_routes_and_lmi_every_other_path(path, dialect):
    assert dialect_of(path) is dialect
