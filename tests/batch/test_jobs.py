"""batch/jobs.py on a real server, driven by the `openai` package: lines share the batch with live requests,
batch-level defaults, cancel, restart, the same text as the live route and the offline runner, and storage
failures (the quota, a full disk) that fail one job and nothing else.
"""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.batch.helpers import (
    CHAT,
    COMPLETIONS,
    batch_line,
    by_custom_id,
    content,
    format_example_lines,
    jsonl,
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


# ---- storage: the quota over batch_dir, and a full disk while a job writes --------------------------------

QUOTA = 300_000      # option.batch_max_total_bytes of this server (its upload limit stays MAX_FILE_BYTES)


@pytest.fixture(scope="module")
def quota_server(model_dir, tmp_path_factory):
    batch_dir = tmp_path_factory.mktemp("quota")
    with start(tmp_path_factory, batch_dir, "quota", batch_max_total_bytes=str(QUOTA)) as running:
        running.batch_dir = batch_dir
        running.sdk = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        yield running


def used_bytes(folder) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def short_lines(prefix: str, count: int, max_tokens: int = 4) -> list[dict]:
    return [batch_line(f"{prefix}{i}", {"prompt": f"Item {i}:", "max_tokens": max_tokens, "ignore_eos": True},
                       COMPLETIONS) for i in range(count)]


def check_store_readable(server, batch_id: str) -> None:
    """The server answers, its SQLite state reads back whole, and a new job still runs to the end."""
    sdk = server.sdk
    assert httpx.get(server.url + "/ping").status_code == 200
    assert batch_id in [b.id for b in sdk.batches.list(limit=100).data] and sdk.files.list().data
    done, _, _ = poll(sdk, sdk.batches.create(input_file_id=upload(sdk, short_lines("after", 2)).id,
                                              endpoint=COMPLETIONS, completion_window="24h").id)
    assert (done.status, done.request_counts.completed) == ("completed", 2)


def test_an_upload_past_the_quota_is_413_naming_it_and_a_job_whose_results_pass_it_fails(quota_server):
    sdk = quota_server.sdk
    first = sdk.files.create(file=("a.jsonl", jsonl(["{}"] * 50_000)), purpose="batch")   # 150 kB, under 200 kB
    with pytest.raises(openai.APIStatusError) as refused:
        sdk.files.create(file=("b.jsonl", jsonl(["{}"] * 50_000)), purpose="batch")
    assert refused.value.status_code == 413 and refused.value.body["param"] == "file"
    assert f"batch_max_total_bytes = {QUOTA}" in refused.value.message
    data = jsonl(short_lines("q", 3))
    room_after_input = 1_000                       # less than two result records take
    filler = QUOTA - used_bytes(quota_server.batch_dir) - len(data) - room_after_input
    padding = sdk.files.create(file=("pad.jsonl", jsonl(["{}"] * (filler // 3))), purpose="batch")
    created = sdk.batches.create(input_file_id=sdk.files.create(file=("in.jsonl", data), purpose="batch").id,
                                 endpoint=COMPLETIONS, completion_window="24h")
    failed, _, _ = poll(sdk, created.id)
    assert failed.status == "failed" and failed.output_file_id is None
    (error,) = failed.errors.data
    assert error.code == "storage_error" and f"batch_max_total_bytes = {QUOTA}" in error.message
    for file in (padding, first):
        sdk.files.delete(file.id)
    check_store_readable(quota_server, created.id)


def test_a_full_disk_while_a_job_writes_fails_that_job_naming_enospc_and_the_server_goes_on(quota_server):
    """ENOSPC for real: the job's output file is a link to /dev/full, whose every write the kernel refuses with
    ENOSPC. The link is made while the job waits behind another job (one job runs at a time)."""
    sdk = quota_server.sdk
    ahead = sdk.batches.create(input_file_id=upload(sdk, short_lines("ahead", 200, 8)).id, endpoint=COMPLETIONS,
                               completion_window="24h")
    poll(sdk, ahead.id, until=("in_progress",))
    doomed = sdk.batches.create(input_file_id=upload(sdk, short_lines("doomed", 3)).id, endpoint=COMPLETIONS,
                                completion_window="24h")
    work = quota_server.batch_dir / "work" / doomed.id
    work.mkdir(parents=True)
    (work / "output.jsonl").symlink_to("/dev/full")
    assert sdk.batches.retrieve(doomed.id).status == "validating"          # it has not started writing
    sdk.batches.cancel(ahead.id)
    failed, _, _ = poll(sdk, doomed.id)
    assert failed.status == "failed" and failed.failed_at is not None and failed.output_file_id is None
    (error,) = failed.errors.data
    assert error.code == "storage_error" and "No space left on device (ENOSPC)" in error.message
    assert poll(sdk, ahead.id)[0].status == "cancelled"
    check_store_readable(quota_server, doomed.id)


def test_a_job_running_when_the_engine_dies_loses_no_line_and_completes_after_the_restart(model_dir, tmp_path_factory):
    """Lines the dead engine could not answer get no record (not the lines' fault): the job stays in_progress,
    the process exits for its supervisor, and the restarted server runs just those lines."""
    batch_dir = tmp_path_factory.mktemp("dies")
    lines = short_lines("line", 60, 6)
    with start(tmp_path_factory, batch_dir, "dies", fault_injection="broken:prefill@Zebras",
               engine_dead_exit_s="1") as first:
        sdk = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0)
        created = sdk.batches.create(input_file_id=upload(sdk, lines).id, endpoint=COMPLETIONS,
                                     completion_window="24h")
        while sdk.batches.retrieve(created.id).request_counts.completed < 5:
            time.sleep(0.1)
        dying = httpx.post(first.url + "/invocations", json={"inputs": "Zebras run"}, timeout=60)
        assert dying.status_code == 503
        assert first.proc.wait(timeout=30) == 3
    with start(tmp_path_factory, batch_dir, "restarted") as second:
        sdk = openai.OpenAI(base_url=second.url + "/v1", api_key="unused", max_retries=0)
        batch, _, _ = poll(sdk, created.id, 300)
        assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 60, 0)
        assert sorted(r["custom_id"] for r in records(sdk, batch.output_file_id)) == sorted(
            line["custom_id"] for line in lines)
