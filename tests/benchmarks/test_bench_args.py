"""benchmarks/bench.py's command line: bad values are refused with the option's name and rule before any
engine starts; --smoke says which phases it turns off and why; SIGTERM unwinds like Ctrl-C."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench  # noqa: E402


@pytest.mark.parametrize("argv,message", [
    (["--threads", "0"], "--threads 0: at least 1"),
    (["--threads", "-2"], "--threads -2: at least 1"),
    (["--num-prompts", "0"], "--num-prompts 0: at least 1"),
    (["--max-new-tokens", "-3"], "--max-new-tokens -3: at least 1"),
    (["--concurrency", "0"], "--concurrency 0: one or more integers"),
    (["--concurrency", ","], "--concurrency : one or more integers"),
    (["--hf-batch-sizes", "8,0"], "--hf-batch-sizes 8,0: one or more integers"),
    (["--kv-cache-gib", "-1"], "--kv-cache-gib -1.0: must be > 0"),
    (["--skip", "hf,hff"], "--skip hff: unknown phase"),
    (["--offline-rounds", "0"], "--offline-rounds 0: at least 1"),
    (["--with", "vllm"], "--with only applies to --smoke"),
    (["--dtype", "fp8"], "argument --dtype: 'fp8': unknown dtype; one or more of fp32, bf16"),
    (["--dtype", ","], "argument --dtype: empty: one or more of fp32, bf16"),
    (["--quantize", "int4"], "argument --quantize: int4: one or more of int8, or none"),
    (["--mem-repeats", "0"], "--mem-repeats 0: at least 1"),
    (["--mem-bytes", "-1"], "--mem-bytes -1: at least 0"),
    (["--busy-cores", "-1"], "--busy-cores -1: at least 0"),
    (["--skip", "vllm_offline_fp16"], "--skip vllm_offline_fp16: unknown phase"),
    (["--option", "no_such_knob", "1"], "--option no_such_knob: not an option of this engine build"),
    (["--option", "dtype", "bf16"], "--option dtype: set by the benchmark (use --dtype)"),
])
def test_bad_options_are_refused_naming_the_option_and_its_rule(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_dtypes_take_the_aliases_once_each_in_order_and_quantize_none_turns_int8_off():
    args = bench.parse_args(["--dtype", "bfloat16,bf16,float32", "--quantize", "none"])
    assert args.dtype == ["bf16", "fp32"] and args.quantize == []
    default = bench.parse_args([])
    assert default.dtype == ["fp32", "bf16"] and default.quantize == ["int8"]


def test_skip_turns_off_a_phase_by_its_name_its_dtype_less_name_or_its_group():
    assert bench.skip_keys("vllm_offline_bf16") == {"vllm_offline_bf16", "vllm_offline", "vllm"}
    assert bench.skip_keys("ours_batch1_int8_fp32") == {"ours_batch1_int8_fp32", "ours_batch1_int8", "ours_batch1"}
    assert bench.skip_keys("llamacpp_batch1") == {"llamacpp_batch1", "llamacpp"}
    args = bench.parse_args(["--skip", "vllm_offline_bf16,ours_batch1,llamacpp"])
    assert args.skip == ["vllm_offline_bf16", "ours_batch1", "llamacpp"]


def test_every_documented_phase_name_is_accepted_by_skip():
    args = bench.parse_args(["--skip", ",".join(bench.PHASES)])
    assert set(args.skip) == set(bench.PHASES)


def test_smoke_records_why_it_turns_phases_off_and_says_which_sizes_it_replaces(capsys):
    args = bench.parse_args(["--smoke", "--num-prompts", "4"])
    assert "--num-prompts ignored" in capsys.readouterr().out
    assert (args.num_prompts, args.max_new_tokens, args.concurrency, args.threads) == (2, 8, [2], 1)
    assert args.smoke_skips == {"peak_end": "--smoke", "vllm": "--smoke (add --with vllm)"}
    assert {"peak_end", "vllm"} <= set(args.skip)
    with_vllm = bench.parse_args(["--smoke", "--with", "vllm"])
    assert "vllm" not in with_vllm.skip
    assert not with_vllm.transformers and bench.parse_args(["--smoke", "--with", "transformers"]).transformers
    assert bench.parse_args([]).transformers


def test_sigterm_unwinds_like_ctrl_c_so_finally_blocks_stop_the_engines():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        bench._unwind_on_sigterm()
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here and raises
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_run_records_the_commit_it_measured_and_whether_the_tree_was_changed(tmp_path):
    """bench.source_revision: HEAD's full hash and the tracked files' state, read with git; None for both
    outside a repository (a source tarball), never an error."""
    import subprocess

    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, check=True).stdout.strip() != ""
    assert bench.source_revision(REPO) == {"commit": head.stdout.strip(), "dirty": changed}
    assert bench.source_revision(tmp_path) == {"commit": None, "dirty": None}
