"""`ab.py linears`: the packed linear, weights from DRAM (30 layers' worth, a decode step's call order), old vs new
kernels.

A command of benchmarks/ab.py, which calls linears_main; `ab.py linears --help` prints LINEARS_DOC.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from ab_commands.revision import old_kernels

from lmi_handler.engine.model.kernels import bf16_dot_form, cpu_kernels, pack_weight

LINEARS_DOC = """Interleaved A/B of the packed linear with its weights coming from DRAM: this checkout's C++ kernels against
another revision's, in one process (old_kernels builds the old sources as an extension of their own).

Packs 30 layers' worth of distinct random weights of the demo model's four linear shapes (qkv 960 x 576, o
576 x 576, gate_up 3072 x 576, down 576 x 1536) in `kind`, then times one sweep of the 120 calls in a decode
step's order (each layer's four linears, then the next layer's), old and new alternating, `rounds` sweeps each.
Prints per shape the median sweep time (ms, wall) of each build and new/old, and the per-round ratios of the
whole sweep. (`ab.py batch1 --linears` repeats one weight: hot in cache, the per-call cost.)

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py linears [--rows 64] [--old-rev HEAD] [--kind float32]
        [--threads 2] [--rounds 12]
"""

LINEAR_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}   # (out, in)
LINEAR_LAYERS = 30


def linears_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=LINEARS_DOC.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--old-rev", default="HEAD")
    p.add_argument("--kind", default="float32", choices=("float32", "bfloat16", "int8"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    mods = {"old": old_kernels(args.old_rev), "new": cpu_kernels()}
    form = bf16_dot_form() if args.kind == "bfloat16" else 0
    layers = [{n: pack_weight(torch.randn(o, i) * 0.05, args.kind) for n, (o, i) in LINEAR_SHAPES.items()}
              for _ in range(LINEAR_LAYERS)]
    xs = {n: torch.randn(args.rows, i) for n, (o, i) in LINEAR_SHAPES.items()}
    times = {(m, n): [] for m in mods for n in LINEAR_SHAPES}
    totals: dict[str, list[float]] = {m: [] for m in mods}
    for r in range(args.rounds):
        for mode in (("old", "new") if r % 2 == 0 else ("new", "old")):
            mod, spent = mods[mode], dict.fromkeys(LINEAR_SHAPES, 0.0)
            for layer in layers:
                for n in LINEAR_SHAPES:
                    w = layer[n]
                    start = time.perf_counter()
                    mod.linear(xs[n], w.panels, w.out_features, None, w.scale, False, form)
                    spent[n] += time.perf_counter() - start
            for n in LINEAR_SHAPES:
                times[(mode, n)].append(spent[n])
            totals[mode].append(sum(spent.values()))
    print(f"{args.kind}, {args.rows} rows, {args.threads} threads, {args.rounds} rounds, old = {args.old_rev}")
    for n in LINEAR_SHAPES:
        old, new = statistics.median(times[("old", n)]), statistics.median(times[("new", n)])
        print(f"{n:8s} old {old * 1e3:8.2f} ms new {new * 1e3:8.2f} ms  new/old {new / old:.3f}")
    old, new = statistics.median(totals["old"]), statistics.median(totals["new"])
    print(f"all {4 * LINEAR_LAYERS} old {old * 1e3:8.2f} ms new {new * 1e3:8.2f} ms  new/old {new / old:.3f}; per round",
          [round(b / a, 3) for a, b in zip(totals["old"], totals["new"])])
