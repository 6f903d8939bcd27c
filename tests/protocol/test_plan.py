"""The answer rules a plan is built from: kind by route and schema, streaming, wire format, n / best_of."""
from __future__ import annotations

import pytest

from lmi_handler.protocol.dialects import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_GENERATE,
    ROUTE_GENERATE_STREAM,
    ROUTE_INVOCATIONS,
    ROUTE_TGI,
)
from lmi_handler.protocol.encoder import Wire
from lmi_handler.protocol.plan import Kind, Shape, kind_of, shape_of, streaming_reason, wire_of


@pytest.mark.parametrize("route, chat, rolling, kind", [
    (ROUTE_CHAT, False, True, Kind.OPENAI_CHAT), (ROUTE_COMPLETIONS, False, False, Kind.OPENAI_COMPLETION),
    (ROUTE_GENERATE, False, False, Kind.TGI_GENERATE), (ROUTE_INVOCATIONS, True, False, Kind.LMI_CHAT),
    (ROUTE_INVOCATIONS, False, True, Kind.LMI_TEXT), (None, False, False, Kind.DYNAMIC_LIST),
    (ROUTE_GENERATE_STREAM, True, True, Kind.TGI_STREAM), (ROUTE_TGI, False, True, Kind.TGI_COMPAT),
])
def test_kind_follows_route_then_messages_then_batching_mode(route, chat, rolling, kind):
    assert kind_of(route, chat, rolling) is kind


def test_a_batch_line_answers_the_object_of_its_url():
    assert shape_of(Kind.BATCH_LINE, ROUTE_CHAT) is Shape.CHAT
    assert shape_of(Kind.BATCH_LINE, ROUTE_COMPLETIONS) is Shape.COMPLETION
    assert shape_of(Kind.LMI_CHAT) is Shape.CHAT and shape_of(Kind.DYNAMIC_LIST) is Shape.LMI


@pytest.mark.parametrize("kind, asked, option, streams", [
    (Kind.LMI_TEXT, False, None, False), (Kind.LMI_TEXT, True, None, True), (Kind.LMI_TEXT, False, "sse", True),
    (Kind.LMI_CHAT, False, "jsonlines", True), (Kind.OPENAI_CHAT, False, "sse", False),
    (Kind.DYNAMIC_LIST, False, "jsonlines", False), (Kind.TGI_GENERATE, True, None, False),
    (Kind.BATCH_LINE, True, None, False), (Kind.TGI_STREAM, False, None, True), (Kind.TGI_COMPAT, False, "sse", False),
    (Kind.TGI_COMPAT, True, None, True),
])
def test_lmi_kinds_stream_when_asked_or_by_option_others_only_when_asked(kind, asked, option, streams):
    assert (streaming_reason(kind, asked, option) is not None) is streams


@pytest.mark.parametrize("kind, asked, rolling, enable_streaming, streams", [
    (Kind.DYNAMIC_LIST, False, False, False, False), (Kind.DYNAMIC_LIST, True, False, False, True),
    (Kind.DYNAMIC_LIST, False, False, True, True), (Kind.LMI_CHAT, False, False, True, False),
    (Kind.OPENAI_CHAT, False, False, True, False), (Kind.TGI_STREAM, False, False, False, False),
    (Kind.LMI_TEXT, False, True, True, True), (Kind.LMI_CHAT, False, True, True, True),
    (Kind.OPENAI_COMPLETION, False, True, True, False), (Kind.BATCH_LINE, False, True, True, False),
])
def test_option_enable_streaming_streams_every_lmi_answer_and_a_dynamic_batch_list(kind, asked, rolling,
                                                                                 enable_streaming, streams):
    """LMI schema: option.enable_streaming=true; in dynamic batch only a list of inputs can stream ({"outputs"})."""
    reason = streaming_reason(kind, asked, None, rolling=rolling, enable_streaming=enable_streaming)
    assert (reason is not None) is streams
    if streams and not asked:
        assert "option.enable_streaming" in reason


@pytest.mark.parametrize("kind, stream, option, tgi, wire", [
    (Kind.LMI_TEXT, False, "sse", True, Wire.JSON), (Kind.LMI_TEXT, True, None, False, Wire.JSONLINES),
    (Kind.LMI_TEXT, True, None, True, Wire.SSE), (Kind.LMI_TEXT, True, "jsonlines", True, Wire.JSONLINES),
    (Kind.LMI_CHAT, True, "jsonlines", False, Wire.JSONLINES), (Kind.OPENAI_CHAT, True, "jsonlines", False, Wire.SSE),
    (Kind.DYNAMIC_LIST, True, "sse", True, Wire.JSONLINES), (Kind.TGI_STREAM, True, "jsonlines", False, Wire.SSE),
    (Kind.TGI_COMPAT, True, None, False, Wire.SSE),
])
def test_wire_format_follows_lmi_defaults(kind, stream, option, tgi, wire):
    assert wire_of(kind, stream, option, tgi) is wire


def test_the_stream_terminator_is_decided_once_by_the_plan():
    """`data: [DONE]` ends OpenAI-shaped streams unless tgi_compat (sse_done_marker): plan.stream_end."""
    from lmi_handler.protocol.encoder import DONE
    from lmi_handler.protocol.plan import sse_done_marker
    from tests.protocol.helpers import make_plan

    assert make_plan(Kind.OPENAI_CHAT, Wire.SSE, sse_done=sse_done_marker(False)).stream_end == (DONE,)
    assert make_plan(Kind.OPENAI_CHAT, Wire.SSE, sse_done=sse_done_marker(True)).stream_end == ()
