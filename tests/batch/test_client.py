"""lmi_handler.batch's helper: create_batch checks early; submit_batch runs on a server or offline, and the
examples of docs/batch.md (before its Ray section) work as printed."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from lmi_handler.batch import BatchRejected, create_batch, submit_batch
from lmi_handler.protocol.errors import RequestValidationError
from tests.batch.helpers import COMPLETIONS, RAY_ENV, batch_line, by_custom_id, cli_env, read_jsonl, write_jsonl
from tests.helpers import REPO


def test_create_batch_names_the_lines_without_a_length_and_the_bad_default(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", {"prompt": "x"}, COMPLETIONS)])
    with pytest.raises(BatchRejected, match=r"line 1 \(a\)"):
        create_batch(source)
    with pytest.raises(RequestValidationError, match="top_p"):
        create_batch(source, max_decoding_length=4, top_p=2.0)
    spec = create_batch(source, max_decoding_length=4, temperature=0.5)
    assert (spec.total, spec.num_bad_lines, spec.endpoint) == (1, 0, COMPLETIONS)


@pytest.mark.slow
def test_submit_batch_to_a_server_writes_the_records_with_the_batch_defaults(batch_server, tmp_path):
    lines = [batch_line("own", {"prompt": "1, 2,", "max_tokens": 2, "ignore_eos": True}, COMPLETIONS),
             batch_line("default", {"prompt": "1, 2,", "ignore_eos": True}, COMPLETIONS),
             batch_line("bad", {"prompt": "1, 2,", "top_p": 7}, COMPLETIONS)]
    spec = create_batch(write_jsonl(tmp_path / "in.jsonl", lines), max_decoding_length=3)
    result = submit_batch(spec, tmp_path / "out.jsonl", tmp_path / "err.jsonl", base_url=batch_server.url + "/v1",
                          poll_s=0.3, timeout_s=300)
    assert (result.status, result.total, result.completed, result.failed) == ("completed", 3, 2, 1)
    out = by_custom_id(read_jsonl(tmp_path / "out.jsonl"))
    assert {k: r["response"]["body"]["usage"]["completion_tokens"] for k, r in out.items()} == {"own": 2, "default": 3}
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "err.jsonl")] == ["bad"]


def batch_page_examples() -> list[tuple[str, str]]:
    text = (REPO / "docs" / "batch.md").read_text()
    section = text[:text.index("\n## Over Ray")]         # the Ray example needs a cluster: tests/batch/test_cluster.py
    return re.findall(r"```(bash|python)\n(.*?)```", section, re.S)


@pytest.mark.slow
def test_the_batch_pages_examples_work_as_printed(batch_server, tmp_path):
    """Run in a directory laid out like a checkout; only the server's port and the interpreter differ."""
    shutil.copy(REPO / "serving.properties", tmp_path / "serving.properties")
    (tmp_path / "model").symlink_to(REPO / "model")
    examples = batch_page_examples()
    assert [lang for lang, _ in examples] == ["bash", "bash", "python", "python"]
    for lang, code in examples:
        code = code.replace("http://localhost:8080", batch_server.url)
        command = (["bash", "-c", code.replace(".venv/bin/lmi-handler", f"{sys.executable} -m lmi_handler.cli")]
                   if lang == "bash" else [sys.executable, "-c", code])
        done = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{code}\n{done.stdout}\n{done.stderr}"
    custom_ids = {"greedy", "sampled", "legacy"}
    for name in ("results.jsonl", "offline.jsonl"):
        records = by_custom_id(read_jsonl(tmp_path / name))
        assert set(records) == custom_ids and all(r["response"]["status_code"] == 200 for r in records.values())
    assert read_jsonl(tmp_path / "errors.jsonl") == []
    greedy = by_custom_id(read_jsonl(tmp_path / "offline.jsonl"))["greedy"]
    assert greedy["response"]["body"]["usage"]["completion_tokens"] <= 16


@pytest.mark.slow
def test_submit_batch_with_a_ray_address_runs_the_file_on_that_clusters_replicas(ray_head, tmp_path, monkeypatch):
    for key, value in {**RAY_ENV, "OPTION_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    lines = [batch_line(f"r{i}", {"prompt": f"Item {i}:", "max_tokens": 2, "ignore_eos": True}, COMPLETIONS)
             for i in range(30)]
    batch = create_batch(write_jsonl(tmp_path / "in.jsonl", lines))
    result = submit_batch(batch, tmp_path / "out.jsonl", properties=REPO / "serving.properties", progress=False,
                          ray_address=ray_head.address, replicas=2, shard_lines=10)
    assert (result.status, result.total, result.completed, result.failed) == ("completed", 30, 30, 0)
    records = by_custom_id(read_jsonl(tmp_path / "out.jsonl"))
    assert set(records) == {f"r{i}" for i in range(30)}
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 2 for r in records.values())
