"""handle() driven the way the DJL front end drives it (DESIGN §2), on the real demo model."""
from __future__ import annotations

import json
import os

import pytest

from lmi_handler import handler
from lmi_handler.djl import OwnInput, PairList, binary_decode
from lmi_handler.engine.health import EngineDead
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


# ---- a dead engine (engine/health.py): handle() raises, so DJL's worker recovery runs --------------------

BREAKS_ENGINE = "broken:prefill@Zebras"     # engine/faults.py: from the step prefilling "Zebras", every step fails


def test_rolling_handle_raises_once_the_engine_is_dead_and_on_every_call_after(model_dir):
    worker = init_handler(model_dir, fault_injection=BREAKS_ENGINE)
    decode(worker.handle(rolling_call([("a", body("The sky is", max_new_tokens=50))])), 1)
    decode(worker.handle(rolling_call([("a", None)])), 1)              # a is decoding
    with pytest.raises(EngineDead, match="probe") as dead:
        worker.handle(rolling_call([("a", None), ("z", body("Zebras run", max_new_tokens=4))]))
    assert not worker.health.alive and dead.value.reason == worker.health.dead.reason
    engine = worker.service.engine
    assert not engine.seqs and engine.allocator.num_used_blocks == 0   # every sequence dropped, blocks freed
    for call in (rolling_call([("late", body("Hello", max_new_tokens=2))]),
                 rolling_call([("late", body("Hello", max_new_tokens=2))], reset=True)):
        with pytest.raises(EngineDead):
            worker.handle(call)
    assert not engine.seqs


def test_a_request_error_and_a_per_request_fault_leave_the_engine_alive(model_dir):
    """A bad request (DJL answers its item 424) and a fault that stays with its sequence are not a dead engine."""
    worker = init_handler(model_dir, fault_injection="prefill@Unlucky")
    bad, faulted = decode(worker.handle(rolling_call([("bad", body("Hi", top_k=-5)),
                                                      ("f", body("Unlucky day", max_new_tokens=3))])), 2)
    assert bad["code"] == faulted["code"] == "424" and "top_k" in bad["error"]
    (ok,) = decode(worker.handle(rolling_call([("ok", body("Hi", stream=False, max_new_tokens=1))])), 1)
    assert ok["last"] == "true" and json.loads(ok["data"])["generated_text"] and worker.health.alive


def test_dynamic_handle_raises_once_the_engine_is_dead(model_dir):
    worker = init_handler(model_dir, rolling_batch="disable", fault_injection=BREAKS_ENGINE)

    def call(*inputs: str) -> OwnInput:
        content = PairList()
        for i, text in enumerate(inputs):
            content.add(f"batch_{i:03d}.data", json.dumps({"inputs": text, "parameters": {"max_new_tokens": 2}}).encode())
        return OwnInput({"batch_size": str(len(inputs))}, content)

    output = worker.handle(call("The sky is", "Grass is"))
    assert [json.loads(output.content.value_at(i))[0]["generated_text"] for i in range(2)] != ["", ""]
    with pytest.raises(EngineDead, match="probe"):
        worker.handle(call("Water is", "Zebras run"))
    assert not worker.health.alive and not worker.service.engine.seqs
    with pytest.raises(EngineDead):
        worker.handle(call("Hello"))


def test_a_dynamic_stream_that_finds_the_engine_dead_raises_from_its_stream(model_dir):
    worker = init_handler(model_dir, rolling_batch="disable", fault_injection=BREAKS_ENGINE)
    output = worker.handle(OwnInput({"Content-Type": "application/json"}, PairList([("data", json.dumps(
        {"inputs": ["Zebras run"], "stream": True, "parameters": {"max_new_tokens": 2}}).encode())])))
    stream, _ = output.stream_content
    with pytest.raises(EngineDead, match="probe"):
        list(stream)
    assert not worker.health.alive and not worker.service.engine.seqs


# ---- tensor parallelism through handle() (option.tensor_parallel_degree; engine/parallel/) ----------------

TP_PROMPTS = ["The capital of France is", "Write a haiku about rain:", "1, 2, 3, 4,", "def fib(n):",
              "Once upon a time", "The sky is blue because", "Hello, my name is", "Water boils at"]
TP_NEW_TOKENS = 6
# |log_prob(TP) - log_prob(one process)| of each generated token: the row-parallel sums round elsewhere
TP_LOGPROB_TOL = 1e-3


