"""frontend/loops.py's DJL rules (DESIGN §2), driven with a scripted handle() that answers like a handler.
"""
from __future__ import annotations

import asyncio
import json
import time

from lmi_handler.djl import OwnOutput
from lmi_handler.engine.health import EngineDead
from lmi_handler.engine.sequence import SamplingParams
from lmi_handler.frontend.loops import DynamicFrontEnd, RollingFrontEnd
from lmi_handler.frontend.requests import ENGINE_DEAD_CODE, Chunk, ClientRequest
from lmi_handler.handler import HANDOVER_KEY, ROUTE_PROPERTY
from lmi_handler.protocol.encoder import Wire
from tests.protocol.helpers import make_plan


class ScriptedHandle:
    """Records each call; answers every item `data`/`last` entries (or a wrong count when told to)."""

    def __init__(self, last_after: int = 2):
        self.calls = []
        self.last_after = last_after
        self.wrong_count_once = False

    def __call__(self, inputs):
        self.calls.append(inputs)
        items = inputs.get_batches()
        answer = OwnOutput()
        count = len(items) + 1 if self.wrong_count_once else len(items)
        self.wrong_count_once = False
        last = "true" if len(self.calls) >= self.last_after else "false"
        for index in range(count):
            answer.add(OwnOutput.binary_encode({"data": f"step{len(self.calls)}", "last": last}),
                       key="data", batch_index=index)
        return answer


def clients(n: int, loop) -> list[ClientRequest]:
    return [ClientRequest(f'{{"inputs": "{i}"}}'.encode(), loop, request_id=f"r{i}",
                          plan=make_plan(request_id=f"r{i}")) for i in range(n)]


def drained(client: ClientRequest) -> list[Chunk]:
    out = []
    while not client.chunks.empty():
        out.append(client.chunks.get_nowait())
    return out


