"""Interleaved A/B of whole-engine batch-1 decode: this checkout against another revision, two worker processes
taking turns (engine, scheduler, sampler and output processing included, not only the kernels).

Each side is a worker process holding its own Engine (the benchmark's offline settings,
profile_breakdown.bench_engine) over the demo model, from its own tree: this checkout, and `--old-rev` checked out
into a temporary git worktree (its C++ kernels built on first use, as any checkout builds them). The parent
sends each worker "go" in turn, the order flipping each round; a worker runs one request alone (the
workload's first MT-bench prompt, its ids taken modulo the model's vocabulary so that
profile_fixed_costs.py's skeleton model can be the `--model`, `--tokens` greedy tokens, EOS ignored) and reports its decode rate: (tokens - 1)
/ (last token time - first token time), as workers.batch1_decode measures it. While one runs the other waits
on a pipe (its OpenMP threads asleep), so both see the same minutes of the host. Prints each side's median
tokens a second, new / old per round and their median, and whether the two sides' tokens were equal.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab_batch1.py [--old-rev HEAD] [--dtype bf16] [--rounds 12]
        [--tokens 128] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1] + "/benchmarks")
from profile_breakdown import bench_engine
from workload import build_workload
from pathlib import Path
from lmi_handler.engine.sequence import SamplingParams
model, dtype, threads, tokens = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
engine = bench_engine(model, dtype, threads)
prompt = [t % engine.runner.config.vocab_size for t in build_workload(Path(model), 1, tokens).prompt_token_ids[0]]
params = SamplingParams(greedy=True, max_new_tokens=tokens, ignore_eos=True)
huge = [l.split()[1] for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print(json.dumps({"ready": True, "anon_huge_kib": int(huge[0]) if huge else None}), flush=True)
for n, line in enumerate(sys.stdin):
    engine.add_request(f"r{n}", prompt, params, seed=0)
    times, ids = [], []
    while engine.has_unfinished:
        for out in engine.step():
            now = time.perf_counter()
            for token in out.new_tokens:
                times.append(now)
                ids.append(token.id)
    print(json.dumps({"rate": (len(times) - 1) / (times[-1] - times[0]), "ids": list(ids)}), flush=True)
"""


def start_worker(tree: Path, args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tree), args.model, args.dtype, str(args.threads),
                             str(args.tokens)], cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    if not line or not json.loads(line).get("ready"):
        raise RuntimeError(f"the worker in {tree} did not start")
    print(f"worker in {tree}: {json.loads(line)['anon_huge_kib'] / 1024:.0f} MiB of anonymous huge pages", flush=True)
    return proc


def run_round(proc: subprocess.Popen) -> dict:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old-rev", default="HEAD", help="the revision to compare this checkout against")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--rounds", type=int, default=12, help="rounds; each runs one request on each side")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per request (EOS ignored)")
    p.add_argument("--threads", type=int, default=2, help="torch / kernel threads of each worker")
    p.add_argument("--model", default=str(REPO / "model"))
    args = p.parse_args(argv)

    old_tree = Path(tempfile.mkdtemp(prefix="ab-batch1-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old_tree), args.old_rev], check=True,
                   capture_output=True)
    try:
        sides = {"new": start_worker(REPO, args), "old": start_worker(old_tree, args)}
        for proc in sides.values():              # one untimed request each (first-use costs)
            run_round(proc)
        rates: dict[str, list[float]] = {"new": [], "old": []}
        ids = {}
        for r in range(args.rounds):
            for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
                out = run_round(sides[name])
                rates[name].append(out["rate"])
                ids.setdefault(name, out["ids"])
            print(f"round {r}: new {rates['new'][-1]:.1f}, old {rates['old'][-1]:.1f} tok/s, "
                  f"new / old {rates['new'][-1] / rates['old'][-1]:.3f}", flush=True)
        for proc in sides.values():
            proc.stdin.close()
            proc.wait()
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old_tree)], capture_output=True)
    ratios = [a / b for a, b in zip(rates["new"], rates["old"])]
    print(f"{args.dtype}, {args.threads} threads, {args.tokens} tokens, old = {args.old_rev}: new "
          f"{statistics.median(rates['new']):.1f}, old {statistics.median(rates['old']):.1f} tokens a second (median); "
          f"new / old median {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}); "
          f"same tokens: {ids['new'] == ids['old']}")


if __name__ == "__main__":
    main()
