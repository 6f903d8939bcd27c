"""frontend/requests.py without a model: the bounded waiting queue, deadlines, cancel by id, and the places
held for requests being planned.
"""
from __future__ import annotations

import asyncio

import pytest

from lmi_handler.engine.sequence import SamplingParams
from lmi_handler.frontend.loops import FrontEnd
from lmi_handler.frontend.requests import CANCELLED_CODE, TIMEOUT_CODE, ClientRequest, WaitingQueue
from tests.protocol.helpers import make_plan


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def client(loop, **kwargs) -> ClientRequest:
    return ClientRequest(b"{}", loop, **kwargs)


def drained(loop, c: ClientRequest) -> list:
    loop.run_until_complete(asyncio.sleep(0))  # run the call_soon_threadsafe pushes
    return [c.chunks.get_nowait() for _ in range(c.chunks.qsize())]


def test_the_waiting_queue_refuses_past_its_capacity_and_clients_gone_make_room(loop):
    queue = WaitingQueue(2)
    a, b, c = client(loop), client(loop), client(loop)
    assert queue.put(a) and queue.put(b)
    assert not queue.put(c)
    a.cancelled = True
    assert queue.put(c)
    assert queue.get(None) is b and queue.get(None) is c and queue.get(None) is None


def test_the_waiting_queue_serves_the_lowest_priority_value_first_and_arrival_order_within_one(loop):
    def ranked(priority: int) -> ClientRequest:
        return client(loop, plan=make_plan(params=SamplingParams(priority=priority)))

    queue = WaitingQueue(100)
    low = [ranked(5) for _ in range(64)]
    for c in low:
        assert queue.put(c)
    unplanned, high, middle, other_high = client(loop), ranked(0), ranked(2), ranked(0)
    for c in (unplanned, high, middle, other_high):
        assert queue.put(c)
    assert unplanned.priority == 0
    order = [queue.get(None) for _ in range(68)]
    assert order == [unplanned, high, other_high, middle, *low] and queue.get(None) is None


def test_a_waiting_request_past_its_deadline_ends_with_a_timeout_error_and_leaves_the_queue(loop):
    queue = WaitingQueue(10)
    late, on_time = client(loop, timeout_s=1.0), client(loop, timeout_s=100.0)
    queue.put(late)
    queue.put(on_time)
    queue.end_due(late.arrival + 1.5)
    assert queue.qsize() == 1 and queue.get(None) is on_time
    (chunk,) = drained(loop, late)
    assert chunk.last and chunk.code == TIMEOUT_CODE and "1 s" in chunk.error
    assert late.ended and late.cancelled and drained(loop, on_time) == []


def test_cancel_by_public_id_ends_every_live_request_with_that_id_and_unknown_ids_are_refused(loop):
    front_end = FrontEnd(lambda inputs: None, {}, job_queue_size=4)
    first, second = client(loop, public_id="job-1"), client(loop, public_id="job-1", request_id="job-1-x")
    for c in (first, second):
        front_end.track(c)
        assert front_end.submit(c)
    assert not front_end.cancel("job-2")
    assert front_end.cancel("job-1")
    front_end.pending.end_due(first.arrival)
    for c in (first, second):
        (chunk,) = drained(loop, c)
        assert chunk.code == CANCELLED_CODE and "cancelled" in chunk.error
    front_end.forget(first)
    front_end.forget(second)
    assert not front_end.is_live("job-1") and front_end.num_live == 0


def test_a_request_without_a_deadline_never_times_out(loop):
    c = client(loop)
    assert c.due(c.arrival + 10 ** 6) is None


def test_places_are_held_for_requests_being_planned_so_overload_is_refused_before_any_parsing(loop):
    front_end = FrontEnd(lambda inputs: None, {}, job_queue_size=2)
    assert front_end.reserve() and front_end.reserve()
    assert not front_end.reserve()          # two being planned fill the queue's two places
    front_end.unreserve()
    assert front_end.submit(client(loop))   # one queued, one still being planned: still full
    assert not front_end.reserve()
    front_end.unreserve()
    assert front_end.reserve()
