"""handle() driven the way the DJL front end drives it (DESIGN §2), on the real demo model."""
from __future__ import annotations

import json

import pytest

from lmi_handler import handler
from lmi_handler.djl import OwnInput, PairList, binary_decode
from tests.helpers import SMALL_KV_CACHE_BYTES

pytestmark = pytest.mark.slow


def init_handler(model_dir, **options) -> handler.Handler:
    """A Handler of its own (a fresh worker), initialized as the front end does it."""
    worker = handler.Handler()
    props = {"model_id": str(model_dir), "max_rolling_batch_size": "8", "device_id": "-1",
             "cluster_size": 1, "handler": "handle", "kv_cache_bytes": str(SMALL_KV_CACHE_BYTES), **options}
    assert worker.handle(OwnInput(props)) is None  # initialization call: properties, empty content
    return worker


def rolling_call(items: list[tuple[str, bytes | None]], reset: bool = False) -> OwnInput:
    """items: (request_id, body) for new requests, (request_id, None) for running ones (empty data)."""
    props = {"batch_size": str(len(items))}
    if reset:
        props["reset_rollingbatch"] = "true"
    content = PairList()
    for i, (request_id, body) in enumerate(items):
        content.add(f"batch_{i:03d}.data", body or b"")
        if body is not None:
            props[f"batch_{i:03d}.Content-Type"] = "application/json"
            props[f"batch_{i:03d}.requestId"] = request_id
            content.add(f"batch_{i:03d}.seed", b"-123456789")
    return OwnInput(props, content)


def decode(output, n: int) -> list[dict]:
    assert output.code == 200
    assert output.content.size() == n
    entries = []
    for i in range(n):
        assert output.content.key_at(i) == f"batch_{i}.data"
        entry = binary_decode(output.content.value_at(i))
        assert entry["content_type"] == output.properties[f"batch_{i}_Content-Type"]
        assert entry["request_id"] == output.properties[f"batch_{i}_requestId"]
        entries.append(entry)
    return entries


def body(inputs: str, stream: bool = True, **params) -> bytes:
    return json.dumps({"inputs": inputs, "parameters": params, "stream": stream}).encode()


def test_rolling_steps_keep_front_end_order_and_answer_one_entry_per_item(model_dir):
    worker = init_handler(model_dir)
    call = rolling_call([("a", body("The sky is", max_new_tokens=2)), ("b", body("Hello", max_new_tokens=6)),
                         ("c", body("One, two,", stream=False, max_new_tokens=6))])
    first = decode(worker.handle(call), 3)
    assert [e["request_id"] for e in first] == ["a", "b", "c"]
    assert [e["last"] for e in first] == ["false", "false", "false"]
    assert json.loads(first[0]["data"])["token"]["text"] is not None      # streaming: a token line per step
    assert first[0]["content_type"] == "application/jsonlines"
    assert first[2]["data"] == "" and first[2]["content_type"] == "application/json"  # json: nothing until the end

    # a and b running (empty data), c running, d new appended at the end
    second = decode(worker.handle(rolling_call([("a", None), ("b", None), ("c", None),
                                                 ("d", body("Bad", temperature=-1))])), 4)
    assert second[0]["last"] == "true"                                   # a hit max_new_tokens=2
    final_a = json.loads(second[0]["data"].splitlines()[-1])
    assert final_a["generated_text"] == json.loads(first[0]["data"])["token"]["text"] + final_a["token"]["text"]
    assert second[3]["last"] == "true" and second[3]["code"] == "424" and "temperature" in second[3]["error"]
    assert second[3]["data"] == ""

    # a and d left on both sides; b, c remain in order and run to the end
    pending = {"b": first[1]["data"] + second[1]["data"], "c": first[2]["data"] + second[2]["data"]}
    for _ in range(10):
        ids = [rid for rid in ("b", "c") if rid in pending and pending[rid] is not None]
        entries = decode(worker.handle(rolling_call([(rid, None) for rid in ids])), len(ids))
        for rid, entry in zip(ids, entries):
            pending[rid] += entry["data"]
            if entry["last"] == "true":
                done = pending.pop(rid)
                pending[rid + "_done"] = done
                pending[rid] = None
        if pending["b"] is None and pending["c"] is None:
            break
    doc = json.loads(pending["c_done"])
    assert isinstance(doc["generated_text"], str) and doc["generated_text"]
    lines = [json.loads(line) for line in pending["b_done"].splitlines()]
    assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"]
    assert len(lines) == 6  # max_new_tokens=6: one line per token


