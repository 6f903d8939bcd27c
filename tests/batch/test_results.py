"""batch/results.py: record shapes, success/failure split, and resuming after a kill (torn last line)."""
from __future__ import annotations

import json

from lmi_handler.batch.results import ResultFiles, line_error_record, line_key, success_record
from lmi_handler.protocol.batch_lines import BatchDefaults, check_lines

BODY = {"object": "chat.completion", "choices": [], "usage": {"completion_tokens": 1}}


def test_records_have_the_openai_batch_output_shape():
    record = success_record("a", "req1", BODY)
    assert set(record) == {"id", "custom_id", "response", "error"}
    assert record["id"].startswith("batch_req_") and record["error"] is None
    assert record["response"] == {"status_code": 200, "request_id": "req1", "body": BODY}


def test_successes_and_failures_go_to_their_own_files(tmp_path):
    bad = next(check_lines(['{"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}'],
                           BatchDefaults()))
    with ResultFiles(tmp_path / "out.jsonl", tmp_path / "err.jsonl") as files:
        files.write(success_record("a", "r", BODY))
        files.write(line_error_record(bad))
        files.write(success_record("c", "r", {"error": {"message": "no"}}, 400))
    out = [json.loads(t) for t in (tmp_path / "out.jsonl").read_text().splitlines()]
    err = [json.loads(t) for t in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in out] == ["a"]
    assert [r["custom_id"] for r in err] == ["b", "c"]
    assert err[0]["response"] is None and err[0]["error"]["code"] == "invalid_method"


def test_a_torn_last_line_is_cut_off_and_its_line_is_not_counted_done(tmp_path):
    path = tmp_path / "out.jsonl"
    whole = json.dumps(success_record("a", "r", BODY)) + "\n"
    path.write_text(whole + json.dumps(success_record("b", "r", BODY))[:40])   # killed mid-write
    files = ResultFiles(path)
    assert files.done == {"id:a"} and files.num_completed == 1
    files.write(success_record("b", "r", BODY))
    files.close()
    lines = path.read_text().splitlines()
    assert [json.loads(t)["custom_id"] for t in lines] == ["a", "b"]


def test_unreadable_and_duplicate_lines_are_found_again_by_line_number(tmp_path):
    items = list(check_lines(['{"broken', '{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                              '"body": {"prompt": "x", "max_tokens": 1}}',
                              '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}'],
                             BatchDefaults()))
    assert [line_key(i) for i in items] == ["line:1", "id:a", "line:3"]
    with ResultFiles(tmp_path / "out.jsonl") as files:
        files.write(line_error_record(items[0]))
        files.write(line_error_record(items[2]))
    assert ResultFiles(tmp_path / "out.jsonl").done == {"line:1", "line:3"}
