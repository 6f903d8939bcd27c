"""benchmarks/report.py on hand-made results: per-dtype rows and ratios, batch-1 against the same run's
bandwidth ceiling, the llama.cpp row and ratio, docs/performance.md's tables (no engine runs here)."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import report  # noqa: E402
from workload import weight_bytes_per_token  # noqa: E402


def _rounds(rates: list[float], **top) -> dict:
    return {"output_tokens_per_s": statistics.median_low(rates), **top,
            "rounds": [{"round": k, "output_tokens_per_s": rate} for k, rate in enumerate(rates, 1)]}


def _peak(read_gb_s: float | None) -> dict:
    mem = {"skipped": "no C compiler"} if read_gb_s is None else {
        "best_bytes_per_s": read_gb_s * 1e9, "repeats": 10, "bytes": 1 << 30, "threads": 2, "bound_cpus": "0-1",
        "anon_huge_pages_bytes": 1 << 30, "cpu_fraction": 0.5}
    return {"peak_flops_per_s": 1e11, "square_size": 2048, "mem_read": mem,
            "by_dtype": {"fp32": {"peak_flops_per_s": 1e11}, "bf16": {"peak_flops_per_s": 2e11}}}


def _result(phases: dict) -> dict:
    return {"date": "2026-12-01T12:00:00", "phases": phases,
            "config": {"dtype": ["fp32", "bf16"], "quantize": ["int8"], "threads": 2},
            "workload": {"num_prompts": 64, "max_new_tokens": 128, "c1_prompts": 8},
            "weight_bytes_per_token": {"fp32": {"bytes": 400_000_000}, "bf16": {"bytes": 200_000_000},
                                       "int8": {"bytes": 100_000_000}},
            "compute_bound_by_dtype": {"fp32": {"output_tokens_per_s": 500.0, "peak_gflops_per_s": 100.0}},
            "machine": {"cpu": {"model": "Test CPU", "flags_of_interest": ["avx512_bf16"], "hypervisor": True,
                                "family_model_stepping": ["25", "17", "1"]},
                        "affinity_cpus": 2, "physical_cores_in_affinity": 2, "mem_total_bytes": 24 << 30,
                        "caches_bytes": {"L1d": 32 << 10, "L2": 1 << 20, "L3": 260 << 20}, "thp": "madvise",
                        "before": {"loadavg_1_5_15": [0, 0, 0], "other_cpu_cores_busy": 0.0},
                        "after": {"loadavg_1_5_15": [0, 0, 0]}},
            "vllm_preload": {"ld_preload": "/usr/lib/libtcmalloc_minimal.so.4", "why_not": {"iomp5": "no libiomp5.so"}}}


def _phases() -> dict:
    return {
        "peak_start": _peak(20.0), "peak_end": _peak(25.0),
        "ours_offline_fp32": _rounds([100.0, 120.0, 110.0], batch1={"decode_tokens_per_s": 50.0},
                                     output_token_ids=[[1, 2, 3], [4, 5]]),
        "vllm_offline_fp32": _rounds([100.0, 100.0, 100.0], batch1={"decode_tokens_per_s": 25.0},
                                     output_token_ids=[[1, 2, 3], [4, 6]]),
        "ours_offline_bf16": _rounds([300.0, 330.0, 360.0], batch1={"decode_tokens_per_s": 100.0}),
        "vllm_offline_bf16": _rounds([200.0, 300.0, 400.0], batch1={"decode_tokens_per_s": 80.0}),
        "ours_batch1_int8_fp32": {"skipped": "option.quantize=int8: not supported by this engine build"},
        "ours_batch1_int8_bf16": _rounds([200.0, 220.0, 180.0], output_token_ids=[[1, 2, 9]]),
        "llamacpp_batch1": _rounds([100.0, 110.0, 90.0], description="llama 135M Q4_1", model_bytes=125_000_000,
                                   output_token_ids=[[1, 2, 3]]),
    }


def test_each_dtype_gets_its_rows_and_its_median_of_per_round_ratios():
    result = _result(_phases())
    report.add_summary(result)
    names = [r["name"] for r in result["rows"]]
    assert names == ["ours offline fp32 (default, batch-invariant)", "vLLM CPU offline fp32 (LLM.generate)",
                     "compute bound fp32 (workload FLOPs / peak matmul rate)",
                     "ours offline bf16 (default, batch-invariant)", "vLLM CPU offline bf16 (LLM.generate)"]
    ratios = result["ratios"]
    assert ratios["ours_offline_fp32_vs_vllm_offline_fp32"] == pytest.approx(1.1)  # 1.0, 1.2, 1.1
    assert ratios["ours_offline_bf16_vs_vllm_offline_bf16"] == pytest.approx(1.1)  # 1.5, 1.1, 0.9
    assert result["offline_rounds"]["ours_offline_bf16_vs_vllm_offline_bf16"]["per_round"] == pytest.approx([1.5, 1.1, 0.9])
    assert ratios["ours_batch1_fp32_vs_vllm_batch1_fp32"] == 2.0 and ratios["ours_batch1_bf16_vs_vllm_batch1_bf16"] == 1.25
    assert ratios["ours_offline_fp32_vs_compute_bound"] == pytest.approx(0.22)
    assert ratios["ours_batch1_int8_bf16_vs_llamacpp_batch1"] == pytest.approx(2.0)  # 2.0, 2.0, 2.0
    assert ratios["ours_batch1_int8_fp32_vs_llamacpp_batch1"] is None


def test_batch1_is_held_against_weight_bytes_over_the_runs_best_read_bandwidth():
    result = _result(_phases())
    report.add_summary(result)
    assert result["read_bandwidth_bytes_per_s"] == {"peak_start": 20e9, "peak_end": 25e9, "best": 25e9}
    rows = {r["name"]: r for r in result["batch1"]}
    assert list(rows) == ["ours fp32", "vLLM CPU fp32", "ours bf16", "vLLM CPU bf16", "ours int8, activations bf16",
                          "llama.cpp (llama-cpp-python)"]
    fp32 = rows["ours fp32"]  # 25 GB/s / 400 MB = 62.5 tok/s; 50 of it = 0.8
    assert (fp32["bytes_per_token"], fp32["ceiling_tokens_per_s"], fp32["fraction_of_ceiling"]) == (400_000_000, 62.5, 0.8)
    assert rows["ours bf16"]["ceiling_tokens_per_s"] == 125.0 and rows["ours bf16"]["fraction_of_ceiling"] == 0.8
    int8 = rows["ours int8, activations bf16"]  # the median round, 200 of 250
    assert (int8["decode_tokens_per_s"], int8["ceiling_tokens_per_s"], int8["fraction_of_ceiling"]) == (200.0, 250.0, 0.8)
    llama = rows["llama.cpp (llama-cpp-python)"]  # the GGUF's own tensor bytes: 25e9 / 125e6 = 200
    assert llama["weights"] == "GGUF llama 135M Q4_1" and llama["ceiling_tokens_per_s"] == 200.0
    assert llama["round_tokens_per_s"] == [100.0, 110.0, 90.0]


def test_batch1_in_rounds_is_the_row_figure_and_the_single_after_offline_one_stays_in_its_note():
    phases = _phases()
    phases["ours_batch1_bf16"] = _rounds([110.0, 90.0, 105.0], output_token_ids=[[1, 2, 3]])
    result = _result(phases)
    report.add_summary(result)
    rows = {r["name"]: r for r in result["batch1"]}
    bf16 = rows["ours bf16"]  # the median round (105 of the 125 ceiling), not the 100 after the offline rounds
    assert (bf16["decode_tokens_per_s"], bf16["fraction_of_ceiling"]) == (105.0, 0.84)
    assert bf16["round_tokens_per_s"] == [110.0, 90.0, 105.0]
    assert bf16["note"] == "median of 3 rounds, range 90.0–110.0 tok/s; after the offline rounds, one request alone: 100.0 tok/s"
    assert rows["ours fp32"]["note"] == "after the offline rounds, one request alone"  # no rounds phase: as before
    assert result["ratios"]["ours_batch1_bf16_vs_vllm_batch1_bf16"] == 1.25  # vs vLLM: both after their offline rounds
    assert result["greedy_agreement_with_ours_offline"]["ours_batch1_bf16"] == "first 3 of 3 tokens"
    assert "Batch-1: 3 rounds" in report.table(result)


def test_without_a_bandwidth_figure_the_ceiling_is_unknown_not_zero():
    phases = _phases()
    phases["peak_start"], phases["peak_end"] = _peak(None), {"skipped": "--smoke"}
    result = _result(phases)
    report.add_summary(result)
    assert all(r["ceiling_tokens_per_s"] is None and r["fraction_of_ceiling"] is None for r in result["batch1"])
    assert "read bandwidth not measured: no C compiler" in report.table(result)


def test_the_table_shows_both_dtypes_batch1_ceilings_the_host_and_what_was_preloaded(tmp_path):
    result = _result(_phases())
    report.add_summary(result)
    assert result["greedy_agreement_with_ours_offline"] == {
        "vllm_offline_fp32": "1/2", "ours_batch1_int8_bf16": "first 2 of 3 tokens", "llamacpp_batch1": "first 3 of 3 tokens"}
    text = report.table(result)
    assert "| ours fp32 | fp32 | 50.0 | 400.0 | 62.5 | 0.80 |" in text
    assert "| llama.cpp (llama-cpp-python) | GGUF llama 135M Q4_1 | 100.0 | 125.0 | 200.0 | 0.50 |" in text
    assert "best read bandwidth, 25.0 GB/s: start 20.0, end 25.0" in text
    assert "its threads on the CPU 50 % of the pass: a busy machine, the figure is its share" in text
    assert "ours_offline_bf16 / vllm_offline_bf16 per round 1.50, 1.10, 0.90: median 1.10" in text
    assert "ours_batch1_int8_bf16 / llamacpp_batch1 per round 2.00, 2.00, 2.00" in text
    assert ("Machine: Test CPU (family 25 model 17 stepping 1), 2 CPUs (2 physical cores), 24.0 GiB, L1d 32 KiB, "
            "L2 1024 KiB, L3 260 MiB, THP madvise, a VM") in text
    assert "flags avx512_bf16" in text
    assert "vLLM LD_PRELOAD: /usr/lib/libtcmalloc_minimal.so.4 (not preloaded: iomp5: no libiomp5.so)" in text
    assert "Skipped ours_batch1_int8_fp32: option.quantize=int8: not supported by this engine build" in text
    run = tmp_path / "results" / "bench-x.json"
    run.parent.mkdir()
    run.write_text(json.dumps(result))
    doc = tmp_path / "docs" / "performance.md"
    doc.parent.mkdir()
    doc.write_text(f"head\n{report.DOCS_START}\nold\n{report.DOCS_END}\ntail\n")
    report.write_docs([run], doc)
    out = doc.read_text()
    assert out.startswith("head\n") and out.endswith("tail\n") and "### Test CPU, family 25 model 17" in out
    assert "commit not recorded" in out and "([`bench-x.json`](../results/bench-x.json))" in out
    assert "| ours / vLLM CPU, offline (median of per-round ratios) | 1.10 | 1.10 |" in out
    assert "| ours int8 weights / llama.cpp Q4_1, batch-1 decode | – | 2.00 |" in out
    assert "| ours batch-1 / read-bandwidth ceiling (weight bytes a token) | 0.80 | 0.80 |" in out
    assert "Ceilings, measured in the same run: read bandwidth 25.0 GB/s; peak matmul fp32 100 GFLOP/s; peak matmul bf16 –." in out
    assert "![Test CPU, family 25 model 17](../results/bench-x.png)" in out
    result["source"] = {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": True}
    run.write_text(json.dumps(result))
    report.write_docs([run], doc)
    assert "commit 0123456789ab with uncommitted changes" in doc.read_text()
    report.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_an_older_single_dtype_result_still_renders_and_names_no_host_kind():
    old = REPO / "tests" / "benchmarks" / "data" / "bench-single-dtype.json"   # a run from before the dtype loop
    result = json.loads(old.read_text())
    report.add_summary(result)
    text = report.table(result)
    assert "| ours offline (default, batch-invariant) | 164.4 |" in text and "Skipped hf: --skip" in text
    assert report.latest_per_host_kind(old.parent) == []   # no CPU family recorded: not any host kind's run


def test_weight_bytes_per_token_count_every_matrix_once_and_int8_adds_a_scale_per_row(model_dir):
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        matrices = sum(s[0] * s[1] for s in (f.get_slice(n).get_shape() for n in f.keys()) if len(s) == 2)
    fp32, int8 = weight_bytes_per_token(config, "fp32"), weight_bytes_per_token(config, "int8")
    assert fp32["params"] == matrices and fp32["bytes"] == 4 * matrices  # tied: the embedding is lm_head, once
    assert weight_bytes_per_token(config, "bf16")["bytes"] == 2 * matrices
    assert int8["bytes"] == matrices + int8["scale_bytes"] and int8["scale_bytes"] % 4 == 0


def test_fp32_is_also_held_against_the_cores_fma_peak_and_the_probe_line_names_it():
    phases = _phases()
    phases["peak_end"]["fma_peak"] = {"best_flops_per_s": 4.5e11, "threads": 2, "lanes": 16}
    result = {**_result(phases), "fma_bound": {"output_tokens_per_s": 1000.0, "peak_gflops_per_s": 450.0}}
    report.add_summary(result)
    fma = next(r for r in result["rows"] if r["name"].startswith("FMA bound fp32"))
    assert fma["output_tokens_per_s"] == 1000.0 and fma["note"].startswith("450 GFLOP/s")
    assert result["ratios"]["ours_offline_fp32_vs_fma_bound"] == pytest.approx(0.11)   # median round 110 of 1000
    assert result["ratios"]["vllm_offline_fp32_vs_fma_bound"] == pytest.approx(0.10)
    assert "ours_offline_bf16_vs_fma_bound" not in result["ratios"]
    assert "float32 FMA peak 450 GFLOP/s (2 threads, 16-lane vectors)" in report.table(result)
    plain = _result(_phases())                       # a run without the probe: no row, no ratio
    report.add_summary(plain)
    assert not any(r["name"].startswith("FMA bound") for r in plain["rows"])
    assert "ours_offline_fp32_vs_fma_bound" not in plain["ratios"]


def test_batch1_rounds_with_a_read_probe_each_are_also_held_against_their_own_minutes_ceiling():
    phases = _phases()
    phases["ours_batch1_bf16"] = _rounds([110.0, 90.0, 105.0])
    for r, read_gb_s in zip(phases["ours_batch1_bf16"]["rounds"], (22.0, 12.5, 25.0)):
        r["read_bytes_per_s"] = read_gb_s * 1e9           # ceilings 110, 62.5, 125 tok/s at 200 MB a token
    result = _result(phases)
    report.add_summary(result)
    rows = {r["name"]: r for r in result["batch1"]}
    bf16 = rows["ours bf16"]
    assert bf16["fraction_of_ceiling"] == 0.84                        # the run's best probe: 105 of 125
    assert bf16["fraction_of_own_minute_ceiling"] == pytest.approx(1.0)   # 1.0, 1.44, 0.84 -> the middle one
    assert "against a read probe just before each round: 1.00, 1.44, 0.84, median 1.00" in bf16["note"]
    assert rows["ours fp32"]["fraction_of_own_minute_ceiling"] is None    # no rounds with a probe


def test_the_transformers_fallback_gets_its_row_and_its_ratio_to_generate():
    phases = {**_phases(), "ours_offline_transformers_fp32": _rounds([60.0]),
              "hf": {"output_tokens_per_s": 20.0, "batch_size": 16, "output_tokens": 100, "elapsed_s": 5.0}}
    result = _result(phases)
    report.add_summary(result)
    assert "ours offline fp32 (option.model_impl=transformers)" in [r["name"] for r in result["rows"]]
    assert result["ratios"]["ours_offline_transformers_vs_hf"] == 3.0


def test_the_busy_phases_get_their_rows_their_ratio_to_vllm_and_to_the_quiet_run():
    phases = {**_phases(), "ours_offline_busy_fp32": _rounds([60.0, 50.0, 55.0]),
              "vllm_offline_busy_fp32": _rounds([40.0, 50.0, 50.0])}
    result = _result(phases)
    result["config"]["busy_cores"] = 1
    report.add_summary(result)
    assert "ours offline fp32, busy cores (--busy-cores)" in [r["name"] for r in result["rows"]]
    ratios = result["ratios"]
    assert ratios["ours_offline_busy_fp32_vs_vllm_offline_busy_fp32"] == pytest.approx(1.1)   # 1.5, 1.0, 1.1
    assert ratios["ours_offline_busy_fp32_vs_ours_offline_fp32"] == pytest.approx(0.5)        # 55 / 110
    doc = report.docs_section(result, "../benchmarks/results/bench-x.json")
    assert "| ours / vLLM CPU, offline, 1 of the cores busy (--busy-cores) | 1.10 | – |" in doc
    assert "| ours offline, 1 of the cores busy / quiet | 0.50 | – |" in doc
