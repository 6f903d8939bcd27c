"""`profiling.py steps`: the offline run's wall time, step by step (prefill apart from decode; CPU time beside wall
time).

A command of benchmarks/profiling.py, which calls steps_main; `profiling.py steps --help` prints STEPS_DOC.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from profiling_commands.breakdown import ENGINE_PARTS, time_parts
from workers import drop_prefix_cache
from workload import REPO, bench_engine, build_workload

from lmi_handler.engine.sequence import SamplingParams

STEPS_DOC = """Where the offline run's wall time goes, step by step (demo model, in-process, no server).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profiling.py steps [--dtype fp32|bf16] [--threads 2] [--rounds 1]

Runs the benchmark's offline workload (workload.build_workload: the first 64 MT-bench prompts, 128 greedy
tokens, EOS ignored) through one Engine as workers.ours_offline does (a 2-token warm-up, then every request
at once, stepped to the end; the prefix cache emptied before each round) and records each Engine.step: its
wall time (time.perf_counter), the process's CPU time over all threads (time.process_time: OpenMP workers,
spinning included), the main thread's CPU time, the scheduled tokens and sequences, and the wall seconds of
the step's engine parts (schedule, prepare, execute, sample, output processing, ...). Prints, per round, the
whole run and the prefill steps (more scheduled tokens than sequences) apart from the decode steps.
"""

def steps_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=STEPS_DOC.splitlines()[0])
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--model", default=str(REPO / "model"))
    args = p.parse_args(argv)


    engine = bench_engine(args.model, args.dtype, args.threads)
    work = build_workload(Path(args.model), 64, 128)
    step_parts: dict[str, float] = {}

    def record(label, out, seconds):
        step_parts[label] = step_parts.get(label, 0.0) + seconds
        if label == "schedule":
            step_parts["tokens"], step_parts["seqs"] = sum(out.num_scheduled_tokens), len(out.seqs)

    time_parts(engine, time.perf_counter, record)
    warm = SamplingParams(greedy=True, max_new_tokens=2, ignore_eos=True)
    for i, ids in enumerate(work.prompt_token_ids):
        engine.add_request(f"warmup-{i}", ids, warm, seed=0)
    while engine.has_unfinished:
        engine.step()
    params = SamplingParams(greedy=True, max_new_tokens=128, ignore_eos=True)
    for k in range(args.rounds):
        drop_prefix_cache(engine.allocator)
        for i, ids in enumerate(work.prompt_token_ids):
            engine.add_request(f"r{k}-{i}", ids, params, seed=0)
        steps = []
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        start, cpu = time.perf_counter(), time.process_time()
        while engine.has_unfinished:
            step_parts.clear()
            wall, proc, main_cpu = time.perf_counter(), time.process_time(), time.thread_time()
            engine.step()
            steps.append({**step_parts, "wall": time.perf_counter() - wall, "proc": time.process_time() - proc,
                          "main": time.thread_time() - main_cpu})
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"round {k + 1} (load {load}): wall {wall:.2f} s, process CPU {cpu:.2f} s ({cpu / wall:.2f} cores), "
              f"{len(steps)} steps")
        prefill = [s for s in steps if s["tokens"] > s["seqs"]]
        decode = [s for s in steps if s["tokens"] == s["seqs"]]
        for label, sel in (("prefill", prefill), ("decode", decode)):
            parts = ", ".join(f"{label} {sum(s.get(label, 0.0) for s in sel):.2f}" for _, _, label in ENGINE_PARTS)
            print(f"  {label}: {len(sel)} steps, {sum(s['tokens'] for s in sel)} tokens, wall "
                  f"{sum(s['wall'] for s in sel):.2f} s, process CPU {sum(s['proc'] for s in sel):.2f} s, main thread "
                  f"CPU {sum(s['main'] for s in sel):.2f} s; parts (wall s): {parts}")
        if decode:
            walls = [s["wall"] * 1e3 for s in decode]
            print(f"  decode step wall ms: median {statistics.median(walls):.1f}, least {min(walls):.1f}")
