"""`ab.py batch1`: batch-1 (or small-batch) decode steps of a ModelRunner, old vs new kernels in one process.

A command of benchmarks/ab.py, which calls batch1_main; `ab.py batch1 --help` prints BATCH1_DOC.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import types
from pathlib import Path

import torch
from ab_commands.revision import old_kernels
from profiling_commands.kernels import DTYPE_VARIANTS, decode_batch, read_bandwidth_gbs, weight_bytes
from profiling_commands.kernels import SHAPES as KERNEL_SHAPES
from workload import REPO

from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.kernels import BF16_DP, bf16_dot_form, build, cpu_kernels, pack_weight
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import SchedulerOutput

BATCH1_DOC = """Interleaved A/B of batch-1 (or small-batch) decode steps: this checkout's C++ kernels against another
revision's, in one process (each built as its own extension; the packed layouts must be the same).

Per dtype variant one ModelRunner; each round times `--steps` steps with the old kernels and with the new,
the order alternating, after one untimed step each; a read-bandwidth measurement opens each round. A
revision without DecoderStack runs its decoder_layer once per layer from Python (main's _forward_fused
before the stack). `--linears` instead times the packed linear of the demo model's shapes (weights hot
in cache: the per-call cost, not the stream). `--clock cpu` is this thread's CPU time (use with
`--threads 1` on a busy machine).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py batch1 --old-rev main [--threads 1 --clock cpu]
"""

def layer_loop(self, x, cos, sin, kv_caches, meta):
    """_forward_fused as it was before DecoderStack: one decoder_layer call per layer."""
    a, ops, native = self.args, cpu_kernels(), bf16_dot_form() == BF16_DP   # revisions before AMX took a bool
    x = x.contiguous().clone()
    cos, sin = cos.contiguous(), sin.contiguous()
    for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gate_up, down = attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight
        ops.decoder_layer(x, layer.input_layernorm.weight, qkv.panels, qkv.scale, attn.qkv_bias,
                          o.panels, o.scale, attn.o_bias, layer.post_attention_layernorm.weight,
                          gate_up.panels, gate_up.scale, mlp.gate_up_bias, down.panels, down.scale, mlp.down_bias,
                          cos, sin, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.context_lens,
                          meta.cu_seqlens_q, a.num_heads, a.num_kv_heads, a.intermediate_size,
                          layer.input_layernorm.eps, attn.scale, native)
    return ops.add_rmsnorm(x, None, self.norm.weight, self.norm.eps)


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
    loop = not hasattr(mods["old"], "DecoderStack")

    def use(mode, model=None):
        build._state["module"] = mods[mode]
        if model is not None:
            if mode == "old" and loop:
                model._forward_fused = types.MethodType(layer_loop, model)
            else:
                model.__dict__.pop("_forward_fused", None)

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
    times = {(n, m): [] for n in runners for m in ("old", "new")}
    bandwidth = []
    for r in range(args.rounds):
        bandwidth.append(read_bandwidth_gbs())
        for name, (runner, sched) in runners.items():
            for mode in order(r):
                use(mode, runner.model)
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