def greedy_answers(worker, prompts: list[str]) -> list[list[tuple[int, float]]]:
    """All prompts in one rolling batch, even ones streamed (jsonlines), odd ones answered whole (details):
    each answer's (token id, log_prob) list, run to its end."""
    items = [(f"p{i}", body(p, stream=i % 2 == 0, max_new_tokens=TP_NEW_TOKENS, details=True))
             for i, p in enumerate(prompts)]
    data, active = {rid: "" for rid, _ in items}, [rid for rid, _ in items]
    call = rolling_call(items)
    for _ in range(TP_NEW_TOKENS + 3):
        entries = decode(worker.handle(call), len(active))
        for rid, entry in zip(active, entries):
            assert "error" not in entry, entry
            data[rid] += entry["data"]
        active = [rid for rid, entry in zip(active, entries) if entry["last"] != "true"]
        if not active:
            break
        call = rolling_call([(rid, None) for rid in active])
    answers = []
    for i, (rid, _) in enumerate(items):
        if i % 2 == 0:
            lines = [json.loads(line) for line in data[rid].splitlines()]
            assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"]
            answers.append([(line["token"]["id"], line["token"]["log_prob"]) for line in lines])
        else:
            answers.append([(t["id"], t["log_prob"]) for t in json.loads(data[rid])["details"]["tokens"]])
    return answers


def assert_same_greedy_answers(tp_answers, answers) -> None:
    for tp, one in zip(tp_answers, answers):
        assert [t for t, _ in tp] == [t for t, _ in one]
        assert max(abs(a - b) for (_, a), (_, b) in zip(tp, one)) < TP_LOGPROB_TOL


def test_tensor_parallel_3_on_the_demo_model_answers_as_one_process(model_dir):
    """Three ranks (three query heads and one KV head each, spawned by handle()'s init call) give the
    one-process greedy tokens on 8 prompts, streamed and not, log-probs within TP_LOGPROB_TOL."""
    answers = greedy_answers(init_handler(model_dir), TP_PROMPTS)
    worker = init_handler(model_dir, tensor_parallel_degree="3")
    try:
        assert worker.service.engine.runner.degree == 3
        assert_same_greedy_answers(greedy_answers(worker, TP_PROMPTS), answers)
    finally:
        worker.service.engine.runner.close()


def test_tensor_parallel_2_on_a_tiny_random_llama_answers_as_one_process(tmp_path):
    from tests.engine.helpers import TINY_TOKENIZER_TEXTS, build_tiny_llama, build_tiny_tokenizer

    build_tiny_llama(tmp_path, tie_word_embeddings=False)
    build_tiny_tokenizer().save_pretrained(tmp_path)
    prompts = (TINY_TOKENIZER_TEXTS + ["Hello there", "The mat"])[:8]
    answers = greedy_answers(init_handler(tmp_path), prompts)
    worker = init_handler(tmp_path, tensor_parallel_degree="2")
    try:
        assert_same_greedy_answers(greedy_answers(worker, prompts), answers)
    finally:
        worker.service.engine.runner.close()


def test_under_the_mpi_launch_rank_1s_init_call_is_its_follower_loop(tmp_path, monkeypatch):
    """LMI's MPI launch (OMPI_COMM_WORLD_RANK set): rank 1 is a real process whose only handle() call, the
    init call, serves rank 0's steps and returns None once rank 0 shuts down; rank 0 (this process) answers
    as one process would."""
    import subprocess
    import sys

    from tests.engine.helpers import TINY_TOKENIZER_TEXTS, build_tiny_llama, build_tiny_tokenizer
    from tests.helpers import REPO, free_port

    build_tiny_llama(tmp_path, tie_word_embeddings=False)
    build_tiny_tokenizer().save_pretrained(tmp_path)
    answers = greedy_answers(init_handler(tmp_path), TINY_TOKENIZER_TEXTS[:2])
    port = str(free_port())
    launch = {"OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    props = {"model_id": str(tmp_path), "tensor_parallel_degree": "2", "kv_cache_bytes": str(SMALL_KV_CACHE_BYTES)}
    script = ("import sys; from lmi_handler.handler import Handler; from lmi_handler.djl import OwnInput; "
              f"out = Handler().handle(OwnInput({props!r})); print('init call returned', out); sys.exit(0)")
    follower = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, **launch, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    try:
        for key, value in {**launch, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        worker = init_handler(tmp_path, tensor_parallel_degree="2")
        assert worker.service.engine.runner.degree == 2
        assert_same_greedy_answers(greedy_answers(worker, TINY_TOKENIZER_TEXTS[:2]), answers)
        worker.service.engine.runner.close()          # Shutdown: rank 1's init call returns
        out, _ = follower.communicate(timeout=60)
        assert follower.returncode == 0 and "init call returned None" in out
    finally:
        follower.kill()
