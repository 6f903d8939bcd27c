"""`ab.py batch1`: batch-1 (or small-batch) decode steps of a ModelRunner, old vs new kernels in one process.

A command of benchmarks/ab.py, which calls batch1_main; `ab.py batch1 --help` prints BATCH1_DOC.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from ab_commands.revision import old_kernels
from profiling_commands.kernels import DTYPE_VARIANTS, decode_batch, read_bandwidth_gbs, weight_bytes
from profiling_commands.kernels import SHAPES as KERNEL_SHAPES
from workload import REPO

from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.backends import cpp
from lmi_handler.engine.model.kernels import build, cpu_kernels, pack_weight
from lmi_handler.engine.model.quant import QuantWeight
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import SchedulerOutput

BATCH1_DOC = """Interleaved A/B of batch-1 (or small-batch) decode steps: this checkout's C++ kernels against another
revision's, in one process (each built as its own extension; the packed layouts must be the same).

Per dtype variant one ModelRunner; each round times `--steps` steps with the old kernels and with the new,
the order alternating, after one untimed step each; a read-bandwidth measurement opens each round. A
revision whose DecoderStack took 14 tensors a layer gets them (SlotStack), and walks the ops where a linear is
quantized (as it did); each side's form is printed. `--linears` instead times the packed linear of the demo model's shapes (weights hot
in cache: the per-call cost, not the stream). `--clock cpu` is this thread's CPU time (use with
`--threads 1` on a busy machine).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py batch1 --old-rev main [--threads 1 --clock cpu]
"""

class SlotStack(cpp.DecoderStack):
    """cpp.DecoderStack on a revision's kernels from before StackLayer: its DecoderStack took each layer as a
    positional list of 14 tensors (and the intermediate width)."""

    def _build(self, ops) -> None:
        shape = self._shape
        weights = [[w.attn_pre, w.qkv.panels, w.qkv.scale, w.qkv_bias, w.o.panels, w.o.scale, w.o_bias, w.mlp_pre,
                    w.gate_up.panels, w.gate_up.scale, w.gate_up_bias, w.down.panels, w.down.scale, w.down_bias]
                   for w in self.layers]
        self.ops, self.kernel = ops, ops.DecoderStack(
            weights, self.final_norm, shape["num_heads"], shape["num_kv_heads"],
            self.layers[0].gate_up.out_features // 2, shape["eps"], shape["norm_eps"], shape["scale"])


def old_stack(model, old):
    """The whole-stack operation revision `old` (a kernel module) would run for `model`, built on it (call with
    it as the process's module): this checkout's form where it has StackLayer, else its 14-slot form, and none
    (the ops walked, as that revision did) where a linear is quantized (QuantWeight) or the model has no stack."""
    if model.stack is None:
        return None
    args = (model.spec, model.layer_weights, model.final_norm, model.num_heads, model.num_kv_heads)
    if hasattr(old, "StackLayer"):
        return cpp.DecoderStack(*args)
    if any(isinstance(getattr(w, role), QuantWeight) for w in model.layer_weights for role in cpp.STACK_LINEARS):
        return None
    return SlotStack(*args)


def batch1_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=BATCH1_DOC.splitlines()[0])
    p.add_argument("--old-rev", default="main")
    p.add_argument("--model-dir", type=Path, default=REPO / "model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variants", default="fp32,bf16,int8,int8-bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--linears", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    mods = {"new": cpu_kernels(), "old": old_kernels(args.old_rev)}
    stacks = {}          # (variant, mode) -> the model's whole-stack operation on that side

    def use(mode, name=None):
        build._state["module"] = mods[mode]
        if name is not None:
            runners[name][0].model.stack = stacks[(name, mode)]

    def order(r):
        return ("old", "new") if r % 2 == 0 else ("new", "old")

    print("load", os.getloadavg(), "threads", args.threads, "clock", args.clock, flush=True)
    if args.linears:
        for kind in ("bfloat16", "float32", "int8"):
            for name, (k, n) in KERNEL_SHAPES.items():
                w = pack_weight(torch.randn(n, k) * 0.05, kind, True)
                x = torch.randn(args.batch, k).to(torch.bfloat16 if kind == "bfloat16" else torch.float32)
                ys, t = {}, {"old": [], "new": []}
                for r in range(args.rounds):
                    for mode in order(r):
                        def call(mod=mods[mode], x=x, w=w, n=n):
                            return mod.linear(x, w.panels, n, None, w.scale, False, False)
                        ys[mode] = call()
                        start = clock()
                        for _ in range(20):
                            call()
                        t[mode].append((clock() - start) / 20 * 1e6)
                assert torch.equal(ys["old"], ys["new"]), (kind, name)
                med = {m: sorted(v)[len(v) // 2] for m, v in t.items()}
                print(f"{kind:9s} {name:8s} M={args.batch}: old {med['old']:8.1f} us (min {min(t['old']):7.1f}), "
                      f"new {med['new']:8.1f} us (min {min(t['new']):7.1f})", flush=True)
        return
    runners = {}
    for name in args.variants.split(","):
        dtype, quantize = DTYPE_VARIANTS[name]
        runner = ModelRunner(args.model_dir, dtype, torch.device("cpu"), block_size=16, num_blocks=64 * args.batch,
                             quantize=quantize)
        seqs = decode_batch(runner, BlockAllocator(runner.num_blocks, runner.block_size), args.batch, 200)
        runners[name] = (runner, SchedulerOutput(seqs=seqs, num_scheduled_tokens=[1] * args.batch))
        stacks[(name, "new")] = runner.model.stack
        use("old")
        stacks[(name, "old")] = old_stack(runner.model, mods["old"])
        use("new")
        print(f"{name}: new {'fused stack' if stacks[(name, 'new')] else 'walk'}, "
              f"old {'fused stack' if stacks[(name, 'old')] else 'walk'}", flush=True)
    times = {(n, m): [] for n in runners for m in ("old", "new")}
    bandwidth = []
    for r in range(args.rounds):
        bandwidth.append(read_bandwidth_gbs())
        for name, (runner, sched) in runners.items():
            for mode in order(r):
                use(mode, name)
                runner.execute(runner.prepare(sched))
                start = clock()
                for _ in range(args.steps):
                    runner.execute(runner.prepare(sched))
                times[(name, mode)].append((clock() - start) / args.steps * 1e3)
    gbs = sorted(bandwidth)[len(bandwidth) // 2]
    print(f"read GB/s median {gbs:.1f}, all {[round(b, 1) for b in bandwidth]}, load after {os.getloadavg()}")
    for name, (runner, _) in runners.items():
        ceiling = gbs * 1e9 / weight_bytes(runner.model)
        old, new = (sorted(times[(name, m)])[len(times[(name, m)]) // 2] for m in ("old", "new"))
        print(f"{name:10s} batch {args.batch}: old {old:6.2f} ms (min {min(times[(name, 'old')]):6.2f}), new {new:6.2f} "
              f"ms (min {min(times[(name, 'new')]):6.2f}); ceiling {ceiling:6.1f} tok/s: old {1e3 / old / ceiling:.2f}, "
              f"new {1e3 / new / ceiling:.2f}", flush=True)
        ratios = [b / a for a, b in zip(times[(name, "old")], times[(name, "new")])]
        print(f"{'':10s} new/old per round {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}",
              flush=True)
