"""lmi_handler/batch/cluster.py: `lmi-handler batch --ray` on real Ray clusters of this machine (127.0.0.1 only),
two replicas of the demo model with one thread each: the same records as the single-process runner, a replica
killed midway, the driver killed and rerun."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from lmi_handler.batch.cluster import ClusterPlan
from tests.batch.helpers import (
    CHAT,
    COMPLETIONS,
    LOOPBACK_HEX,
    batch_cli,
    batch_line,
    cmdline,
    completion_tokens,
    group_members,
    kill_group,
    listening_addresses,
    process_tree,
    ray_cli_env,
    read_jsonl,
    write_jsonl,
)

pytestmark = pytest.mark.slow

NUM_LINES = 200


def file_lines() -> list:
    """200 lines: completions and chat (greedy, a few tokens each), a custom_id used again in a later shard and a
    bad url, so line errors travel through the shards too."""
    lines = []
    for i in range(NUM_LINES - 2):
        if i % 5 == 4:
            lines.append(batch_line(f"req-{i:03d}", {"messages": [{"role": "user", "content": f"Count to {i}."}],
                                                     "max_completion_tokens": 5}, CHAT))
        else:
            lines.append(batch_line(f"req-{i:03d}", {"prompt": f"Item {i}:", "max_tokens": 4, "ignore_eos": True},
                                    COMPLETIONS))
    lines.insert(150, batch_line("req-003", {"prompt": "again", "max_tokens": 2}, COMPLETIONS))
    lines.append(batch_line("bad-url", {"input": "x"}, url="/v1/embeddings"))
    return lines


def comparable(record: dict) -> dict:
    """A record without what is drawn per run (record id, request id, the answer's id and creation time)."""
    response = record["response"]
    if response is None:
        return {"error": record["error"]}
    body = {k: v for k, v in response["body"].items() if k not in ("id", "created")}
    return {"status": response["status_code"], "body": body, "error": record["error"]}


def keyed(records: list[dict]) -> dict:
    """Records by custom_id (by line for an error keyed by line); each key once."""
    found = {}
    for record in records:
        key = record["custom_id"] if (record["error"] or {}).get("code") != "duplicate_custom_id" else \
            f"line:{record['error']['line']}"
        assert key not in found, f"{key} twice"
        found[key] = record
    return found


def start_batch(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(batch_cli(*args), env=ray_cli_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(condition, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, "the batch ended before the condition was met"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def shard_files(out) -> list:
    root = out.with_name(out.name + ".shards")
    return sorted(root.glob("lines-*.jsonl")) if root.is_dir() else []


def test_two_replicas_on_a_local_cluster_give_the_single_process_runners_records_on_the_loopback_only(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", file_lines())
    alone = subprocess.run(batch_cli(str(source), "-o", str(tmp_path / "alone.jsonl"), "--quiet"),
                           env=ray_cli_env(), capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0, alone.stderr
    out, log_path = tmp_path / "ray.jsonl", tmp_path / "ray.log"
    with open(log_path, "w") as log:
        proc = start_batch([str(source), "-o", str(out), "--ray", "--replicas", "2", "--shard-lines", "25"], log)
        try:
            wait_for(lambda: shard_files(out), proc)    # Ray and both replicas are up and working
            listening = listening_addresses(process_tree(proc.pid) + group_members(proc.pid))
            assert listening and listening <= LOOPBACK_HEX, listening
            assert proc.wait(timeout=600) == 0, log_path.read_text()[-3000:]
            # the job's Ray processes end with it (Ray's two agents notice their raylet is gone within a minute)
            deadline = time.monotonic() + 120
            while group_members(proc.pid) and time.monotonic() < deadline:
                time.sleep(1)
            assert group_members(proc.pid) == [], [cmdline(pid) for pid in group_members(proc.pid)]
        finally:
            kill_group(proc.pid)
    expected = keyed(read_jsonl(tmp_path / "alone.jsonl"))
    got = keyed(read_jsonl(out))
    assert len(got) == NUM_LINES and set(got) == set(expected)
    assert {k: comparable(r) for k, r in got.items()} == {k: comparable(r) for k, r in expected.items()}
    assert got["line:151"]["error"]["code"] == "duplicate_custom_id" and got["bad-url"]["error"]["code"] == "invalid_url"
    assert not out.with_name(out.name + ".shards").exists()       # merged, then removed
    assert "batch done: 200 lines, 198 completed, 2 failed" in log_path.read_text()


def lines_of_equal_work(n: int = NUM_LINES) -> list:
    return [batch_line(f"req-{i:03d}", {"prompt": f"Item {i}:", "max_tokens": 3, "ignore_eos": True}, COMPLETIONS)
            for i in range(n)]


def check_complete(out, lines) -> None:
    records = read_jsonl(out)
    assert sorted(r["custom_id"] for r in records) == [line["custom_id"] for line in lines]   # each exactly once
    assert all(r["response"]["status_code"] == 200 and completion_tokens(r) == 3 for r in records)
    assert not out.with_name(out.name + ".shards").exists()


def test_a_replica_killed_midway_loses_nothing_and_duplicates_nothing(ray_head, tmp_path):
    lines = lines_of_equal_work()
    source, out, log_path = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", tmp_path / "log"
    with open(log_path, "w") as log:
        proc = start_batch([str(source), "-o", str(out), "--ray", "--address", ray_head.address, "--shard-lines", "20"],
                           log)
        try:
            wait_for(lambda: shard_files(out) and len(ray_head.replicas()) == 2, proc)
            victim = ray_head.replicas()[0]
            os.kill(victim, signal.SIGKILL)
            assert proc.wait(timeout=600) == 0, log_path.read_text()[-3000:]
        finally:
            kill_group(proc.pid)
    text = log_path.read_text()
    assert "attempt 1 failed" in text and "recomputing the shard" in text, text[-3000:]
    check_complete(out, lines)


def test_a_driver_killed_midway_then_the_same_command_again_completes_the_file_each_custom_id_once(ray_head, tmp_path):
    lines = lines_of_equal_work()
    source, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    args = [str(source), "-o", str(out), "--ray", "--address", ray_head.address, "--shard-lines", "20"]
    with open(tmp_path / "first.log", "w") as log:
        proc = start_batch(args, log)
        try:
            wait_for(lambda: len(shard_files(out)) >= 2, proc)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            kill_group(proc.pid)
    before = len(read_jsonl(out))
    assert 0 < before < NUM_LINES, f"the kill came at {before} results, not midway"
    again = subprocess.run(batch_cli(*args, "--quiet"), env=ray_cli_env(), capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming:" in again.stderr
    check_complete(out, lines)


def test_a_cluster_plan_refuses_counts_below_one():
    with pytest.raises(ValueError, match="replicas must be >= 1, got 0"):
        ClusterPlan(replicas=0)
    with pytest.raises(ValueError, match="shard_lines must be >= 1, got 0"):
        ClusterPlan(shard_lines=0)
