"""`profiling.py kernels`: the batch-invariant CPU kernels against MKL and the tiled path; --dtypes: batch-1 decode per
dtype.

A command of benchmarks/profiling.py, which calls kernels_main; `profiling.py kernels --help` prints KERNELS_DOC.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from workload import REPO

from lmi_handler.engine.kv_cache import BlockAllocator, num_blocks_needed
from lmi_handler.engine.model.attention import AttentionMetadata, attention_paged, attention_per_sequence
from lmi_handler.engine.model.kernels import BF16_AMX, BF16_DP, BF16_FMA, cpu_kernels, pack_weight, packed_linear
from lmi_handler.engine.model.linear import INVARIANT_TILE, tiled_matmul
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import SamplingParams, Sequence

KERNELS_DOC = """Microbenchmark of the batch-invariant CPU kernels against MKL and the previous tiled path.

Per op (the demo model's shapes): packed C++ linear in float32, bfloat16 (FMA form, and VDPBF16PS where
the CPU has it) and int8 vs F.linear in float32 and bfloat16 (MKL / oneDNN, not invariant) vs 16-row
tiled bmm (the PyTorch fallback) at M = 1, 16, 64; paged attention vs one SDPA call per
sequence for a 64-sequence decode step; and a whole ModelRunner decode step at batch 1 and 64
(KV contents are left as they are: timing only), both with the fused C++ decoder stack (the
default) and op by op (DecoderModel's walk with `stack` None); `--profile` adds a torch.profiler per-op breakdown of a batch-1 step of each. Best of a few runs, wall clock;
on a shared machine the numbers are noisy, so the load average is written alongside, and
`--threads 1 --clock cpu` (process CPU time) gives what one idle core would take.
`--dtypes fp32,bf16,int8` instead runs an interleaved batch-1 decode A/B of one runner per precision in
this process, with the same-run read bandwidth and the resulting ceiling (bench_decode_dtypes).
Writes benchmarks/results/kernels-<date>.json.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profiling.py kernels [--model-dir model --threads 2]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/profiling.py kernels --dtypes fp32,bf16,int8 [--threads 1 --clock cpu]
"""

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
kernel_clock = time.perf_counter


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = kernel_clock()
        fn()
        best = min(best, kernel_clock() - start)
    return best * 1e3


def bench_linears(repeats: int) -> list[dict]:
    """Per linear shape and row count: our packed kernel in each weight kind (float32, bfloat16 as
    packed_linear picks it (bf16_form.bf16_dot_form) and, where the CPU has VDPBF16PS, through it
    (vdpbf16ps_ms; above 4 rows) and in the FMA form (bf16_fma_ms), through AMX tiles where it has them
    (amx_ms), int8) against torch's F.linear in float32 and bfloat16
    (oneDNN/MKL, not batch-invariant) and the 16-row tiled bmm (the PyTorch fallback)."""
    module = cpu_kernels()
    rows = []
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k) * 0.02
        packed = {kind: pack_weight(weight, kind) for kind in ("float32", "bfloat16", "int8")}
        weight_bf16 = weight.to(torch.bfloat16)
        for m in (1, 16, 64):
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            r = max(2, repeats // 10) if name == "lm_head" else repeats
            row = {"op": name, "M": m, "K": k, "N": n,
                   "packed_ms": best_ms(lambda x=x, p=packed["float32"]: packed_linear(x, p, None), r),
                   "packed_bf16_ms": best_ms(lambda x=xb, p=packed["bfloat16"]: packed_linear(x, p, None), r),
                   "packed_int8_ms": best_ms(lambda x=xb, p=packed["int8"]: packed_linear(x, p, None), r),
                   "mkl_ms": best_ms(lambda x=x, w=weight: F.linear(x, w), r),
                   "torch_bf16_ms": best_ms(lambda x=xb, w=weight_bf16: F.linear(x, w), r),
                   "tiled16_ms": best_ms(lambda x=x, w=weight: tiled_matmul(x, w, INVARIANT_TILE), r)}
            p = packed["bfloat16"]
            if module.NATIVE_BF16:
                row["vdpbf16ps_ms"] = best_ms(lambda x=xb, p=p, n=n: module.linear(x, p.panels, n, None, None, True, BF16_DP), r)
                row["bf16_fma_ms"] = best_ms(lambda x=xb, p=p, n=n: module.linear(x, p.panels, n, None, None, True, BF16_FMA), r)
            if module.HAS_AMX and module.amx_permitted():
                row["amx_ms"] = best_ms(lambda x=xb, p=p, n=n: module.linear(x, p.panels, n, None, None, True, BF16_AMX), r)
            rows.append(row)
            print(rows[-1], flush=True)
    return rows


def bench_attention(repeats: int, num_seqs: int = 64, context: int = 200) -> dict:
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    per_seq = num_blocks_needed(context, block)
    k_cache = torch.randn(num_seqs * per_seq, block, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(num_seqs * per_seq, dtype=torch.int32).view(num_seqs, per_seq)
    meta = AttentionMetadata(slot_mapping=torch.zeros(num_seqs, dtype=torch.int64), block_tables=tables,
                             context_lens=torch.full((num_seqs,), context, dtype=torch.int32),
                             cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32),
                             query_lens=[1] * num_seqs, context_lens_host=[context] * num_seqs, block_size=block)
    q = torch.randn(num_seqs, heads, head_dim)
    return {"num_seqs": num_seqs, "context": context,
            "paged_ms": best_ms(lambda: attention_paged(q, k_cache, v_cache, meta, 0.125), repeats),
            "per_sequence_sdpa_ms": best_ms(lambda: attention_per_sequence(q, k_cache, v_cache, meta, 0.125),
                                            repeats)}


def decode_batch(runner: ModelRunner, allocator: BlockAllocator, num_seqs: int, context: int) -> list[Sequence]:
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(f"r{i}", [(7 * i + t) % 1000 + 1 for t in range(context)], SamplingParams())
        seq.block_table = allocator.allocate(num_blocks_needed(context, runner.block_size))
        seq.num_computed_tokens = context - 1        # decode of the last token; KV left as is
        seqs.append(seq)
    return seqs


def bench_decode_step(model_dir: Path, repeats: int, profile: bool) -> list[dict]:
    runner = ModelRunner(model_dir, torch.float32, torch.device("cpu"), block_size=16, num_blocks=2048)
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    results = []
    stack = runner.model.stack
    for fused in (True, False):
        runner.model.stack = stack if fused else None
        result = {"fused_layers": fused}
        for num_seqs, context in ((1, 200), (64, 200)):
            seqs = decode_batch(runner, allocator, num_seqs, context)
            ms = best_ms(lambda seqs=seqs, n=num_seqs: runner.execute(runner.prepare(SchedulerOutput(seqs=seqs, num_scheduled_tokens=[1] * n))), repeats)
            result[f"step_ms_batch{num_seqs}"] = ms
            result[f"tok_s_batch{num_seqs}"] = num_seqs / ms * 1e3
            if profile and num_seqs == 1:
                result["profile_batch1"] = profile_step(runner, seqs)
            for seq in seqs:
                allocator.free(seq.block_table)
        print({k: v for k, v in result.items() if k != "profile_batch1"}, flush=True)
        results.append(result)
    runner.model.stack = stack
    return results


def profile_step(runner: ModelRunner, seqs: list[Sequence], steps: int = 5, top: int = 15) -> dict:
    """Per-op self CPU time of `steps` decode steps (torch.profiler), per step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    runner.execute(runner.prepare(SchedulerOutput(seqs=seqs, num_scheduled_tokens=[1] * len(seqs))))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.execute(runner.prepare(SchedulerOutput(seqs=seqs, num_scheduled_tokens=[1] * len(seqs))))
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events) / steps
    ops = [{"op": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": e.self_cpu_time_total / steps / 1e3}
           for e in events[:top]]
    print(f"profile ({total_us / 1e3:.1f} ms/step self CPU, {sum(e.count for e in events) / steps:.0f} ops/step):")
    for op in ops:
        print(f"  {op['op']:<40} {op['calls_per_step']:7.0f} calls {op['self_ms_per_step']:8.2f} ms")
    return {"self_cpu_ms_per_step": total_us / 1e3, "ops_per_step": sum(e.count for e in events) / steps,
            "top_ops": ops}


DTYPE_VARIANTS = {   # name -> (activations' dtype, quantize)
    "fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
    "int8": (torch.float32, "int8"), "int8-bf16": (torch.bfloat16, "int8"),
    "int4": (torch.float32, "int4"), "int4-bf16": (torch.bfloat16, "int4"),
}


def weight_bytes(model) -> int:
    """Bytes of weights one decode step streams: every packed (or 4-/8-bit code) linear and lm_head (the embedding
    is read a row at a time, the norms are negligible)."""
    linears = [w for layer in model.layer_weights for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] \
        + [model.lm_head]
    return sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes for w in linears)


