"""llama.cpp's worker: the probe that turns its extra weight buffer types off where a first decode with them
dies (llama.cpp's AMX buffer on Intel Xeon VMs), and the batch-1 table's note that says so."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import llamacpp_worker  # noqa: E402
import report  # noqa: E402


def test_a_probe_child_that_dies_turns_the_extra_buffer_types_off_and_says_how(tmp_path):
    # the project's venv has no llama_cpp: the real child process fails at its import (exit code 1), the
    # same path a child killed by SIGSEGV in llama.cpp's AMX matmul takes
    probe = llamacpp_worker.probe_extra_bufts(tmp_path / "absent.gguf", threads=1, timeout_s=120)
    assert probe["used"] is False
    assert probe["reason"].startswith("a first decode with them died (exit code 1") and "--no-repack" in probe["reason"]


def test_the_batch1_table_notes_extra_buffer_types_turned_off():
    def result(extra):
        rounds = [{"round": k, "output_tokens_per_s": v} for k, v in enumerate([50.0, 52.0, 48.0], 1)]
        llama = {"output_tokens_per_s": 50.0, "model_bytes": 96_000_000, "description": "llama 256M Q4_1",
                 "rounds": rounds, "num_rounds": 3, "extra_buffer_types": extra}
        return {"phases": {"llamacpp_batch1": llama}, "config": {"quantize": []}, "weight_bytes_per_token": {}}

    (off,) = report.batch1_rows(result({"used": False, "reason": "a first decode with them died (signal SIGSEGV)"}))
    assert off["note"].endswith("; extra weight buffer types off: a first decode with them died (signal SIGSEGV)")
    (on,) = report.batch1_rows(result({"used": True, "reason": "llama.cpp's default"}))
    assert "extra weight buffer types" not in on["note"] and on["note"].startswith("median of 3 rounds")
