"""batch/jobs.py on a real server, driven by the `openai` package: lines share the batch with live requests,
batch-level defaults, cancel, restart, and the same text as the live route and the offline runner.
"""
from __future__ import annotations

import time

import openai
import pytest

from tests.batch.helpers import (
    CHAT,
    COMPLETIONS,
    batch_line,
    by_custom_id,
    content,
    format_example_lines,
    poll,
    read_jsonl,
    records,
    start,
    upload,
    write_jsonl,
)

pytestmark = pytest.mark.slow




def test_a_seeded_line_gives_the_same_text_in_a_batch_among_others_and_on_the_live_route(batch_sdk):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_completion_tokens": 8,
            "temperature": 0.9, "seed": 4321}
    others = [batch_line(f"o{i}", {"messages": [{"role": "user", "content": f"Count to {i}."}],
                                   "max_completion_tokens": 4 + i, "temperature": 1.0}) for i in range(4)]
    lines = others[:2] + [batch_line("seeded", body)] + others[2:]
    batch, _, _ = poll(batch_sdk, batch_sdk.batches.create(input_file_id=upload(batch_sdk, lines).id, endpoint=CHAT,
                                               completion_window="24h").id)
    live = batch_sdk.chat.completions.create(model="model", **body)
    assert content(by_custom_id(records(batch_sdk, batch.output_file_id))["seeded"]) == live.choices[0].message.content


def test_batch_level_defaults_serve_lines_without_their_own_and_no_length_fails_the_file(batch_sdk):
    lines = [batch_line("none", {"prompt": "1, 2, 3,", "ignore_eos": True}, COMPLETIONS),
             batch_line("own", {"prompt": "1, 2, 3,", "max_tokens": 2, "ignore_eos": True}, COMPLETIONS)]
    file_id = upload(batch_sdk, lines).id
    failed, _, _ = poll(batch_sdk, batch_sdk.batches.create(input_file_id=file_id, endpoint=COMPLETIONS,
                                                completion_window="24h").id)
    assert failed.status == "failed" and failed.failed_at is not None
    assert [(e.line, e.code) for e in failed.errors.data] == [(1, "missing_max_tokens")]
    done, _, _ = poll(batch_sdk, batch_sdk.batches.create(input_file_id=file_id, endpoint=COMPLETIONS, completion_window="24h",
                                              metadata={"run": "defaults"},
                                              extra_body={"max_decoding_length": 3}).id)
    out = by_custom_id(records(batch_sdk, done.output_file_id))
    assert done.metadata == {"run": "defaults"}
    assert {cid: r["response"]["body"]["usage"]["completion_tokens"] for cid, r in out.items()} == {"none": 3, "own": 2}


def test_cancel_stops_a_running_batch_and_keeps_the_finished_results(batch_sdk):
    lines = [batch_line(f"c{i:02d}", {"prompt": f"Item {i}:", "max_tokens": 6, "ignore_eos": True}, COMPLETIONS)
             for i in range(80)]
    created = batch_sdk.batches.create(input_file_id=upload(batch_sdk, lines).id, endpoint=COMPLETIONS, completion_window="24h")
    poll(batch_sdk, created.id, 120, until=("in_progress",))
    while batch_sdk.batches.retrieve(created.id).request_counts.completed < 3:
        time.sleep(0.2)
    cancelling = batch_sdk.batches.cancel(created.id)
    assert cancelling.status == "cancelling"     # the worker acts on it after the route has answered
    batch, _, _ = poll(batch_sdk, created.id, 120)
    assert batch.status == "cancelled" and batch.cancelling_at is not None and batch.cancelled_at is not None
    kept = records(batch_sdk, batch.output_file_id)
    assert 3 <= len(kept) == batch.request_counts.completed < 80
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 6 for r in kept)


