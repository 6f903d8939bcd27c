"""The offline workers' side of the rounds protocol: announce ready, run one round per command, a file per round.

Owns the wire between a long-lived offline worker (workers.py ours-offline, vllm_worker.py) and
bench.py's driver (offline_rounds.py), which round a worker's top-level figures come from, and the latency
percentiles (TTFT, ITL) every process reports.
Commands are lines on the worker's stdin and results are JSON files in its control directory, so
nothing an engine prints on stdout/stderr can break it. Plain Python: both venvs import it.

    worker                                        driver (offline_rounds.py)
    load, warm up; write DIR/ready.json           waits for ready.json (or the worker's exit)
    reads "run K"; runs once; DIR/round-K.json    waits for round-K.json
    reads "finish"; batch-1; writes --out; exits  waits for the exit, reads --out
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

READY = "ready.json"
# a round record's fields that describe the round, not the workload run (left out of the top level)
ROUND_ONLY_KEYS = ("round", "start_unix_s", "end_unix_s", "same_token_ids_as_first_round")


def round_file(k: int) -> str:
    return f"round-{k}.json"


def write_json(path: Path, obj: dict) -> None:
    """Write `obj` to `path` atomically (a reader polling for the file never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def serve(control_dir: Path, ready: dict, run_round: Callable[[int], dict],
          commands: Iterable[str] = sys.stdin) -> list[dict]:
    """Write ready.json, then run one round per "run K" line until "finish"; return the rounds in order.

    `run_round(k)` runs the workload once and returns its wall_s, output_tokens, output_tokens_per_s,
    latency stats and output_token_ids. Each round's record adds the round number, its wall-clock start
    and end (time.time(), seconds since the epoch) and whether its token ids equal the first round's;
    the ids themselves stay only in the first round's record (and file).
    Raises ValueError on an unknown command, EOFError if the commands end before "finish".
    """
    write_json(control_dir / READY, ready)
    rounds: list[dict] = []
    first_ids = None
    for line in commands:
        words = line.split()
        if words == ["finish"]:
            return rounds
        if len(words) != 2 or words[0] != "run" or not words[1].isdigit():
            raise ValueError(f"unknown command {line!r}: expected 'run K' or 'finish'")
        k = int(words[1])
        start = time.time()
        result = run_round(k)
        end = time.time()
        ids = result.pop("output_token_ids")
        first_ids = ids if first_ids is None else first_ids
        record = {"round": k, "start_unix_s": start, "end_unix_s": end, **result,
                  "same_token_ids_as_first_round": ids == first_ids}
        if not rounds:
            record["output_token_ids"] = ids
        write_json(control_dir / round_file(k), record)
        rounds.append(record)
    raise EOFError("stdin closed before 'finish' (the driver is gone)")


def headline(result: dict) -> str:
    """A round's figures (or a worker's median round's) in a few words: "N tokens in W s = R tok/s"; for a
    batch-1 round, whose rate is its decode rate, "N tokens in W s, decode R tok/s (prefill excluded)"."""
    rate = result.get("output_tokens_per_s")
    rate_text = "–" if rate is None else f"{rate:.1f}"
    head = f"{result.get('output_tokens', 0)} tokens in {result.get('wall_s', 0):.1f} s"
    if "decode_tokens_per_s" in result:
        return f"{head}, decode {rate_text} tok/s (prefill excluded)"
    return f"{head} = {rate_text} tok/s"


def median_round(rounds: list[dict]) -> dict:
    """The round of median output tok/s; of an even number, the slower of the middle two (as
    statistics.median_low), so that every top-level field is one real round's."""
    by_rate = sorted(rounds, key=lambda r: r["output_tokens_per_s"])
    return by_rate[(len(by_rate) - 1) // 2]


def summarize(rounds: list[dict]) -> dict:
    """A worker's round fields for its final JSON: the median round's fields at the top level (report.py
    and its tables read those), which round that was, every round, and the first round's token ids
    (the greedy-agreement check). Raises ValueError when no round was run."""
    if not rounds:
        raise ValueError("'finish' before any 'run K': no round to report")
    ids = rounds[0].get("output_token_ids")
    rounds = [{k: v for k, v in r.items() if k != "output_token_ids"} for r in rounds]
    median = median_round(rounds)
    top = {k: v for k, v in median.items() if k not in ROUND_ONLY_KEYS}
    return {**top, "median_round": median["round"], "num_rounds": len(rounds), "rounds": rounds,
            "output_token_ids": ids}


def percentiles(values: list[float]) -> dict | None:
    """mean, p50, p90, p99, min, max of `values` (linear interpolation between ranks); None when empty."""
    if not values:
        return None
    values = sorted(values)

    def pct(p: float) -> float:
        k = (len(values) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (k - lo)

    return {"n": len(values), "mean": statistics.fmean(values), "p50": pct(0.5), "p90": pct(0.9),
            "p99": pct(0.99), "min": values[0], "max": values[-1]}
