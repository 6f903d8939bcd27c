"""protocol/sequences.py: n / best_of by each dialect's rule (TGI best_of, OpenAI n and legacy best_of), the
members' seeds and which choices a best_of answer returns.
"""
from __future__ import annotations

import pytest

from lmi_handler.engine.sequence import SamplingParams
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.plan import Kind
from lmi_handler.protocol.sequences import Combine, SequencePlan, best_choices, members, openai_n, tgi_best_of
from tests.protocol.helpers import choices_plan


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




def test_n_members_take_seeds_seed_plus_one_and_distinct_ids():
    plan = choices_plan(Kind.OPENAI_CHAT, 3, 3)
    (ms,) = plan.members()
    assert [m.params.seed for m in ms] == [10, 11, 12] and [m.request_id for m in ms] == ["abc#0", "abc#1", "abc#2"]
