"""/v1/files and /v1/batches on a real server, driven by the `openai` package (cases C19, C21), plus restart."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.batch.conftest import CHAT, COMPLETIONS, MAX_FILE_BYTES, batch_line, by_custom_id, content, start
from tests.helpers import load_case

pytestmark = pytest.mark.slow

ORDER = ["validating", "in_progress", "finalizing", "completed"]


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def upload(sdk, lines: list):
    return sdk.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")


def poll(sdk, batch_id: str, timeout_s: float = 300, until=("completed", "failed", "cancelled", "expired")):
    """Statuses and request_counts seen every 0.5 s until a terminal status; checks they only move forward."""
    seen, counts = [], []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch_id)
        seen.append(batch.status)
        counts.append(batch.request_counts)
        if batch.status in until:
            return batch, seen, counts
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {seen[-1]} after {timeout_s} s")


def records(sdk, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(t) for t in sdk.files.content(file_id).text.splitlines() if t.strip()]


def test_c19_successes_and_failures_are_counted_and_split_into_output_and_error_files(sdk):
    case = load_case("C19")
    lines = case["request"]["lines"]
    created = sdk.batches.create(input_file_id=upload(sdk, lines).id, **case["request"]["batch"])
    assert (created.object, created.endpoint, created.completion_window) == ("batch", CHAT, "24h")
    assert created.status in ORDER
    batch, seen, counts = poll(sdk, created.id, 180)
    assert batch.status == "completed"
    ranks = [ORDER.index(s) for s in seen]
    assert ranks == sorted(ranks)
    for before, after in zip(counts, counts[1:]):
        assert after.completed >= before.completed and after.failed >= before.failed
    assert all(c.completed + c.failed <= c.total for c in counts)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 4, 2)
    out = by_custom_id(records(sdk, batch.output_file_id))
    assert set(out) == {"ok-1", "ok-2", "ok-3", "ok-4"}
    limits = {line["custom_id"]: line["body"]["max_completion_tokens"] for line in lines}
    for cid, record in out.items():
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["object"] == "chat.completion" and isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["completion_tokens"] <= limits[cid]
    err = by_custom_id(records(sdk, batch.error_file_id))
    assert set(err) == {"bad-temp", "bad-topp"}
    for cid, name in (("bad-temp", "temperature"), ("bad-topp", "top_p")):
        assert err[cid]["response"]["status_code"] == 400 and name in err[cid]["response"]["body"]["error"]["message"]
    direct = sdk.chat.completions.create(**{**lines[0]["body"], "temperature": 0}, model="model")
    assert content(out["ok-1"]) == direct.choices[0].message.content
    assert isinstance(batch.created_at, int) and batch.created_at <= batch.in_progress_at <= batch.completed_at
    for file_id in (batch.output_file_id, batch.error_file_id):
        assert sdk.files.retrieve(file_id).purpose == "batch_output"
    only_bad = sdk.batches.create(input_file_id=upload(sdk, lines[4:]).id, **case["request"]["batch"])
    second, _, _ = poll(sdk, only_bad.id, 120)
    assert second.status == "completed"
    assert (second.request_counts.total, second.request_counts.completed, second.request_counts.failed) == (2, 0, 2)
    assert len(records(sdk, second.error_file_id)) == 2 and records(sdk, second.output_file_id) == []


def test_a_seeded_line_gives_the_same_text_in_a_batch_among_others_and_on_the_live_route(sdk):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_completion_tokens": 8,
            "temperature": 0.9, "seed": 4321}
    others = [batch_line(f"o{i}", {"messages": [{"role": "user", "content": f"Count to {i}."}],
                                   "max_completion_tokens": 4 + i, "temperature": 1.0}) for i in range(4)]
    lines = others[:2] + [batch_line("seeded", body)] + others[2:]
    batch, _, _ = poll(sdk, sdk.batches.create(input_file_id=upload(sdk, lines).id, endpoint=CHAT,
                                               completion_window="24h").id)
    live = sdk.chat.completions.create(model="model", **body)
    assert content(by_custom_id(records(sdk, batch.output_file_id))["seeded"]) == live.choices[0].message.content


def test_c21_unknown_ids_and_bad_create_bodies_are_404_and_400_never_5xx(sdk, server):
    case = load_case("C21")["request"]
    file_id, batch_id = case["unknown_file_id"], case["unknown_batch_id"]
    for call in (sdk.files.retrieve, sdk.files.content, sdk.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(file_id)
    for call in (sdk.batches.retrieve, sdk.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(batch_id)
    before = [b.id for b in sdk.batches.list(limit=100).data]
    with pytest.raises(openai.NotFoundError) as err:
        sdk.batches.create(input_file_id=file_id, **case["batch"])
    assert file_id in str(err.value)
    assert [b.id for b in sdk.batches.list(limit=100).data] == before
    good = upload(sdk, case["lines"]).id
    base = {"input_file_id": good, "endpoint": CHAT, "completion_window": "24h"}
    for missing in ("input_file_id", "endpoint"):
        response = httpx.post(server.url + "/v1/batches", json={k: v for k, v in base.items() if k != missing})
        assert response.status_code == 400 and missing in json.dumps(response.json()["error"])
    for name, value in (("endpoint", "/v1/embeddings"), ("completion_window", "1h")):
        response = httpx.post(server.url + "/v1/batches", json={**base, name: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == name
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = httpx.post(server.url + "/v1/batches", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    deleted = sdk.files.delete(good)
    assert (deleted.id, deleted.object, deleted.deleted) == (good, "file", True)
    for call in (sdk.files.retrieve, sdk.files.content, sdk.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(good)
    assert good not in [f.id for f in sdk.files.list().data]
    with pytest.raises((openai.NotFoundError, openai.BadRequestError)):
        sdk.batches.create(**base)
    assert httpx.get(server.url + "/v1/batches").json()["object"] == "list"
    assert httpx.get(server.url + "/ping").status_code == 200


def test_a_bad_batch_level_default_raises_bad_request_naming_it(sdk):
    file_id = upload(sdk, load_case("C21")["request"]["lines"]).id
    with pytest.raises(openai.BadRequestError) as err:
        sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                           extra_body={"temperature": -1})
    assert "temperature" in str(err.value)


def test_batch_level_defaults_serve_lines_without_their_own_and_no_length_fails_the_file(sdk):
    lines = [batch_line("none", {"prompt": "1, 2, 3,", "ignore_eos": True}, COMPLETIONS),
             batch_line("own", {"prompt": "1, 2, 3,", "max_tokens": 2, "ignore_eos": True}, COMPLETIONS)]
    file_id = upload(sdk, lines).id
    failed, _, _ = poll(sdk, sdk.batches.create(input_file_id=file_id, endpoint=COMPLETIONS,
                                                completion_window="24h").id)
    assert failed.status == "failed" and failed.failed_at is not None
    assert [(e.line, e.code) for e in failed.errors.data] == [(1, "missing_max_tokens")]
    done, _, _ = poll(sdk, sdk.batches.create(input_file_id=file_id, endpoint=COMPLETIONS, completion_window="24h",
                                              metadata={"run": "defaults"},
                                              extra_body={"max_decoding_length": 3}).id)
    out = by_custom_id(records(sdk, done.output_file_id))
    assert done.metadata == {"run": "defaults"}
    assert {cid: r["response"]["body"]["usage"]["completion_tokens"] for cid, r in out.items()} == {"none": 3, "own": 2}


def test_cancel_stops_a_running_batch_and_keeps_the_finished_results(sdk):
    lines = [batch_line(f"c{i:02d}", {"prompt": f"Item {i}:", "max_tokens": 6, "ignore_eos": True}, COMPLETIONS)
             for i in range(80)]
    created = sdk.batches.create(input_file_id=upload(sdk, lines).id, endpoint=COMPLETIONS, completion_window="24h")
    poll(sdk, created.id, 120, until=("in_progress",))
    while sdk.batches.retrieve(created.id).request_counts.completed < 3:
        time.sleep(0.2)
    cancelling = sdk.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch, _, _ = poll(sdk, created.id, 120)
    assert batch.status == "cancelled" and batch.cancelling_at is not None and batch.cancelled_at is not None
    kept = records(sdk, batch.output_file_id)
    assert 3 <= len(kept) == batch.request_counts.completed < 80
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 6 for r in kept)


def test_uploads_over_the_size_limit_answer_413(sdk):
    with pytest.raises(openai.APIStatusError) as err:
        sdk.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 100_000)), purpose="batch")
    assert err.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        sdk.files.create(file=("in.jsonl", b"{}\n"), purpose="fine-tune")


def test_batches_list_newest_first_with_after_and_limit(sdk):
    file_id = upload(sdk, load_case("C21")["request"]["lines"]).id
    ids = [sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id for _ in range(3)]
    page = sdk.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    after = sdk.batches.list(limit=1, after=ids[2])
    assert [b.id for b in after.data] == [ids[1]]
    for batch_id in ids:
        poll(sdk, batch_id, 120)


def test_live_requests_are_served_while_a_batch_runs(sdk):
    lines = [batch_line(f"l{i:02d}", {"prompt": f"Item {i}:", "max_tokens": 8, "ignore_eos": True}, COMPLETIONS)
             for i in range(48)]
    created = sdk.batches.create(input_file_id=upload(sdk, lines).id, endpoint=COMPLETIONS, completion_window="24h")
    poll(sdk, created.id, 120, until=("in_progress",))
    live = sdk.completions.create(model="model", prompt="The sky is", max_tokens=3, temperature=0)
    during = sdk.batches.retrieve(created.id)
    assert live.usage.completion_tokens == 3
    assert during.status == "in_progress" and during.request_counts.completed < 48   # it ran beside the batch
    batch, _, _ = poll(sdk, created.id, 300)
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


def test_the_offline_runner_and_the_live_route_give_a_seeded_line_the_same_text(sdk, runner, tmp_path):
    from tests.batch.conftest import read_jsonl, write_jsonl

    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 99}
    lines = [batch_line("seeded", body, COMPLETIONS),
             *[batch_line(f"o{i}", {"prompt": f"Item {i}:", "max_tokens": 3, "temperature": 1.0}, COMPLETIONS)
               for i in range(3)]]
    runner.run(write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", progress=False)
    offline = by_custom_id(read_jsonl(tmp_path / "out.jsonl"))["seeded"]
    assert content(offline) == sdk.completions.create(model="model", **body).choices[0].text
