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
    (["--readme-from", "/no/such/result.json"], "no such file"),
    (["--with", "vllm"], "--with only applies to --smoke"),
])
def test_bad_options_are_refused_naming_the_option_and_its_rule(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_every_documented_phase_name_is_accepted_by_skip():
    args = bench.parse_args(["--skip", ",".join(bench.PHASES)])
    assert set(args.skip) == set(bench.PHASES)


def test_smoke_records_why_it_turns_phases_off_and_says_which_sizes_it_replaces(capsys):
    args = bench.parse_args(["--smoke", "--num-prompts", "4"])
    assert "--num-prompts ignored" in capsys.readouterr().out
    assert (args.num_prompts, args.max_new_tokens, args.concurrency, args.threads) == (2, 8, [2], 1)
    assert args.smoke_skips == {"peak_end": "--smoke", "vllm": "--smoke (add --with vllm)"}
    assert {"peak_end", "vllm"} <= set(args.skip) and not args.plain
    with_vllm = bench.parse_args(["--smoke", "--with", "vllm,plain"])
    assert "vllm" not in with_vllm.skip and with_vllm.plain


def test_sigterm_unwinds_like_ctrl_c_so_finally_blocks_stop_the_engines():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        bench._unwind_on_sigterm()
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here and raises
    finally:
        signal.signal(signal.SIGTERM, previous)