def test_live_requests_are_served_while_a_batch_runs(batch_sdk):
    lines = [batch_line(f"l{i:02d}", {"prompt": f"Item {i}:", "max_tokens": 8, "ignore_eos": True}, COMPLETIONS)
             for i in range(48)]
    created = batch_sdk.batches.create(input_file_id=upload(batch_sdk, lines).id, endpoint=COMPLETIONS, completion_window="24h")
    poll(batch_sdk, created.id, 120, until=("in_progress",))
    live = batch_sdk.completions.create(model="model", prompt="The sky is", max_tokens=3, temperature=0)
    during = batch_sdk.batches.retrieve(created.id)
    assert live.usage.completion_tokens == 3
    assert during.status == "in_progress" and during.request_counts.completed < 48   # it ran beside the batch
    batch, _, _ = poll(batch_sdk, created.id, 300)
    assert batch.request_counts.completed == 48


def test_a_server_restart_during_a_batch_loses_no_line_and_repeats_none(model_dir, tmp_path_factory):
    batch_dir = tmp_path_factory.mktemp("restart")
    lines = [batch_line(f"req-{i:03d}", {"prompt": f"Item {i}:", "max_tokens": 2, "ignore_eos": True}, COMPLETIONS)
             for i in range(200)]
    with start(tmp_path_factory, batch_dir, "before-restart") as first:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0)
        created = client.batches.create(input_file_id=upload(client, lines).id, endpoint=COMPLETIONS,
                                        completion_window="24h")
        deadline = time.monotonic() + 300
        while client.batches.retrieve(created.id).request_counts.completed < 30 and time.monotonic() < deadline:
            time.sleep(0.1)
        first.proc.kill()   # no shutdown: as a crash
        first.proc.wait(timeout=30)
    with start(tmp_path_factory, batch_dir, "after-restart") as second:
        client = openai.OpenAI(base_url=second.url + "/v1", api_key="unused", max_retries=0)
        resumed = client.batches.retrieve(created.id)
        assert resumed.status == "in_progress" and 30 <= resumed.request_counts.completed < 200
        batch, _, _ = poll(client, created.id, 300)
        assert batch.status == "completed" and batch.request_counts.completed == 200
        out = records(client, batch.output_file_id)
        assert sorted(r["custom_id"] for r in out) == [line["custom_id"] for line in lines]   # each exactly once


def test_the_offline_runner_and_the_live_route_give_a_seeded_line_the_same_text(batch_sdk, runner, tmp_path):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 99}
    lines = [batch_line("seeded", body, COMPLETIONS),
             *[batch_line(f"o{i}", {"prompt": f"Item {i}:", "max_tokens": 3, "temperature": 1.0}, COMPLETIONS)
               for i in range(3)]]
    runner.run(write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", progress=False)
    offline = by_custom_id(read_jsonl(tmp_path / "out.jsonl"))["seeded"]
    assert content(offline) == batch_sdk.completions.create(model="model", **body).choices[0].text


def test_the_format_example_lines_run_with_any_model_through_v1_batches(batch_sdk, runner, tmp_path):
    """The same lines as offline (test_runner), through /v1/files + /v1/batches (one batch per endpoint): every
    one completes, answered by the served model, with the offline runner's greedy texts."""
    lines = format_example_lines()
    runner.run(write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", progress=False)
    offline = {cid: content(r) for cid, r in by_custom_id(read_jsonl(tmp_path / "out.jsonl")).items()}
    served = {}
    for endpoint in (CHAT, COMPLETIONS):
        part = [line for line in lines if line["url"] == endpoint]
        created = batch_sdk.batches.create(input_file_id=upload(batch_sdk, part).id, endpoint=endpoint,
                                           completion_window="24h")
        batch, _, _ = poll(batch_sdk, created.id)
        assert batch.status == "completed" and batch.error_file_id is None
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (len(part), len(part), 0)
        served.update(by_custom_id(records(batch_sdk, batch.output_file_id)))
    assert {r["response"]["body"]["model"] for r in served.values()} == {runner.service.model_name}
    assert {cid: content(r) for cid, r in served.items()} == offline