def wait_for(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def run_steps(front_end, steps: int) -> None:
    for _ in range(steps):
        front_end.loop_once()


def test_rolling_front_end_sends_running_items_first_with_empty_data_and_new_ones_with_body_seed_and_plan():
    loop = asyncio.new_event_loop()
    handle = ScriptedHandle(last_after=3)
    front_end = RollingFrontEnd(handle, {}, max_batch_size=4)
    first, second = clients(2, loop)
    front_end.submit(first)
    front_end.loop_once()
    front_end.submit(second)
    front_end.loop_once()
    call = handle.calls[1]
    items = call.get_batches()
    assert call.get_property("batch_size") == "2"
    assert items[0].get_as_bytes("data") == b"" and items[0].get_property("requestId") is None
    assert items[1].get_as_bytes("data") == second.body and items[1].get_property("requestId") == "r1"
    assert items[1].get_property(ROUTE_PROPERTY) == "/invocations"
    assert -(1 << 63) <= int(items[1].get_as_string("seed")) < (1 << 63)   # any int64, may be negative
    assert items[1].content.get(HANDOVER_KEY).plan is second.plan      # in-process hand-over of the plan
    assert items[0].content.get(HANDOVER_KEY) is None            # running items carry nothing
    loop.close()


def test_a_reply_with_the_wrong_count_fails_every_request_and_the_next_call_resets():
    loop = asyncio.new_event_loop()
    handle = ScriptedHandle(last_after=10)
    front_end = RollingFrontEnd(handle, {}, max_batch_size=4)
    a, b = clients(2, loop)
    front_end.submit(a)
    front_end.submit(b)
    handle.wrong_count_once = True
    front_end.loop_once()
    loop.run_until_complete(asyncio.sleep(0))      # let the pushed chunks land
    for client in (a, b):
        (chunk,) = drained(client)
        assert chunk.last and chunk.code == 424
    c = clients(3, loop)[2]
    front_end.submit(c)
    front_end.loop_once()
    assert handle.calls[-1].get_property("reset_rollingbatch") == "true"
    loop.close()


def test_items_whose_entry_says_last_leave_the_batch():
    loop = asyncio.new_event_loop()
    front_end = RollingFrontEnd(ScriptedHandle(last_after=2), {}, max_batch_size=4)
    (client,) = clients(1, loop)
    front_end.submit(client)
    run_steps(front_end, 2)
    loop.run_until_complete(asyncio.sleep(0))
    assert [(c.data, c.last) for c in drained(client)] == [("step1", False), ("step2", True)]
    assert front_end.active == []
    loop.close()


def test_dynamic_front_end_sends_a_batch_of_one_unbatched_and_reads_error_items_by_their_code_property():
    loop = asyncio.new_event_loop()
    seen = []

    def handle(inputs):
        seen.append(inputs)
        answer = OwnOutput()
        answer.add(b'{"error": "bad", "code": 424}', key="data", batch_index=0)
        answer.add_property("batch_0_code", "424")
        return answer

    front_end = DynamicFrontEnd(handle, {}, batch_size=4, max_batch_delay_ms=0)
    (client,) = clients(1, loop)
    front_end.submit(client)
    front_end.loop_once()
    loop.run_until_complete(asyncio.sleep(0))
    assert not seen[0].is_batch() and seen[0].content.get(HANDOVER_KEY).plan is client.plan
    (chunk,) = drained(client)
    assert chunk.code == 424 and chunk.error is None and chunk.data == '{"error": "bad", "code": 424}'
    loop.close()


def test_a_streaming_request_waits_for_a_dynamic_batch_of_its_own():
    loop = asyncio.new_event_loop()
    front_end = DynamicFrontEnd(lambda inputs: None, {}, batch_size=4, max_batch_delay_ms=50)
    plain, streamed = clients(2, loop)
    streamed.plan = make_plan(request_id="r1", wire=Wire.JSONLINES)
    front_end.submit(plain)
    front_end.submit(streamed)
    assert front_end._collect() == [plain]
    assert front_end._collect() == [streamed]
    loop.close()


def test_batch_jobs_get_room_only_while_no_live_request_waits_and_the_reserve_stays_free():
    """FrontEnd.has_room(reserve): the batch jobs' one question (batch/jobs.py); live requests go first."""
    loop = asyncio.new_event_loop()
    front_end = RollingFrontEnd(ScriptedHandle(last_after=100), {}, max_batch_size=4)
    assert (front_end.max_batch_size, front_end.num_active) == (4, 0) and front_end.has_room(reserve=1)
    (live,) = clients(1, loop)
    front_end.submit(live)
    assert not front_end.has_room(reserve=1)              # a live request waits: it goes first
    front_end.loop_once()                                 # ... and joins the active batch
    assert front_end.num_active == 1 and front_end.has_room(reserve=1)
    lines = [ClientRequest(b"{}", loop, request_id=f"line{i}", plan=make_plan(request_id=f"line{i}"), internal=True)
             for i in range(3)]
    front_end.submit(lines[0])
    front_end.submit(lines[1])
    assert front_end.has_room(reserve=1)                  # 1 active + 2 waiting lines: 3 of the 4 - 1 places
    front_end.submit(lines[2])
    assert not front_end.has_room(reserve=1) and front_end.has_room(reserve=0)
    dynamic = DynamicFrontEnd(lambda inputs: None, {}, batch_size=3, max_batch_delay_ms=0)
    assert (dynamic.max_batch_size, dynamic.num_active) == (3, 0)
    loop.close()


def test_an_in_process_caller_gets_the_whole_answers_object_with_its_last_chunk():
    """The handler hands the answer object back through the Handover (handler.py), so the batch jobs never
    parse the JSON text the entry carries."""
    loop = asyncio.new_event_loop()
    answer = {"object": "chat.completion", "choices": []}

    def handle(inputs):
        (item,) = inputs.get_batches()
        item.content.get(HANDOVER_KEY).answered(answer)
        output = OwnOutput()
        output.add(OwnOutput.binary_encode({"data": json.dumps(answer), "last": "true"}), key="data", batch_index=0)
        return output

    front_end = RollingFrontEnd(handle, {}, max_batch_size=2)
    (client,) = clients(1, loop)
    front_end.submit(client)
    front_end.loop_once()
    loop.run_until_complete(asyncio.sleep(0))
    (chunk,) = drained(client)
    assert chunk.last and client.answer is answer and json.loads(chunk.data) == answer
    loop.close()


def test_a_request_refused_by_a_full_queue_is_forgotten_at_once():
    """The queue can fill between reserve() and submit(); the refused request once stayed in the live table
    for good (its body and plan leaked, SIGTERM's drain waited on it; issue 15's storm found it)."""
    loop = asyncio.new_event_loop()
    front_end = RollingFrontEnd(ScriptedHandle(), {}, max_batch_size=1, job_queue_size=1)
    queued, refused = clients(2, loop)
    for client in (queued, refused):
        front_end.track(client)
    assert front_end.submit(queued) and not front_end.submit(refused)
    assert front_end.num_live == 1 and front_end.is_live("r0") and not front_end.is_live("r1")
    loop.close()


def test_a_handle_raising_engine_dead_fails_every_request_with_503_and_the_front_end_stays_unhealthy():
    """engine/health.py: the handler raises EngineDead from the call that found the engine dead on. Every
    request of that call, and every one queued after, ends with a 503 naming the reason; /ping reads `alive`."""
    loop = asyncio.new_event_loop()
    handle = ScriptedHandle(last_after=100)

    def dies_on_second_call(inputs):
        if not inputs.get_batches():             # the initialization call
            return None
        if len(handle.calls) == 1:
            raise EngineDead("every step fails, even with the batch emptied (test)")
        return handle(inputs)

    front_end = RollingFrontEnd(dies_on_second_call, {}, max_batch_size=4)
    front_end.start()
    front_end.ready.wait(5)
    first, second, late = clients(3, loop)
    assert front_end.alive and front_end.failure is None
    front_end.submit(first)
    wait_for(lambda: len(handle.calls) == 1)
    front_end.submit(second)
    wait_for(lambda: not front_end.alive)
    assert "every step fails" in front_end.failure and front_end.thread.is_alive()
    assert not front_end.has_room(reserve=0)        # batch jobs wait (and resume after the restart)
    front_end.submit(late)                        # queued after the death (the race past `alive`)
    wait_for(lambda: loop.run_until_complete(asyncio.sleep(0.01)) is None and late.chunks.qsize() == 1)
    for client in (first, second, late):
        *_, end = drained(client)
        assert (end.code, end.last) == (ENGINE_DEAD_CODE, True) and "every step fails" in end.error
    front_end.stop()
    loop.close()


def test_a_waiting_request_of_a_better_priority_joins_a_full_batch_and_equals_wait_for_a_place():
    loop = asyncio.new_event_loop()
    handle = ScriptedHandle(last_after=100)
    front_end = RollingFrontEnd(handle, {}, max_batch_size=2)

    def ranked(name: str, priority: int) -> ClientRequest:
        return ClientRequest(b'{"inputs": "x"}', loop, request_id=name,
                             plan=make_plan(request_id=name, params=SamplingParams(priority=priority)))

    low = [ranked(f"low{i}", 1) for i in range(4)]
    for client in low:
        front_end.submit(client)
    front_end.loop_once()
    assert [c.request_id for c in front_end.active] == ["low0", "low1"]   # full: the others wait
    high, same = ranked("high", 0), ranked("same", 1)
    front_end.submit(same)
    front_end.submit(high)
    front_end.loop_once()
    assert [c.request_id for c in front_end.active] == ["low0", "low1", "high"]
    assert handle.calls[-1].get_property("batch_size") == "3"
    others = [ranked(f"top{i}", -1) for i in range(3)]
    for client in others:
        front_end.submit(client)
    front_end.loop_once()                      # at most max_batch_size more than the batch holds
    assert [c.request_id for c in front_end.active] == ["low0", "low1", "high", "top0"]
    assert [c.request_id for c in front_end.pending.items] == ["top1", "top2", "low2", "low3", "same"]
    loop.close()
