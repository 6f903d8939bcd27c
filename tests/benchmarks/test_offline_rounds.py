"""benchmarks/round_protocol.py and offline_rounds.py: the rounds protocol, with fake workers (no engine).

A fake worker is a few lines of Python speaking the protocol; it can fail in a given round or hang,
so the driver's order, isolation of a failing peer and time limit are checked in seconds.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from offline_rounds import OfflineWorker, run_rounds  # noqa: E402
from round_protocol import READY, median_round, round_file, serve, summarize  # noqa: E402

FAKE_WORKER = """
import argparse, os, sys, time
sys.path.insert(0, {bench!r})
from round_protocol import serve, summarize, write_json
p = argparse.ArgumentParser()
p.add_argument("--rate", type=float); p.add_argument("--fail-in", type=int, default=0)
p.add_argument("--hang", action="store_true"); p.add_argument("--control-dir"); p.add_argument("--out")
p.add_argument("--refuse")
a = p.parse_args()
if a.refuse:  # as workers.py ours-batch1 does when the engine refuses its options
    write_json(__import__("pathlib").Path(a.control_dir) / "ready.json", {{"refused": a.refuse}})
    sys.exit(0)
def one(k):
    print("noise on stdout that the driver must not read", flush=True)
    if k == a.fail_in:
        sys.exit(3)
    while a.hang:
        time.sleep(1)
    return {{"wall_s": 1.0, "output_tokens": 4, "output_tokens_per_s": a.rate * k, "output_token_ids": [[k]]}}
from pathlib import Path
rounds = serve(Path(a.control_dir), {{"startup_s": 0.0}}, one)
write_json(Path(a.out), {{**summarize(rounds), "batch1": {{"decode_tokens_per_s": 1.0}}}})
"""


def test_serve_reports_each_round_in_a_file_and_keeps_only_the_first_rounds_token_ids(tmp_path):
    rates = {1: 30.0, 2: 10.0, 3: 20.0}
    rounds = serve(tmp_path, {"startup_s": 1.5}, lambda k: {"output_tokens_per_s": rates[k], "output_token_ids": [[7]]},
                   commands=["run 1\n", "run 2\n", "run 3\n", "finish\n"])
    assert json.loads((tmp_path / READY).read_text()) == {"startup_s": 1.5}
    files = [json.loads((tmp_path / round_file(k)).read_text()) for k in (1, 2, 3)]
    assert [f["round"] for f in files] == [1, 2, 3] and files[0]["output_token_ids"] == [[7]]
    assert "output_token_ids" not in files[1] and all(f["same_token_ids_as_first_round"] for f in files)
    assert all(f["start_unix_s"] <= f["end_unix_s"] for f in files)
    summary = summarize(rounds)
    assert summary["output_tokens_per_s"] == 20.0 and summary["median_round"] == 3  # the median of 10, 20, 30
    assert summary["output_token_ids"] == [[7]] and summary["num_rounds"] == 3
    assert all("output_token_ids" not in r for r in summary["rounds"])


def test_median_round_of_an_even_number_is_the_slower_middle_one():
    rounds = [{"round": k, "output_tokens_per_s": rate} for k, rate in ((1, 5.0), (2, 9.0), (3, 1.0), (4, 7.0))]
    assert median_round(rounds)["round"] == 1


def test_serve_refuses_an_unknown_command_and_a_closed_stdin(tmp_path):
    with pytest.raises(ValueError, match="unknown command"):
        serve(tmp_path, {}, lambda k: {}, commands=["go\n"])
    with pytest.raises(EOFError):
        serve(tmp_path, {}, lambda k: {"output_token_ids": []}, commands=[])


def _fake(tmp_path: Path, name: str, *flags: str, time_limit_s: float = 60) -> OfflineWorker:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(bench=str(REPO / "benchmarks")))
    return OfflineWorker(name, [sys.executable, str(script), *flags], dict(os.environ), tmp_path, time_limit_s)


def test_rounds_alternate_who_goes_first_and_each_round_records_the_machine(tmp_path):
    ours, peer = _fake(tmp_path, "ours", "--rate", "10"), _fake(tmp_path, "peer", "--rate", "5")
    results = run_rounds([ours, peer], 3, snapshot_s=0.05, log=lambda line: None)
    for name, rate in (("ours", 10), ("peer", 5)):
        res = results[name]
        assert [r["output_tokens_per_s"] for r in res["rounds"]] == [rate, 2 * rate, 3 * rate]
        assert res["output_tokens_per_s"] == 2 * rate and res["output_token_ids"] == [[1]]
        assert res["monitor"]["peak_rss_mib"] > 0
    orders = [r["machine"]["order"] for r in results["ours"]["rounds"]]
    assert orders == [["ours", "peer"], ["peer", "ours"], ["ours", "peer"]]
    during = results["ours"]["rounds"][0]["machine"]["during"]
    assert {"steal_fraction", "idle_peer_cpu_cores_busy", "other_cpu_cores_busy"} <= during.keys()


def test_a_peer_failing_in_round_two_keeps_every_round_of_ours(tmp_path):
    ours, peer = _fake(tmp_path, "ours", "--rate", "10"), _fake(tmp_path, "peer", "--rate", "5", "--fail-in", "2")
    results = run_rounds([ours, peer], 3, snapshot_s=0.05, log=lambda line: None)
    assert results["peer"]["skipped"].startswith("failed in round 2: exit code 3")
    assert [r["round"] for r in results["ours"]["rounds"]] == [1, 2, 3]


def test_a_worker_that_cannot_start_is_recorded_and_the_other_runs_alone(tmp_path):
    gone = OfflineWorker("gone", [str(tmp_path / "no-such-python")], dict(os.environ), tmp_path, 60)
    results = run_rounds([gone, _fake(tmp_path, "ours", "--rate", "10")], 2, snapshot_s=0.05, log=lambda line: None)
    assert results["gone"]["skipped"].startswith("failed at start-up: cannot start")
    assert results["ours"]["rounds"][1]["machine"]["order"] == ["ours"]
    assert results["ours"]["rounds"][1]["machine"]["during"]["idle_peer_cpu_cores_busy"] is None


def test_a_worker_past_its_time_limit_is_killed_and_the_other_goes_on(tmp_path):
    hung, ours = _fake(tmp_path, "hung", "--rate", "5", "--hang", time_limit_s=4), _fake(tmp_path, "ours", "--rate", "10")
    results = run_rounds([hung, ours], 2, snapshot_s=0.05, log=lambda line: None)
    assert "timed out after 4 s busy, before round 1 ended" in results["hung"]["skipped"]
    assert hung.proc.returncode is not None and results["ours"]["num_rounds"] == 2


def test_a_worker_whose_engine_refuses_its_options_is_skipped_with_the_reason_and_the_other_runs(tmp_path):
    refused = _fake(tmp_path, "int8", "--refuse", "ConfigError: quantize 'int8' is not supported on this CPU")
    results = run_rounds([refused, _fake(tmp_path, "peer", "--rate", "5")], 2, snapshot_s=0.05, log=lambda line: None)
    assert results["int8"] == {"skipped": "ConfigError: quantize 'int8' is not supported on this CPU"}
    assert results["peer"]["num_rounds"] == 2 and refused.proc.returncode is not None
