"""The answer rules a plan is built from: kind by route and schema, streaming, wire format, n / best_of."""
from __future__ import annotations

import pytest

from lmi_handler.engine.sequence import SamplingParams
from lmi_handler.protocol.encoder import Wire
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.plan import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_GENERATE,
    ROUTE_GENERATE_STREAM,
    ROUTE_INVOCATIONS,
    ROUTE_TGI,
    Kind,
    Shape,
    kind_of,
    shape_of,
    streaming_reason,
    wire_of,
)
from lmi_handler.protocol.sequences import Combine, SequencePlan, best_choices, members, openai_n, tgi_best_of


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


@pytest.mark.parametrize("kind, stream, option, tgi, wire", [
    (Kind.LMI_TEXT, False, "sse", True, Wire.JSON), (Kind.LMI_TEXT, True, None, False, Wire.JSONLINES),
    (Kind.LMI_TEXT, True, None, True, Wire.SSE), (Kind.LMI_TEXT, True, "jsonlines", True, Wire.JSONLINES),
    (Kind.LMI_CHAT, True, "jsonlines", False, Wire.JSONLINES), (Kind.OPENAI_CHAT, True, "jsonlines", False, Wire.SSE),
    (Kind.DYNAMIC_LIST, True, "sse", True, Wire.JSONLINES), (Kind.TGI_STREAM, True, "jsonlines", False, Wire.SSE),
    (Kind.TGI_COMPAT, True, None, False, Wire.SSE),
])
def test_wire_format_follows_lmi_defaults(kind, stream, option, tgi, wire):
    assert wire_of(kind, stream, option, tgi) is wire


def test_tgi_best_of_runs_several_sampled_sequences_unless_streamed_or_over_the_batch():
    assert tgi_best_of(1, None, streaming_why=None, max_count=4) == SequencePlan()
    assert tgi_best_of(2, 3, streaming_why=None, max_count=4) == SequencePlan(3, Combine.BEST_OF)
    with pytest.raises(RequestValidationError, match="cannot be streamed"):
        tgi_best_of(1, 2, streaming_why="send stream=false", max_count=4)
    with pytest.raises(RequestValidationError) as info:
        tgi_best_of(5, None, streaming_why=None, max_count=4)
    assert info.value.field == "n" and "max_rolling_batch_size (4)" in info.value.message


def test_openai_n_runs_n_sequences_answered_as_choices():
    assert openai_n(1, None, stream=True, max_count=4) == SequencePlan()
    assert openai_n(3, None, stream=True, max_count=4) == SequencePlan(3, Combine.CHOICES, num_choices=3)
    assert openai_n(2, 4, stream=False, max_count=4) == SequencePlan(4, Combine.CHOICES, num_choices=2)
    assert openai_n(1, 1, stream=True, max_count=4) == SequencePlan()


@pytest.mark.parametrize("n, best_of, stream, field, words", [
    (2, 1, False, "best_of", "must be >= n (2)"), (1, 3, True, "best_of", "cannot be streamed"),
    (5, None, False, "n", "max_rolling_batch_size (4)"), (2, 5, False, "best_of", "max_rolling_batch_size (4)"),
])
def test_openai_n_refuses_best_of_below_n_streamed_best_of_and_more_than_the_batch(n, best_of, stream, field, words):
    with pytest.raises(RequestValidationError) as info:
        openai_n(n, best_of, stream=stream, max_count=4)
    assert info.value.field == field and words in info.value.message and f"`{field}`" in info.value.message


def test_best_choices_keeps_member_order_unless_best_of_picks_the_highest_scores():
    assert best_choices([-3.0, -1.0], 2) == [0, 1]
    assert best_choices([-3.0, -1.0, -2.0, -1.0], 2) == [1, 3]


def test_members_take_consecutive_int64_wrapped_seeds_from_the_request_or_the_front_end():
    sampled = SamplingParams(greedy=False)
    plan = SequencePlan(3, Combine.BEST_OF)
    assert [m.params.seed for m in members("r", sampled, plan, front_end_seed=-5)] == [-5, -4, -3]
    top = (1 << 63) - 1
    seeds = [m.params.seed for m in members("r", SamplingParams(greedy=False, seed=top), plan)]
    assert seeds == [top, -(1 << 63), -(1 << 63) + 1]
    assert [m.request_id for m in members("r", sampled, plan)] == ["r#0", "r#1", "r#2"]
    (single,) = members("r", sampled, SequencePlan(), front_end_seed=9)
    assert single.request_id == "r" and single.params.seed == 9   # as Engine.add_request would choose