def read_bandwidth_gbs(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Best read bandwidth of this process's threads over a huge-page float32 buffer (torch.sum), GB/s."""
    from lmi_handler.engine.model.kernels import empty_huge

    buf = empty_huge(num_bytes // 4).fill_(1.0)
    best = min(_timed(buf.sum) for _ in range(repeats))
    return num_bytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_decode_dtypes(model_dir: Path, variants: list[str], rounds: int, steps: int, context: int = 200) -> dict:
    """Batch-1 decode step of one runner per dtype variant, all in this process, interleaved: each round
    times `steps` steps of every variant in turn (the order rotating), with a read-bandwidth measurement
    between rounds, so a busy minute on a shared machine hits every variant alike. `--clock` as for the
    other phases (cpu with --threads 1 on a busy machine); reports per variant the median ms per step, tok/s, weight bytes per token
    and the bandwidth ceiling (median read GB/s / bytes per token) with the fraction reached."""
    runners = {}
    for name in variants:
        dtype, quantize = DTYPE_VARIANTS[name]
        runner = ModelRunner(model_dir, dtype, torch.device("cpu"), block_size=16, num_blocks=64, quantize=quantize)
        allocator = BlockAllocator(runner.num_blocks, runner.block_size)
        seqs = decode_batch(runner, allocator, 1, context)
        sched = SchedulerOutput(seqs=seqs, num_scheduled_tokens=[1])
        runners[name] = (runner, sched)
        runner.execute(runner.prepare(sched))              # warm
    times = {name: [] for name in variants}
    bandwidth = []
    for r in range(rounds):
        bandwidth.append(read_bandwidth_gbs())
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for name in order:
            runner, sched = runners[name]
            start = kernel_clock()
            for _ in range(steps):
                runner.execute(runner.prepare(sched))
            times[name].append((kernel_clock() - start) / steps)
    gbs = sorted(bandwidth)[len(bandwidth) // 2]
    result = {"rounds": rounds, "steps_per_round": steps, "context": context, "read_gbs_median": gbs,
              "read_gbs_all": bandwidth, "variants": {}}
    for name in variants:
        step = sorted(times[name])[len(times[name]) // 2]
        nbytes = weight_bytes(runners[name][0].model)
        result["variants"][name] = {
            "step_ms_median": step * 1e3, "tok_s": 1 / step, "step_ms_all": [t * 1e3 for t in times[name]],
            "weight_bytes_per_token": nbytes, "ceiling_tok_s": gbs * 1e9 / nbytes,
            "fraction_of_ceiling": (1 / step) / (gbs * 1e9 / nbytes)}
        v = result["variants"][name]
        print(f"{name:10s} {v['step_ms_median']:7.2f} ms/step {v['tok_s']:6.1f} tok/s  {nbytes / 1e6:6.1f} MB/token  "
              f"ceiling {v['ceiling_tok_s']:6.1f} tok/s at {gbs:.1f} GB/s -> {v['fraction_of_ceiling']:.2f}", flush=True)
    return result


def kernels_main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=KERNELS_DOC.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=REPO / "model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-model", action="store_true", help="per-op numbers only")
    parser.add_argument("--skip-ops", action="store_true", help="decode steps only")
    parser.add_argument("--profile", action="store_true", help="torch.profiler breakdown of a batch-1 step")
    parser.add_argument("--dtypes", default="", help="comma-separated variants (fp32,bf16,int8,int8-bf16): an "
                        "interleaved batch-1 decode A/B of them with the same-run read bandwidth, instead of "
                        "the other phases")
    parser.add_argument("--rounds", type=int, default=7, help="--dtypes: interleaved rounds")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu: process CPU time (meaningful with --threads 1 on a busy machine)")
    args = parser.parse_args(argv)
    global kernel_clock
    kernel_clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if cpu_kernels() is None:
        raise SystemExit("the C++ kernels did not build; see the warning above")
    report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "threads": args.threads, "clock": args.clock,
              "kernel_load_s": time.perf_counter() - start, "load_average_before": os.getloadavg()}
    if args.dtypes:
        report["decode_dtypes"] = bench_decode_dtypes(args.model_dir, args.dtypes.split(","), args.rounds,
                                                      max(3, args.repeats // 2))
        args.skip_ops = args.skip_model = True
    if not args.skip_ops:
        report["linear"] = bench_linears(args.repeats)
        report["attention_decode"] = bench_attention(args.repeats)
        print(report["attention_decode"], flush=True)
    if not args.skip_model:
        report["decode_step"] = bench_decode_step(args.model_dir, max(3, args.repeats // 4), args.profile)
    report["load_average_after"] = os.getloadavg()
    out = REPO / "benchmarks" / "results" / f"kernels-{dt.date.today().isoformat()}-t{args.threads}-{args.clock}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
