"""benchmarks/soak.py: the smoke variant (a 40 s soak, then a 200-client storm, on one real server) runs end
to end: every request gets its solo answer or an allowed outcome, nothing stays in use once idle, the
samples and the plot are written. Growth figures are reported, never asserted (they need a long run)."""
from __future__ import annotations

import json
import sys

import pytest

from tests.benchmarks.helpers import REPO, run_benchmark

sys.path.insert(0, str(REPO / "benchmarks"))
from soak import SERIES, growth
from soak_traffic import ROUTES, Answer, judge, parse_stream


def test_answers_are_judged_by_action_and_anything_else_is_a_defect():
    assert judge("plain", Answer(200, ["a b"]), "a b") == ("ok", "")
    assert judge("plain", Answer(200, ["a b", "a c"]), "a b")[0] == "mismatch"
    assert judge("plain", Answer(503, error="busy", code=503), "x")[0] == "refused"
    assert judge("plain", Answer(424, error="internal error", code=424), "x")[0] == "unexpected_error"
    assert judge("fault", Answer(200, error="internal error during generation", code=424), None)[0] == "faulted"
    assert judge("fault", Answer(200, ["text"]), None)[0] == "fault_missed"
    assert judge("deadline", Answer(504, error="timed out", code=504), "x")[0] == "deadline"
    assert judge("deadline", Answer(200, ["x"]), "x")[0] == "finished_first"
    assert judge("cancel", Answer(200, error="cancelled", code=409), "x")[0] == "cancelled"
    assert judge("cancel", Answer(200, error="timed out", code=504), "x")[0] == "unexpected_error"


def test_a_stream_whose_texts_differ_from_its_generated_text_is_malformed_and_tgi_errors_get_a_status():
    lmi = next(r for r in ROUTES if r.name == "invocations_stream")
    lines = ['{"token": {"text": "a"}}', '{"token": {"text": " b"}, "generated_text": "a c"}']
    assert "generated_text" in parse_stream(lmi, lines).malformed
    tgi = next(r for r in ROUTES if r.name == "generate_stream")
    error = parse_stream(tgi, ['data: {"error": "request timed out: ...", "error_type": "generation"}'])
    assert (error.code, error.error) == (504, "request timed out: ...")


def test_growth_compares_the_first_and_last_tenth_after_warm_up():
    samples = [{"t_s": t, **{name: 100 + (t >= 50) * 10 for name in SERIES}} for t in range(0, 100)]
    report = growth(samples, warmup_s=20)
    assert report["rss_bytes"] == {"after_warmup": 100, "end": 110, "max": 110, "growth_pct": 10.0}


@pytest.mark.slow
@pytest.mark.timeout(1500)      # as run_benchmark's own bound: a server start, a 40 s soak, a storm and a batch job
def test_soak_smoke_runs_every_route_and_action_and_ends_clean(model_dir, tmp_path):
    key = "soak-smoke-key-3f9a"          # every request, the batch job's included, must send it
    run = run_benchmark("soak.py", "--smoke", "--api-key", key, "--out-dir", str(tmp_path), timeout_s=1500)
    (path,) = tmp_path.glob("soak-*.json")
    report = json.loads(path.read_text())
    assert report["config"]["api_key"] == "<set>" and key not in path.read_text()
    assert report["api_key_in_server_log"] is False
    assert report["bad"] == 0 and report["after_idle"] == {"kv_blocks_used": 0, "live_requests": 0}
    for route in ROUTES:     # each route's answer was checked against its solo answer at least once
        assert report["by_route"][route.name].get("ok", 0) >= 1, route.name
    outcomes = report["outcomes"]
    assert outcomes["ok"] >= len(ROUTES) and outcomes["batch_ok"] >= 1 and outcomes["refused"] >= 1
    assert outcomes.get("faulted", 0) >= 1 and set(report["by_action"]) >= {"n", "disconnect", "cancel", "deadline"}
    assert len(report["samples"]) >= 5 and set(SERIES) <= set(report["samples"][0])
    assert (tmp_path / path.name.replace(".json", ".png")).stat().st_size > 0
    storm = report["storm"]
    assert storm["clients"] == storm["requests"] == 200 and storm["bad"] == 0
    assert storm["outcomes"].get("ok", 0) >= 1 and storm["outcomes"].get("refused", 0) >= 1
    assert storm["after_idle"] == {"kv_blocks_used": 0, "live_requests": 0}
    assert "growth after warm-up" in run.stdout
