"""lmi_handler/cli.py: `lmi-handler batch` in a subprocess, killed midway and rerun.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from lmi_handler.engine.host_memory import malloc_huge_pages_environ
from tests.batch.helpers import (
    COMPLETIONS,
    batch_cli,
    batch_line,
    cli_env,
    completion_tokens,
    read_jsonl,
    run_cli,
    write_jsonl,
)

pytestmark = pytest.mark.slow


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
    if malloc_huge_pages_environ({}) is not None and "GLIBC_TUNABLES" not in os.environ:
        # `lmi-handler batch` started itself again with malloc's heap on huge pages (engine/host_memory.py)
        assert "heap on huge pages (GLIBC_TUNABLES glibc.malloc.hugetlb=1)" in done.stderr
    records = read_jsonl(out)
    assert sorted(r["custom_id"] for r in records) == [line["custom_id"] for line in lines]   # each exactly once
    assert all(r["response"]["status_code"] == 200 and completion_tokens(r) == 2 for r in records)


def read_jsonl_loose(path) -> list[str]:
    """Complete lines written so far (the writer may be mid-line)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [t for t in text.split("\n")[:-1] if t.strip() and json.loads(t)]


def test_ray_flags_without_ray_are_refused_before_anything_runs(tmp_path, capsys):
    from lmi_handler.cli import main

    source = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", {"prompt": "x", "max_tokens": 2}, COMPLETIONS)])
    assert main(["batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--replicas", "3"]) == 2
    assert "--address, --replicas and --shard-lines go with --ray" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("line,named", [("option.quantize=int3", "option.quantize='int3': Value error, must be one of ['int8'"),
                                        ("option.dtype=fp8", "option.dtype='fp8'")])
def test_a_refused_setting_ends_serve_with_one_line_naming_it_and_exit_code_2(tmp_path, capsys, line, named):
    from lmi_handler.cli import main

    props = tmp_path / "serving.properties"
    props.write_text(f"engine=Python\noption.model_id=model\n{line}\n")
    assert main(["serve", "--properties", str(props), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and "Traceback" not in err and err.count("\n") == 1


def test_a_setting_the_engine_refuses_ends_batch_with_one_line_naming_it_and_exit_code_2(tmp_path, capsys, model_dir):
    from lmi_handler.cli import main

    props = tmp_path / "serving.properties"
    props.write_text(f"engine=Python\noption.model_id={model_dir}\noption.max_model_len=40000\n")
    source = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", {"prompt": "x", "max_tokens": 2}, COMPLETIONS)])
    assert main(["batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--properties", str(props)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: option.max_model_len=40000 exceeds the model's context of 8192 tokens")
    assert "Traceback" not in err and err.count("\n") == 1 and not (tmp_path / "out.jsonl").exists()


def test_a_setting_the_engine_refuses_ends_serve_with_its_line_last_and_exit_code_2(tmp_path, model_dir):
    """A refusal found while the engine is built (here option.max_model_len past max_position_embeddings) ends
    `lmi-handler serve` as the refusals before it do: status 2, the last line of stderr `error: ...` naming the
    option, the front end's log line without a traceback."""
    import sys

    props = tmp_path / "serving.properties"
    props.write_text(f"engine=Python\noption.model_id={model_dir}\noption.max_model_len=40000\n")
    proc = subprocess.run([sys.executable, "-m", "lmi_handler.cli", "serve", "--properties", str(props),
                           "--host", "127.0.0.1", "--port", "0"], capture_output=True, text=True, timeout=300,
                          env=cli_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: option.max_model_len=40000 exceeds the model's context of 8192 tokens"), last
    assert "model initialization refused: option.max_model_len=40000" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
