"""benchmarks/gpu_kernels_check.py, gpu_check.sh's last word, on CPU: without a GPU it refuses with status 2;
its summary (--smoke: a small bandwidth buffer) records the graphs' and the eager run's throughputs from two
bench.py JSONs, with their ratios. gpu_check.sh itself: --help,
a wrong argument, and its refusal without CUDA."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_kernels_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_the_kernel_check_refuses_with_status_2(capsys):
    assert gpu_kernels_check.main(["--out", "/nonexistent"]) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_the_summary_records_the_graphs_and_the_eager_throughputs_and_their_ratios(tmp_path):
    bench = {"phases": {"ours_offline_bf16": {"output_tokens_per_s": 12000.0},
                        "ours_batch1_bf16": {"decode_tokens_per_s": 450.0}, "hf": {"output_tokens_per_s": 3000.0}},
             "workload": {"num_prompts": 64, "max_new_tokens": 128}}
    eager = {"phases": {"ours_offline_bf16": {"output_tokens_per_s": 4000.0}}}
    (tmp_path / "b.json").write_text(json.dumps(bench))
    (tmp_path / "e.json").write_text(json.dumps(eager))
    out = tmp_path / "out"
    assert gpu_kernels_check.main(["--smoke", "--summary", str(out), "--bench-json", str(tmp_path / "b.json"),
                                   "--bench-eager-json", str(tmp_path / "e.json"), "--rc", "invariance=0"]) == 0
    record = json.loads(next(out.glob("gpu-*.json")).read_text())
    assert record["offline_tok_s_invariant"] == 12000.0 and record["offline_tok_s_eager"] == 4000.0
    assert record["batch1_tok_s"] == 450.0
    assert record["graphs_vs_eager"] == 3.0 and record["offline_vs_hf"] == 4.0
    assert record["bandwidth_gb_s"] > 0 and record["invariance_bitwise"] is False    # no kernel tests ran
    assert not any(key.startswith("offline_tok_s_fast") for key in record)   # the plain round is retired
    for key in ("device", "hf_tok_s"):
        assert key in record


def test_the_summary_without_an_eager_run_leaves_its_figures_empty(tmp_path):
    out = tmp_path / "out"
    assert gpu_kernels_check.main(["--smoke", "--summary", str(out)]) == 0
    record = json.loads(next(out.glob("gpu-*.json")).read_text())
    assert record["offline_tok_s_eager"] is None and record["graphs_vs_eager"] is None


# ---- gpu_check.sh, the script that ends with the summary: its arguments and its refusal, on CPU --------------

GPU_CHECK = REPO / "benchmarks" / "gpu_check.sh"


def _gpu_check(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "GPU_CARRY": str(tmp_path / "carry")}
    return subprocess.run(["bash", str(GPU_CHECK), *args], capture_output=True, text=True, env=env, timeout=120)


def test_gpu_check_help_prints_the_steps_and_the_usage_and_a_wrong_argument_its_usage_with_status_2(tmp_path):
    shown = _gpu_check("--help", tmp_path=tmp_path)
    assert shown.returncode == 0 and "LORA_TIMEOUT" in shown.stdout and "--prepare" in shown.stdout
    assert "graphs_vs_eager" in shown.stdout and not (tmp_path / "out").exists()
    wrong = _gpu_check("--bogus", tmp_path=tmp_path)
    assert wrong.returncode == 2 and "unknown argument '--bogus'" in wrong.stderr and "Usage" in wrong.stderr
    assert _gpu_check("--prepare", "again", tmp_path=tmp_path).returncode == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_gpu_check_without_cuda_refuses_with_status_2_saying_cuda_is_not_available(tmp_path):
    refused = _gpu_check(tmp_path=tmp_path)
    assert refused.returncode == 2
    assert f"cannot run the GPU check with {sys.executable}: CUDA is not available (torch {torch.__version__}" \
        in refused.stderr
    assert not (tmp_path / "out").exists()      # nothing written before the refusal
