"""Request cases on batch files: a bad line never stops the others (C15), per-request lengths and batch
defaults (C18), offline; counts and split files (C19), unknown ids and bad bodies (C21), on /v1/batches.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from lmi_handler.protocol.batch_lines import DEFAULTS_WARNING, BatchDefaults
from tests.batch.helpers import (
    CHAT,
    ORDER,
    by_custom_id,
    completion_tokens,
    content,
    finish_reason,
    poll,
    read_jsonl,
    records,
    run_cli,
    upload,
    write_jsonl,
)
from tests.helpers import load_case

pytestmark = pytest.mark.slow






def test_c15_one_bad_line_never_stops_the_others(tmp_path, runner):
    case = load_case("C15")
    source = write_jsonl(tmp_path / "in.jsonl", case["request"]["lines"])
    done = run_cli(str(source), "-o", str(tmp_path / "out.jsonl"), "--quiet")
    assert done.returncode == 0, done.stderr
    records = read_jsonl(tmp_path / "out.jsonl")
    named = by_custom_id([r for r in records if r["custom_id"] is not None])
    assert set(named) == {"ok-chat", "bad-url", "bad-stream", "ok-prompt"}
    for ok in ("ok-chat", "ok-prompt"):
        assert named[ok]["response"]["status_code"] == 200 and content(named[ok])
    assert completion_tokens(named["ok-chat"]) <= 5 and completion_tokens(named["ok-prompt"]) <= 6
    assert "/v1/embeddings" in named["bad-url"]["error"]["message"]
    assert "stream" in named["bad-stream"]["error"]["message"]
    unnamed = [r for r in records if r["custom_id"] is None]
    assert len(unnamed) == 1 and unnamed[0]["error"]["line"] == 5 and "line 5" in unnamed[0]["error"]["message"]
    again = runner.run(source, tmp_path / "again.jsonl", progress=False)   # the same file, run again
    assert again.completed == 2
    assert content(by_custom_id(read_jsonl(tmp_path / "again.jsonl"))["ok-chat"]) == content(named["ok-chat"])


def c18_limits(lines: list[dict], max_decoding_length: int) -> dict[str, int]:
    limits = {}
    for line in lines:
        body = line["body"]
        limits[line["custom_id"]] = body.get("max_completion_tokens") or body.get("max_tokens") or max_decoding_length
    return limits


def test_c18_per_request_lengths_and_temperatures_beat_the_batch_defaults(tmp_path, runner):
    case = load_case("C18")
    lines, args = case["request"]["lines"], case["request"]["args"]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    done = run_cli(str(source), "-o", str(tmp_path / "out.jsonl"), *args, "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(DEFAULTS_WARNING) == 1 and "temperature" in done.stderr
    records = by_custom_id(read_jsonl(tmp_path / "out.jsonl"))
    assert set(records) == {line["custom_id"] for line in lines}
    assert all(r["response"]["status_code"] == 200 for r in records.values())
    tokens = {cid: completion_tokens(r) for cid, r in records.items()}
    assert (tokens["p-mct"], tokens["p-mt"], tokens["p-none"]) == (6, 3, 7)
    assert all(finish_reason(records[cid]) == "length" for cid in ("p-mct", "p-mt", "p-none"))
    assert tokens["c-mct"] <= 5 and tokens["c-mt"] <= 4 and tokens["c-both"] <= 2 and tokens["c-none"] <= 7
    for cid, limit in c18_limits(lines, 7).items():   # the case's two implications, not an "iff": a sampled
        reason = finish_reason(records[cid])            # line whose EOS is its last allowed token ends 'stop'
        assert reason in ("length", "stop"), (cid, reason)
        if reason == "length":
            assert tokens[cid] == limit, (cid, tokens[cid], limit)
        if tokens[cid] < limit:
            assert reason == "stop", (cid, reason, tokens[cid], limit)
    greedy = ("c-greedy", "p-mct", "p-mt", "p-none")
    hot = BatchDefaults(max_decoding_length=7, temperature=1.3)
    runner.run(source, tmp_path / "again.jsonl", defaults=hot, progress=False)
    runner.run(source, tmp_path / "cold.jsonl", defaults=BatchDefaults(max_decoding_length=7), progress=False)
    again, cold = (by_custom_id(read_jsonl(tmp_path / name)) for name in ("again.jsonl", "cold.jsonl"))
    for cid in greedy:
        assert content(records[cid]) == content(again[cid]) == content(cold[cid])


def test_c18_without_a_batch_length_the_file_is_rejected_before_any_generation(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", load_case("C18")["request"]["lines"])
    done = run_cli(str(source), "-o", str(tmp_path / "out.jsonl"), "--temperature", "1.3", timeout=60)
    assert done.returncode != 0
    assert "p-none" in done.stderr and "c-none" in done.stderr and "line 3" in done.stderr and "line 7" in done.stderr
    assert read_jsonl(tmp_path / "out.jsonl") == []
    assert "engine ready" not in done.stderr   # refused before the model was even loaded


def test_c19_successes_and_failures_are_counted_and_split_into_output_and_error_files(batch_sdk):
    case = load_case("C19")
    lines = case["request"]["lines"]
    created = batch_sdk.batches.create(input_file_id=upload(batch_sdk, lines).id, **case["request"]["batch"])
    assert (created.object, created.endpoint, created.completion_window) == ("batch", CHAT, "24h")
    assert created.status in ORDER
    batch, seen, counts = poll(batch_sdk, created.id, 180)
    assert batch.status == "completed"
    ranks = [ORDER.index(s) for s in seen]
    assert ranks == sorted(ranks)
    for before, after in zip(counts, counts[1:]):
        assert after.completed >= before.completed and after.failed >= before.failed
    assert all(c.completed + c.failed <= c.total for c in counts)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 4, 2)
    out = by_custom_id(records(batch_sdk, batch.output_file_id))
    assert set(out) == {"ok-1", "ok-2", "ok-3", "ok-4"}
    limits = {line["custom_id"]: line["body"]["max_completion_tokens"] for line in lines}
    for cid, record in out.items():
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["object"] == "chat.completion" and isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["completion_tokens"] <= limits[cid]
    err = by_custom_id(records(batch_sdk, batch.error_file_id))
    assert set(err) == {"bad-temp", "bad-topp"}
    for cid, name in (("bad-temp", "temperature"), ("bad-topp", "top_p")):
        assert err[cid]["response"]["status_code"] == 400 and name in err[cid]["response"]["body"]["error"]["message"]
    direct = batch_sdk.chat.completions.create(**{**lines[0]["body"], "temperature": 0}, model="model")
    assert content(out["ok-1"]) == direct.choices[0].message.content
    assert isinstance(batch.created_at, int) and batch.created_at <= batch.in_progress_at <= batch.completed_at
    for file_id in (batch.output_file_id, batch.error_file_id):
        assert batch_sdk.files.retrieve(file_id).purpose == "batch_output"
    only_bad = batch_sdk.batches.create(input_file_id=upload(batch_sdk, lines[4:]).id, **case["request"]["batch"])
    second, _, _ = poll(batch_sdk, only_bad.id, 120)
    assert second.status == "completed"
    assert (second.request_counts.total, second.request_counts.completed, second.request_counts.failed) == (2, 0, 2)
    assert len(records(batch_sdk, second.error_file_id)) == 2 and records(batch_sdk, second.output_file_id) == []


def test_c21_unknown_ids_and_bad_create_bodies_are_404_and_400_never_5xx(batch_sdk, batch_server):
    case = load_case("C21")["request"]
    file_id, batch_id = case["unknown_file_id"], case["unknown_batch_id"]
    for call in (batch_sdk.files.retrieve, batch_sdk.files.content, batch_sdk.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(file_id)
    for call in (batch_sdk.batches.retrieve, batch_sdk.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(batch_id)
    before = [b.id for b in batch_sdk.batches.list(limit=100).data]
    with pytest.raises(openai.NotFoundError) as err:
        batch_sdk.batches.create(input_file_id=file_id, **case["batch"])
    assert file_id in str(err.value)
    assert [b.id for b in batch_sdk.batches.list(limit=100).data] == before
    good = upload(batch_sdk, case["lines"]).id
    base = {"input_file_id": good, "endpoint": CHAT, "completion_window": "24h"}
    for missing in ("input_file_id", "endpoint"):
        response = httpx.post(batch_server.url + "/v1/batches", json={k: v for k, v in base.items() if k != missing})
        assert response.status_code == 400 and missing in json.dumps(response.json()["error"])
    for name, value in (("endpoint", "/v1/embeddings"), ("completion_window", "1h")):
        response = httpx.post(batch_server.url + "/v1/batches", json={**base, name: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == name
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = httpx.post(batch_server.url + "/v1/batches", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    deleted = batch_sdk.files.delete(good)
    assert (deleted.id, deleted.object, deleted.deleted) == (good, "file", True)
    for call in (batch_sdk.files.retrieve, batch_sdk.files.content, batch_sdk.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(good)
    assert good not in [f.id for f in batch_sdk.files.list().data]
    with pytest.raises((openai.NotFoundError, openai.BadRequestError)):
        batch_sdk.batches.create(**base)
    assert httpx.get(batch_server.url + "/v1/batches").json()["object"] == "list"
    assert httpx.get(batch_server.url + "/ping").status_code == 200
