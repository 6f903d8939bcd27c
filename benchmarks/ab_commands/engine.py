"""`ab.py engine`: whole-engine batch-1 decode (scheduler, sampler, output processing too), two worker processes.

A command of benchmarks/ab.py, which calls engine_main; `ab.py engine --help` prints ENGINE_DOC.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from workload import REPO

ENGINE_DOC = """Interleaved A/B of whole-engine batch-1 decode, this checkout against another revision, in two worker processes.

Engine, scheduler, sampler and output processing are all included, not only the kernels. Each side is a worker
process holding its own Engine (the benchmark's offline settings, workload.bench_engine from this checkout, so
both sides are set up alike) over `--model`, from its own tree: this checkout, and
`--old-rev` checked out into a temporary git worktree (`<tmp>/lmi-ab-batch1-<commit>`, removed at the end). The
old tree's C++ kernels are built on first use into `<tmp>/lmi-ab-batch1-extensions` (TORCH_EXTENSIONS_DIR), so they
never replace this checkout's build (a build is named by its sources, and the two trees' builds would otherwise
take turns rebuilding each other); a second run against the same revision reuses it.

The parent sends each worker "go" in turn, the order flipping each round; a worker runs one request alone (the
workload's first MT-bench prompt, its ids taken modulo the model's vocabulary so that `profiling.py fixed-costs`'s
skeleton model can be the `--model`; `--tokens` greedy tokens, EOS ignored) and reports two rates: the benchmark's,
(tokens - 1) / (last token time - first token time) as workers.batch1_decode measures it, and one over the median
interval between tokens (a stall of the host moves it less). While one runs the other waits on a pipe (its OpenMP
threads asleep), so both see the same minutes of the host. Prints per round both sides' rates and new / old, then
the medians, the load average before and after (a busy host, e.g. a test suite running, makes single rounds swing
several-fold: read the medians, and rerun when the load was high), and whether the two sides' tokens were equal.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py engine --old-rev REV [--model model] [--dtype bf16]
        [--quantize int8] [--rounds 12] [--tokens 128] [--threads 2]

With `--model /tmp/lmi-skeleton-model` (`profiling.py fixed-costs`'s skeleton, written by its first run) the weights
stay in cache, and a change to what a step costs besides its weights shows above the noise of their stream.
"""


ENGINE_WORKER = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])    # this checkout's harness; lmi_handler from the tree it runs in
from workload import bench_engine, build_workload
from pathlib import Path
from lmi_handler.engine.sequence import SamplingParams
model, dtype, threads, tokens = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
engine = bench_engine(model, dtype, threads, sys.argv[6] or None)
prompt = [t % engine.runner.config.vocab_size for t in build_workload(Path(model), 1, tokens).prompt_token_ids[0]]
params = SamplingParams(greedy=True, max_new_tokens=tokens, ignore_eos=True)
print(json.dumps({"ready": True}), flush=True)
for n, line in enumerate(sys.stdin):
    engine.add_request(f"r{n}", prompt, params, seed=0)
    times, ids = [], []
    while engine.has_unfinished:
        for out in engine.step():
            now = time.perf_counter()
            for token in out.new_tokens:
                times.append(now)
                ids.append(token.id)
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    print(json.dumps({"rate": (len(times) - 1) / (times[-1] - times[0]), "median_rate": 1 / statistics.median(gaps),
                      "ids": ids}), flush=True)
"""


def start_worker(tree: Path, args, env_extra: dict[str, str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree), **env_extra)
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_WORKER, str(REPO / "benchmarks"), args.model, args.dtype, str(args.threads),
                             str(args.tokens), args.quantize or ""], cwd=tree, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line or not json.loads(line).get("ready"):
        raise RuntimeError(f"the worker in {tree} did not start (its error is above)")
    return proc


def run_round(proc: subprocess.Popen) -> dict:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("a worker ended in the middle of a round (its error is above)")
    return json.loads(line)


def git(*argv: str) -> str:
    """git's output; its own message in the error when it fails."""
    done = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"git {' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout.strip()


def engine_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=ENGINE_DOC.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--old-rev", default="HEAD", help="the revision to compare this checkout against")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"), help="the engines' dtype")
    p.add_argument("--quantize", choices=("int8",),
                   help="the engines' option.quantize on both sides: int8 weights, activations in --dtype")
    p.add_argument("--rounds", type=int, default=12, help="rounds; each runs one request on each side")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per request (EOS ignored), at least 2")
    p.add_argument("--threads", type=int, default=2, help="torch / kernel threads of each worker")
    p.add_argument("--model", default=str(REPO / "model"), help="a Llama checkpoint with a chat template")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.tokens < 2:
        p.error("--rounds must be at least 1 and --tokens at least 2")

    commit = git("rev-parse", "--verify", f"{args.old_rev}^{{commit}}")
    tmp = Path(tempfile.gettempdir())
    old_tree = tmp / f"lmi-ab-batch1-{commit[:12]}"
    if old_tree.exists():                       # left by a run that was killed
        if (old_tree / ".git").exists():
            git("worktree", "remove", "--force", str(old_tree))
        else:
            shutil.rmtree(old_tree)
    git("worktree", "add", "--detach", str(old_tree), commit)
    here = git("describe", "--always", "--dirty")
    kind = f"int8 weights, {args.dtype} activations" if args.quantize else args.dtype
    print(f"new = this checkout ({here}), old = {args.old_rev} ({commit[:12]}); {kind}, {args.threads} threads, "
          f"{args.tokens} tokens, model {args.model}; each round both sides, the first flipping (new first in even "
          f"rounds)", flush=True)
    sides: dict[str, subprocess.Popen] = {}
    load_before = os.getloadavg()
    try:
        sides["new"] = start_worker(REPO, args, {})
        sides["old"] = start_worker(old_tree, args, {"TORCH_EXTENSIONS_DIR": str(tmp / "lmi-ab-batch1-extensions")})
        for proc in sides.values():              # one untimed request each (first-use costs)
            run_round(proc)
        rates: dict[str, list[dict]] = {"new": [], "old": []}
        for r in range(args.rounds):
            for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
                rates[name].append(run_round(sides[name]))
            new, old = rates["new"][-1], rates["old"][-1]
            print(f"round {r}: new {new['rate']:.1f}, old {old['rate']:.1f} tok/s, new / old {new['rate'] / old['rate']:.3f}; "
                  f"over the median interval new {new['median_rate']:.1f}, old {old['median_rate']:.1f}, "
                  f"{new['median_rate'] / old['median_rate']:.3f}", flush=True)
    finally:
        for proc in sides.values():
            if proc.poll() is None:
                proc.stdin.close()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        git("worktree", "remove", "--force", str(old_tree))
    load_after = os.getloadavg()
    print(f"{kind}, new = this checkout ({here}), old = {args.old_rev} ({commit[:12]}); load average (1 min) "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")
    for key, label in (("rate", "tokens a second"), ("median_rate", "over the median interval between tokens")):
        ratios = [a[key] / b[key] for a, b in zip(rates["new"], rates["old"])]
        print(f"  {label}: new {statistics.median(x[key] for x in rates['new']):.1f}, old "
              f"{statistics.median(x[key] for x in rates['old']):.1f} (medians); new / old median "
              f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    print(f"  same tokens: {rates['new'][0]['ids'] == rates['old'][0]['ids']}")
