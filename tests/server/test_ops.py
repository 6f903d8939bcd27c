"""Fast checks of the operating rules (no model): the bounded queue, deadlines, cancel, request ids, fault rules."""
from __future__ import annotations

import asyncio

import pytest

from lmi_handler.config import Settings, read_serving_properties
from lmi_handler.engine.faults import FaultRule
from lmi_handler.engine.sequence import SamplingParams, Sequence
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.server.frontend import CANCELLED_CODE, TIMEOUT_CODE, ClientRequest, FrontEnd, WaitingQueue
from lmi_handler.server.ops import request_id_of, request_timeout


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


def test_the_timeout_header_overrides_the_option_and_bad_values_name_the_header():
    assert request_timeout({}, None) is None
    assert request_timeout({}, 2.0) == 2.0
    assert request_timeout({"x-request-timeout": "0.5"}, 2.0) == 0.5
    for bad in ("0", "-1", "soon", "nan", "inf", "1e9"):
        with pytest.raises(RequestValidationError, match="X-Request-Timeout"):
            request_timeout({"x-request-timeout": bad}, None)


def test_request_ids_are_the_clients_when_well_formed_else_generated():
    assert request_id_of({"x-request-id": "abc-123_x.y:z"}) == "abc-123_x.y:z"
    for bad in ("", "a b", "x" * 129, "é"):
        made = request_id_of({"x-request-id": bad})
        assert len(made) == 32 and made != bad
    assert request_id_of({}) != request_id_of({})


def test_job_queue_size_is_a_top_level_key_with_the_environment_as_djls_default(tmp_path):
    props = tmp_path / "serving.properties"
    props.write_text("option.model_id=model\n")
    assert Settings.from_properties(read_serving_properties(props, {})).job_queue_size == 1000
    assert read_serving_properties(props, {"SERVING_JOB_QUEUE_SIZE": "4"})["job_queue_size"] == "4"
    props.write_text("job_queue_size=7\n")
    assert read_serving_properties(props, {"SERVING_JOB_QUEUE_SIZE": "4"})["job_queue_size"] == "7"


def seq(request_id: str, prompt_len: int, computed: int, outputs: int) -> Sequence:
    s = Sequence(request_id, list(range(prompt_len)), SamplingParams())
    s.num_computed_tokens, s.output_token_ids = computed, list(range(outputs))
    return s


def test_fault_rules_pick_the_sequence_by_prompt_text_or_id_and_the_stage():
    decode4, prefill, by_id = FaultRule.parse_all("decode:4@Water is; prefill@id=r7;pinned:decode:1@id=r9")
    assert (decode4.stage, decode4.decode_step, decode4.marker) == ("decode", 4, "Water is")
    assert prefill.request_id == "r7" and by_id.pinned
    assert decode4.hits(seq("a", 3, 6, 4), "Water is wet") and not decode4.hits(seq("a", 3, 5, 3), "Water is")
    assert not decode4.hits(seq("a", 3, 6, 4), "The sky is")
    assert prefill.hits(seq("r7", 10, 4, 0), "") and prefill.hits(seq("r7#1", 10, 0, 0), "")
    assert not prefill.hits(seq("r7", 10, 10, 1), "") and not prefill.hits(seq("r70", 10, 0, 0), "")
    for bad in ("decode@x", "decode:0@x", "prefill:2@x", "boom@x", "decode:4", "decode:4@"):
        with pytest.raises(ValueError, match="fault_injection"):
            FaultRule.parse(bad)


def test_places_are_held_for_requests_being_planned_so_overload_is_refused_before_any_parsing(loop):
    front_end = FrontEnd(lambda inputs: None, {}, job_queue_size=2)
    assert front_end.reserve() and front_end.reserve()
    assert not front_end.reserve()          # two being planned fill the queue's two places
    front_end.unreserve()
    assert front_end.submit(client(loop))   # one queued, one still being planned: still full
    assert not front_end.reserve()
    front_end.unreserve()
    assert front_end.reserve()
