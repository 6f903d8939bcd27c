"""How the HTTP layer ends a stream that fails after its 200 went out (DESIGN §3), fed real chunks."""
from __future__ import annotations

import asyncio
import json

import pytest

from lmi_handler.protocol.encoder import Wire
from lmi_handler.protocol.plan import Kind
from lmi_handler.server.app import _stream
from lmi_handler.server.frontend import Chunk, ClientRequest
from tests.protocol.helpers import make_plan


def drain(first: Chunk, later: list[Chunk], output_formatter: str, openai_route: bool) -> tuple[str, ClientRequest]:
    plan = make_plan(Kind.OPENAI_CHAT if openai_route else Kind.LMI_TEXT, Wire(output_formatter))

    async def run() -> tuple[str, ClientRequest]:
        client = ClientRequest(b"{}", asyncio.get_running_loop(), plan=plan)
        for chunk in later:
            client.chunks.put_nowait(chunk)
        parts = [part async for part in _stream(client, first, plan)]
        return "".join(parts), client

    return asyncio.run(run())


@pytest.mark.parametrize("output_formatter", ["jsonlines", "sse"])
def test_a_failure_mid_stream_ends_with_an_error_line(output_formatter):
    first = Chunk('{"token": {"id": 5, "text": "a", "log_prob": -0.1, "special_token": false}}\n', False)
    text, client = drain(first, [Chunk("", True, 424, "engine step failed")],
                         output_formatter=output_formatter, openai_route=False)
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.strip()]
    last = json.loads(lines[-1])
    assert last["details"]["finish_reason"] == "error" and last["error"] == "engine step failed"
    assert last["code"] == 424 and "token" in last
    if output_formatter == "sse":
        assert text.endswith("\n\n") and text.splitlines()[-2].startswith("data: ")
    assert client.cancelled  # the request is over for the front end too


def test_an_openai_stream_failure_sends_an_error_chunk_then_done():
    text, _ = drain(Chunk('data: {"choices": []}\n\n', False), [Chunk("", True, 424, "boom")],
                    output_formatter="sse", openai_route=True)
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "boom"


def test_a_normal_stream_passes_chunks_through_unchanged():
    text, _ = drain(Chunk("a\n", False), [Chunk("", False), Chunk("b\n", True)],
                    output_formatter="jsonlines", openai_route=False)
    assert text == "a\nb\n"
