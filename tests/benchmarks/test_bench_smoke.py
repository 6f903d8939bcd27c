"""benchmarks/bench.py: the smoke variant runs end to end and writes a complete result file.

Numbers are never asserted (they depend on the machine); the structure and the token counts are.
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys

import pytest

from tests.benchmarks.helpers import ENV, REPO, run_benchmark

sys.path.insert(0, str(REPO / "benchmarks"))
import report
from workload import Workload, model_flops, write_batch_file


def test_batch_file_lines_are_greedy_chat_requests_with_unique_custom_ids(tmp_path):
    workload = Workload("model", 128, ["Say hi.", "Name a prime."], ["p0", "p1"], [[1, 2], [3]])
    lines = [json.loads(line) for line in write_batch_file(workload, tmp_path / "in.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["request-0", "request-1"]
    for line, question in zip(lines, workload.questions, strict=True):
        assert (line["method"], line["url"]) == ("POST", "/v1/chat/completions")
        body = line["body"]
        assert body["messages"] == [{"role": "user", "content": question}]
        assert body["max_completion_tokens"] == 128 and body["ignore_eos"] is True
        assert "temperature" not in body  # batch format: absent = greedy


def test_workload_flops_count_every_matrix_of_the_demo_model(model_dir):
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    matrices = sum(rows * cols for rows, cols in (s for s in shapes.values() if len(s) == 2))
    flops = model_flops(config, Workload(str(model_dir), 4, ["q"], ["p"], [[1, 2, 3]]))
    # tied embeddings: the one embedding matrix is also lm_head, counted once in the checkpoint
    assert flops["non_embedding_params"] + flops["lm_head_params"] == matrices
    computed = 3 + 4 - 1
    assert flops["linear_flops"] == 2 * flops["non_embedding_params"] * computed
    assert flops["lm_head_flops"] == 2 * flops["lm_head_params"] * 4


def _offline(rates: list[float]) -> dict:
    return {"output_tokens_per_s": statistics.median_low(rates),
            "rounds": [{"round": k, "output_tokens_per_s": rate} for k, rate in enumerate(rates, 1)]}


def test_offline_ratio_is_the_median_of_per_round_ratios_not_the_ratio_of_medians():
    # per round: 100/100, 200/100, 150/300 -> 1.0, 2.0, 0.5; the ratio of the medians would be 150/100
    phases = {"ours_offline": _offline([100.0, 200.0, 150.0]), "vllm_offline": _offline([100.0, 100.0, 300.0])}
    by_round = report.round_ratios(phases)
    assert by_round == {"median": 1.0, "min": 0.5, "max": 2.0, "num_rounds": 3, "per_round": [1.0, 2.0, 0.5]}
    result = {"phases": phases, "workload": {"c1_prompts": 8, "max_new_tokens": 128}, "compute_bound": None,
              "config": {"threads": 2}, "machine": {"cpu": "cpu", "affinity_cpus": 2, "before": {"loadavg_1_5_15": [0, 0, 0],
                                                   "other_cpu_cores_busy": 0.0}, "after": {"loadavg_1_5_15": [0, 0, 0]}}}
    report.add_summary(result)
    assert result["ratios"]["ours_offline_vs_vllm_offline"] == 1.0
    assert result["offline_rounds"]["ours_offline_vs_vllm_offline"]["max"] == 2.0
    table = report.table(result)
    assert "median 1.00, min 0.50, max 2.00" in table and "range 100.0–300.0 tok/s" in table


def test_offline_ratio_pairs_rounds_by_number_and_needs_both_engines():
    phases = {"ours_offline": _offline([100.0, 50.0]), "vllm_offline": _offline([100.0])}
    assert report.round_ratios(phases)["per_round"] == [1.0]
    assert report.round_ratios({"ours_offline": _offline([1.0]), "vllm_offline": {"skipped": "--skip"}}) is None


def _batch_command_exists() -> bool:
    probe = subprocess.run([sys.executable, "-m", "lmi_handler.cli", "batch", "--help"], env=ENV, cwd=REPO,
                           capture_output=True)
    return probe.returncode == 0


def _llamacpp_ready() -> bool:
    import peers

    return peers.llamacpp_ready()


@pytest.mark.slow
def test_smoke_run_writes_every_phase_a_plot_and_a_performance_table(model_dir, tmp_path):
    run_benchmark("bench.py", "--smoke", "--out-dir", str(tmp_path), timeout_s=1200)
    (json_path,) = tmp_path.glob("bench-smoke-*.json")
    (png_path,) = tmp_path.glob("bench-smoke-*.png")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(json_path.read_text())
    phases = result["phases"]
    assert result["config"]["dtype"] == ["fp32", "bf16"]  # --smoke runs the dtype loop too
    assert len(result["source"]["commit"]) == 40 and isinstance(result["source"]["dirty"], bool)  # the checkout measured

    tokens = 2 * 8  # 2 prompts x 8 tokens, EOS ignored: exact in every engine
    for name in ("ours_offline_fp32", "ours_offline_bf16", "hf"):
        assert "skipped" not in phases[name], phases[name]
        assert phases[name]["output_tokens"] == tokens
        assert phases[name]["output_tokens_per_s"] > 0 and phases[name]["monitor"]["peak_rss_mib"] > 0
    assert phases["ours_offline_bf16"]["dtype"] == "torch.bfloat16" and phases["ours_offline_fp32"]["dtype"] == "torch.float32"
    for dtype in ("fp32", "bf16"):
        assert phases[f"ours_offline_{dtype}"]["batch1"]["output_tokens"] == 8
        rounds = phases[f"ours_offline_{dtype}"]["rounds"]  # --smoke: 2 rounds, so the multi-round path runs in CI
        assert [r["round"] for r in rounds] == [1, 2] and all(r["output_tokens"] == tokens for r in rounds)
        assert all(r["output_tokens_per_s"] > 0 and r["machine"]["during"]["wall_s"] > 0 for r in rounds)
        assert rounds[1]["same_token_ids_as_first_round"]  # and the prefix cache was emptied between them:
        assert rounds[1]["prefix_cache_hit_tokens"] == rounds[0]["prefix_cache_hit_tokens"]
    ours = phases["ours_offline_fp32"]
    assert ours["output_tokens_per_s"] == statistics.median_low(r["output_tokens_per_s"] for r in ours["rounds"])
    assert ours["torch_num_threads"] == 1
    from lmi_handler.engine.host_memory import malloc_huge_pages_environ
    if malloc_huge_pages_environ({}) is not None and "GLIBC_TUNABLES" not in ENV:
        # our worker started itself again as `lmi-handler serve` does: malloc's heap on huge pages
        assert ours["malloc"].startswith("heap on huge pages"), ours["malloc"]
    assert "skipped" not in phases["ours_priority"], phases["ours_priority"]   # its own test checks its figures
    (level,) = phases["ours_server"]["levels"]
    assert (level["concurrency"], level["num_errors"], level["output_tokens"]) == (2, 0, tokens)
    assert level["ttft_s"]["p99"] >= level["ttft_s"]["p50"] > 0 and level["itl_s"]["n"] == 2 * 7

    peak = phases["peak_start"]  # the ceilings' probes, in the same run
    assert set(peak["by_dtype"]) == {"fp32", "bf16"} and all(v["peak_flops_per_s"] > 0 for v in peak["by_dtype"].values())
    assert set(result["compute_bound_by_dtype"]) == {"fp32", "bf16"} and result["compute_bound"]["output_tokens_per_s"] > 0
    if shutil.which("cc") or shutil.which("gcc"):
        mem = peak["mem_read"]
        assert mem["bytes"] == 64 << 20 and len(mem["seconds"]) == 3 and mem["best_bytes_per_s"] > 0
        batch1 = {r["name"]: r for r in result["batch1"]}
        for name, nbytes in (("ours fp32", 4), ("ours bf16", 2)):
            assert batch1[name]["bytes_per_token"] == nbytes * result["weight_bytes_per_token"]["fp32"]["params"]
            assert batch1[name]["ceiling_tokens_per_s"] > 0 and batch1[name]["fraction_of_ceiling"] > 0
    for dtype in ("fp32", "bf16"):  # batch-1 in rounds, the weights in the dtype itself
        alone = phases[f"ours_batch1_{dtype}"]
        assert alone["num_rounds"] == 2 and all(r["output_tokens"] == 8 for r in alone["rounds"]), alone
        row = {r["name"]: r for r in result["batch1"]}[f"ours {dtype}"]
        assert row["decode_tokens_per_s"] == alone["output_tokens_per_s"] and len(row["round_tokens_per_s"]) == 2
    assert result["greedy_agreement_with_ours_offline"]["ours_batch1_fp32"] == "first 8 of 8 tokens"  # invariance
    for dtype in ("fp32", "bf16"):  # int8: refused cleanly by a build without it, or run in 2 rounds of 8 tokens
        int8 = phases[f"ours_batch1_int8_{dtype}"]
        if "skipped" in int8:
            assert "quantize" in int8["skipped"], int8
        else:
            assert int8["num_rounds"] == 2 and all(r["output_tokens"] == 8 for r in int8["rounds"])
    llama = phases["llamacpp_batch1"]  # llama.cpp only where make bench-setup installed it
    if _llamacpp_ready():
        assert llama["num_rounds"] == 2 and all(r["output_tokens"] == 8 for r in llama["rounds"]), llama
        assert llama["model_bytes"] > 0 and llama["output_tokens_per_s"] > 0
        assert isinstance(llama["extra_buffer_types"]["used"], bool) and llama["extra_buffer_types"]["reason"]
    else:
        assert "is not set up" in llama["skipped"]
    structured = phases["ours_structured"]  # the structured-output phase, ours only: 2 prompts, 8 tokens, 2 rounds
    assert structured["grammar_backend"].startswith("llguidance") and structured["dtype"] == "torch.float32"
    assert [r["round"] for r in structured["rounds"]] == [1, 2]
    for rnd in structured["rounds"]:
        assert rnd["num_requests"] == 2 and 2 <= rnd["output_tokens"] <= tokens
        assert rnd["unconstrained"]["num_requests"] == 2 and 2 <= rnd["unconstrained"]["output_tokens"] <= tokens
        assert rnd["length_matched"]["output_tokens"] == rnd["output_tokens"]   # each request its constrained length
        check = rnd["validation"]
        assert check["num_outputs"] == 2 and check["num_invalid"] == 0
        assert check["num_finished"] + check["num_length"] == 2 and check["num_valid"] == check["num_finished"]
    assert structured["compile"]["first_request_s"] > 0 and structured["compile"]["all_schemas_2_tokens_s"] > 0
    assert result["structured"]["engines"]["ours_structured"]["validation"]["num_outputs"] == 4
    smoke_off = {"skipped": "--smoke (add --with vllm)"}  # every phase is in the JSON, with why it did not run
    assert phases["vllm_structured"] == smoke_off
    assert phases["vllm_offline_fp32"] == smoke_off and phases["vllm_offline_bf16"] == smoke_off
    assert phases["vllm_server"] == smoke_off
    assert not any("plain" in phase for phase in phases)   # option.batch_invariant is retired, and its round
    assert phases["ours_offline_transformers_fp32"] == {"skipped": "--smoke (add --with transformers)"}
    assert phases["peak_end"] == {"skipped": "--smoke"}
    if _batch_command_exists():
        assert phases["batch_runner"]["num_ok"] == 2 and phases["batch_runner"]["output_tokens"] == tokens
    else:
        assert "not available" in phases["batch_runner"]["skipped"]
    machine = result["machine"]
    assert machine["before"]["loadavg_1_5_15"] and machine["cpu"]["model"] and machine["mem_total_bytes"] > 0
    assert isinstance(machine["cpu"]["flags_of_interest"], list) and result["rows"] and "ratios" in result

    doc = tmp_path / "performance.md"
    shutil.copy(REPO / "docs" / "performance.md", doc)
    before = doc.read_text()
    report.write_docs([json_path], doc)
    after = doc.read_text()
    assert after.startswith(before.split(report.DOCS_START)[0]) and json_path.name in after
    assert after.count(report.DOCS_START) == 1 and after.count(report.DOCS_END) == 1
    assert "| ours / vLLM CPU, offline (median of per-round ratios) | – | – |" in after   # --smoke: no vLLM
    assert f"{json_path.stem}.png" in after
    text = report.table(result)
    assert "| ours offline fp32 (default" in text and "| ours | JSON schema |" in text
    assert "| ours | unconstrained |" in text and "| ours bf16 | bf16 |" in text


@pytest.mark.slow
def test_the_priority_phase_times_the_probes_under_both_policies_behind_a_queued_batch(model_dir, tmp_path):
    """ours_priority alone, at smoke sizes with 2 sequences a step, so 2 of its 4 batch requests queue."""
    others = "peak,ours_offline,vllm,ours_batch1,llamacpp,structured,batch_runner,ours_server,hf"
    proc = run_benchmark("bench.py", "--smoke", "--max-num-seqs", "2", "--skip", others, "--out-dir", str(tmp_path),
                         timeout_s=1200)
    (json_path,) = tmp_path.glob("bench-smoke-*.json")
    result = json.loads(json_path.read_text())
    phase = result["phases"]["ours_priority"]
    assert (phase["batch_requests"], phase["probes"], phase["max_tokens"], phase["max_rolling_batch_size"]) == (4, 2, 4, 2)
    for policy in ("fcfs", "priority"):
        run = phase[policy]
        assert run["probe_errors"] == [] and run["batch_errors"] == [] and run["held_at_first_probe"] == 4
        assert run["ttft_s"]["n"] == len(run["probe_ttft_s"]) == 2 and all(t > 0 for t in run["probe_ttft_s"])
    assert phase["interactive_ttft_p50_ratio"] == phase["fcfs"]["ttft_s"]["p50"] / phase["priority"]["ttft_s"]["p50"]
    assert result["ratios"]["ours_priority_interactive_ttft_p50_fcfs_vs_priority"] == phase["interactive_ttft_p50_ratio"]
    assert "Request priority (ours_priority): interactive TTFT p50 behind 4 batch requests" in proc.stdout
