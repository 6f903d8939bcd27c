"""`lmi-handler batch` as users run it: handed cases C15 and C18, and a SIGKILL midway through 200 requests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from lmi_handler.protocol.batch_lines import DEFAULTS_WARNING, BatchDefaults
from tests.batch.conftest import (
    COMPLETIONS,
    batch_cli,
    batch_line,
    by_custom_id,
    cli_env,
    content,
    read_jsonl,
    run_cli,
    write_jsonl,
)
from tests.helpers import load_case

pytestmark = pytest.mark.slow


def finish_reason(record: dict) -> str:
    return record["response"]["body"]["choices"][0]["finish_reason"]


def completion_tokens(record: dict) -> int:
    return record["response"]["body"]["usage"]["completion_tokens"]


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
    for cid, limit in c18_limits(lines, 7).items():
        assert (finish_reason(records[cid]) == "length") == (tokens[cid] == limit)
        assert tokens[cid] == limit or finish_reason(records[cid]) == "stop"
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


def test_a_runner_killed_midway_through_200_requests_finishes_on_rerun_with_each_custom_id_once(tmp_path):
    lines = [batch_line(f"req-{i:03d}", {"prompt": f"Item {i}:", "max_tokens": 2, "ignore_eos": True}, COMPLETIONS)
             for i in range(200)]
    source, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    args = (str(source), "-o", str(out), "--quiet")
    proc = subprocess.Popen(batch_cli(*args), env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(read_jsonl_loose(out)) < 40 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    before = len(read_jsonl_loose(out))
    assert 40 <= before < 200, f"the kill came at {before} results, not midway"
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    assert "resuming:" in done.stderr
    records = read_jsonl(out)
    assert sorted(r["custom_id"] for r in records) == [line["custom_id"] for line in lines]   # each exactly once
    assert all(r["response"]["status_code"] == 200 and completion_tokens(r) == 2 for r in records)


def read_jsonl_loose(path) -> list[str]:
    """Complete lines written so far (the writer may be mid-line)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [t for t in text.split("\n")[:-1] if t.strip() and json.loads(t)]