def test_reset_rollingbatch_drops_state_and_counts_every_item_as_new(model_dir):
    worker = init_handler(model_dir)
    decode(worker.handle(rolling_call([("x", body("Hi", max_new_tokens=20))])), 1)
    entries = decode(worker.handle(rolling_call([("y", body("Hello", max_new_tokens=1))], reset=True)), 1)
    assert entries[0]["request_id"] == "y" and entries[0]["last"] == "true"
    assert not worker.service.engine.has_unfinished


def test_dynamic_batch_answers_each_item_a_list_of_generated_text(model_dir):
    worker = init_handler(model_dir, rolling_batch="disable")
    props = {"batch_size": "3"}
    content = PairList()
    bodies = [{"inputs": ["The sky is", "Grass is"], "parameters": {"max_new_tokens": 4}},
              {"inputs": "Water is", "parameters": {"max_new_tokens": 3, "details": True}},
              {"inputs": "Oops", "parameters": {"top_k": -5}}]
    for i, b in enumerate(bodies):
        content.add(f"batch_{i:03d}.data", json.dumps(b).encode())
    output = worker.handle(OwnInput(props, content))
    assert output.content.size() == 3
    first, second, third = (json.loads(output.content.value_at(i)) for i in range(3))
    assert [type(a["generated_text"]) for a in first] == [str, str]
    assert second[0]["details"]["generated_tokens"] == 3
    assert third["code"] == 424 and "top_k" in third["error"]


def test_cancel_property_ends_a_running_request_and_frees_its_blocks(model_dir):
    worker = init_handler(model_dir)
    decode(worker.handle(rolling_call([("k", body("Tell me a story", max_new_tokens=500)),
                                        ("m", body("Hi", max_new_tokens=3))])), 2)
    call = rolling_call([("k", None), ("m", None)])
    call.properties["batch_000.X-Lmi-Cancel"] = "true"
    entries = decode(worker.handle(call), 2)
    assert entries[0]["last"] == "true" and "code" not in entries[0]
    assert entries[1]["last"] == "false"  # the other request goes on
    engine = worker.service.engine
    assert "k" not in engine.seqs and "m" in engine.seqs
    entries = decode(worker.handle(rolling_call([("m", None)])), 1)
    assert entries[0]["last"] == "true"
    assert engine.allocator.num_used_blocks == 0


def test_dynamic_batch_stream_answers_with_stream_content_of_outputs_lines(model_dir):
    worker = init_handler(model_dir, rolling_batch="disable")
    call = OwnInput({"Content-Type": "application/json"},
                    PairList([("data", json.dumps({"inputs": ["A", "B"], "stream": True,
                                                   "parameters": {"max_new_tokens": 3}}).encode())]))
    output = worker.handle(call)
    stream, _ = output.stream_content
    rows = [json.loads(line)["outputs"] for line in stream]
    assert rows and all(len(row) == 2 for row in rows)
    assert not worker.service.engine.has_unfinished


def test_the_module_entry_point_is_the_containers_one_handler(model_dir):
    """DJL imports `lmi_handler.handler` and calls its `handle`: one Handler per worker process, initialized
    by the first call. (The bundled server makes a Handler of its own, so nothing here swaps a global.)"""
    props = {"model_id": str(model_dir), "max_rolling_batch_size": "2", "device_id": "-1", "cluster_size": 1,
             "kv_cache_bytes": str(SMALL_KV_CACHE_BYTES)}
    assert handler.handle(OwnInput(props)) is None
    (entry,) = decode(handler.handle(rolling_call([("solo", body("Hi", stream=False, max_new_tokens=2))])), 1)
    for _ in range(3):                 # a whole answer comes in the step that finishes it
        if entry["last"] == "true":
            break
        (entry,) = decode(handler.handle(rolling_call([("solo", None)])), 1)
    assert entry["last"] == "true" and json.loads(entry["data"])["generated_text"]
    assert handler.handle(OwnInput(props)) is None           # an empty call again: no second model
