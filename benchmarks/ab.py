"""A/B by phase, interleaved: this checkout against a git revision (or, for prefill, two forms of one step).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py COMMAND [options]      (COMMAND --help: its options)

linears    the packed linear, weights from DRAM (30 layers' worth, a decode step's call order), old vs new kernels
attention  the paged-attention kernel: bitwise check on small cases, then a decode step's 30 layer calls
prefill    one step's forward: the fused decoder stack against the same C++ ops called one by one (no revision)
batch1     batch-1 (or small-batch) decode steps of a ModelRunner, old vs new kernels in one process
engine     whole-engine batch-1 decode (scheduler, sampler, output processing too), two worker processes
lora       64 requests over 4 LoRA adapters against the same 64 on the base model, in one engine (no revision)

Each side takes turns with the other, the order flipping each round, so both see the same minutes of the host;
read the medians and the per-round ratios, and rerun when the load average was high.
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
import time
import types
from dataclasses import replace
from pathlib import Path

import torch
from profiling import DTYPE_VARIANTS, decode_batch, read_bandwidth_gbs, run_command, weight_bytes
from profiling import SHAPES as KERNEL_SHAPES
from workers import drop_prefix_cache
from workload import REPO, bench_engine, build_workload

from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.kernels import build, cpu_kernels, pack_weight
from lmi_handler.engine.model.kernels.build import (
    BF16_DP,
    bf16_dot_form,
    empty_huge,
)
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import SchedulerOutput

# ==== batch1 ================================================================================================

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

KERNELS = "lmi_handler/engine/model/kernels"


def old_kernels(rev: str):
    """Revision `rev`'s kernel sources (.cpp, .h) built as an extension of their own."""
    out = Path(tempfile.mkdtemp(prefix="ab-kernels-"))
    names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:{KERNELS}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".cpp", ".h")):
            (out / name).write_bytes(subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{KERNELS}/{name}"],
                                                    check=True, capture_output=True).stdout)
    source = out / "cpu_kernels.cpp"
    return build.build_extension(source, build._module_name(source))


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
    p.add_argument("--old-rev", default="batch1_main")
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


# ==== linears ===============================================================================================

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


# ==== attention =============================================================================================

ATTENTION_DOC = """Interleaved A/B of the paged-attention kernel: this checkout's C++ kernels against another revision's,
in one process (old_kernels builds the old sources as an extension of their own).

First checks that both give bitwise the same output on small random cases (bf16 and fp32, decode and
prefill rows, head dims 16-64, GQA and MHA, contexts not a multiple of the block size); then times one
decode step's 30 layer calls on the demo model's shapes (64 decode rows, 9 query / 3 KV heads of 64,
16-token blocks, contexts 112-240 keys, each layer's blocks scattered over a cache of its own twice the
size needed, in huge-page memory), old and new alternating, `--rounds` rounds of 4 steps each. Prints the
medians (ms a layer call), the K/V bytes read per second, and old/new.

The 30 layers matter: one layer's K/V (17 MB in float32) fits this host's 32 MiB L3, so repeating one
layer's call measures the L3, not the memory stream a real step reads (the first version of this script
did that: 0.3 ms a call against 0.67 in the engine's step).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py attention --old-rev HEAD [--threads 2]
"""

ATTENTION_CHECKS = [(7, 9, 3, 64, 16, 1, 70, 1), (5, 4, 2, 32, 16, 20, 40, 5), (3, 8, 8, 64, 16, 33, 90, 17),
          (4, 6, 2, 48, 4, 3, 30, 2), (2, 4, 1, 16, 16, 1, 3, 1)]


ATTENTION_LAYERS, ATTENTION_STEPS = 30, 4   # the demo model's layers; steps timed per round


def attention_case(g, dtype, seqs, heads, kv_heads, head_dim, block, ctx_lo, ctx_hi, query_rows, pool=2):
    """paged_attention's arguments: random q and caches, block tables drawn from `pool` x the blocks needed."""
    ctx = torch.randint(max(ctx_lo, query_rows), ctx_hi, (seqs,), generator=g, dtype=torch.int32)
    max_blocks = (int(ctx.max()) + block - 1) // block
    num_blocks = seqs * max_blocks * pool
    caches = []
    for _ in range(2):
        cache = empty_huge(num_blocks, block, kv_heads, head_dim, dtype=dtype)
        cache.copy_(torch.randn(num_blocks, block, kv_heads, head_dim, generator=g))
        caches.append(cache)
    tables = torch.randperm(num_blocks, generator=g)[: seqs * max_blocks].to(torch.int32).view(seqs, max_blocks)
    cu = torch.arange(seqs + 1, dtype=torch.int32) * query_rows
    q = (3 * torch.randn(seqs * query_rows, heads, head_dim, generator=g)).to(dtype)
    return q, caches[0], caches[1], tables.contiguous(), ctx, cu, head_dim ** -0.5


def attention_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=ATTENTION_DOC.splitlines()[0])
    p.add_argument("--old-rev", default="HEAD")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    new, old = cpu_kernels(), old_kernels(args.old_rev)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ATTENTION_CHECKS:
            inputs = attention_case(g, dtype, *shape)
            if not torch.equal(old.paged_attention(*inputs), new.paged_attention(*inputs)):
                raise SystemExit(f"{dtype} {shape}: the two builds differ")
    print(f"bitwise equal: {args.old_rev} and this checkout on {2 * len(ATTENTION_CHECKS)} cases")
    for dtype in (torch.bfloat16, torch.float32):
        layers = [attention_case(g, dtype, 64, 9, 3, 64, 16, 112, 240, 1, pool=2) for _ in range(ATTENTION_LAYERS)]
        kv_bytes = sum(int(inputs[4].sum()) * 2 * inputs[1].stride(1) * inputs[1].element_size() for inputs in layers)
        times = {"old": [], "new": []}
        for r in range(args.rounds):
            order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
            for name, module in order:
                for inputs in layers:
                    module.paged_attention(*inputs)
                start = time.perf_counter()
                for _ in range(ATTENTION_STEPS):
                    for inputs in layers:
                        module.paged_attention(*inputs)
                times[name].append((time.perf_counter() - start) / ATTENTION_STEPS)
        old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"{dtype}, {args.threads} threads: old {old_s / ATTENTION_LAYERS * 1e3:.3f} ms, new {new_s / ATTENTION_LAYERS * 1e3:.3f} ms "
              f"a call ({kv_bytes / old_s / 1e9:.1f} / {kv_bytes / new_s / 1e9:.1f} GB/s of K/V), old/new "
              f"{old_s / new_s:.2f}")


# ==== prefill ===============================================================================================

PREFILL_DOC = """Interleaved A/B of one step's forward: the fused decoder stack against the same C++ ops called one by one.

The fused stack is kernels' DecoderStack, one C++ call (the gate_up linear with silu * up in its store, each
layer's residual add in the next norm); the other side is llama._forward_split, the same C++ ops called one by
one from Python (the gate_up linear, then silu_mul). One process, one engine, the two alternating, the order
flipping each round. Both give the same bits (after the rounds, the first round's logits of each are compared
with torch.equal).

The step is the benchmark's first (workload.build_workload: 64 MT-bench prompts, the engine's 2048-token
budget: a prefill of 1882 tokens from 24 prompts), or with `--decode-steps N` a decode step of the 64
sequences after the 4 prefill steps and N decode steps. Prints the median ms of each and fused / split. The
split path also pays ~30 x 9 Python calls a step (~0.1-0.3 ms), so at a decode step the difference is within
that.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py prefill [--dtype fp32] [--rounds 6] [--decode-steps 0]
"""

def prefill_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=PREFILL_DOC.splitlines()[0])
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the engine's dtype (activations, KV cache)")
    p.add_argument("--threads", type=int, default=2, help="torch / kernel threads")
    p.add_argument("--rounds", type=int, default=6, help="rounds, each times the fused and the split forward once")
    p.add_argument("--decode-steps", type=int, default=0,
                   help="0: time the first (prefill) step; N: a decode step after the 4 prefill and N decode steps")
    args = p.parse_args(argv)

    from lmi_handler.engine.sequence import SamplingParams

    engine = bench_engine(str(REPO / "model"), args.dtype, args.threads)
    work = build_workload(REPO / "model", 64, 128)
    params = SamplingParams(greedy=True, max_new_tokens=128, ignore_eos=True)
    for i, ids in enumerate(work.prompt_token_ids):
        engine.add_request(f"r{i}", ids, params, seed=0)
    steps = 4 + args.decode_steps if args.decode_steps else 0     # the 4 prefill steps, then N decode steps
    for _ in range(steps):
        engine.step()
    sched = engine.scheduler.schedule()
    model_input = engine.runner.prepare(sched)
    model = engine.runner.model
    fused_forward = model._forward_fused
    print(f"{args.dtype}, {args.threads} threads: a step of {sum(sched.num_scheduled_tokens)} tokens "
          f"({len(sched.seqs)} sequences)")
    times: dict[str, list[float]] = {"fused": [], "split": []}
    logits = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            for name in (("fused", "split") if r % 2 == 0 else ("split", "fused")):
                model._forward_fused = fused_forward if name == "fused" else model._forward_split
                start = time.perf_counter()
                out = engine.runner.execute(model_input)        # rewrites the same K/V slots each time
                times[name].append(time.perf_counter() - start)
                logits.setdefault(name, out.logits)
    del model._forward_fused             # the class's method again
    assert torch.equal(logits["fused"], logits["split"]), "the fused stack and the split ops differ"
    fused, split = (statistics.median(times[k]) for k in ("fused", "split"))
    print(f"fused {fused * 1e3:.1f} ms, split {split * 1e3:.1f} ms: fused / split {fused / split:.3f} "
          f"(per round {', '.join(f'{a / b:.3f}' for a, b in zip(times['fused'], times['split']))}; same logits)")


# ==== engine ================================================================================================

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


# ==== lora ==================================================================================================

LORA_DOC = """Interleaved A/B of LoRA's cost (issue 41): 64 requests over 4 adapters against the same 64 on the base model.

One process, one engine (the benchmark's offline settings: 64 sequences, 2048 tokens a step, 1 GiB KV cache,
option.enable_lora with max_loras 4), four random rank-`--rank` PEFT adapters on q/v/o/gate/down written to a
temporary folder and loaded. Each round runs the workload twice, the order flipping each round, the prefix cache
emptied before each run: all 64 MT-bench prompts (chat template) on the base, then the same 64 with request i on
adapter i % 4. Every request is greedy, `--max-new-tokens` tokens with ignore_eos, so both runs generate the
same number of tokens. Prints each run's output tok/s per round, their medians and lora / base (the issue's
target: at least 0.8).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py lora [--dtype fp32] [--threads 2] [--rounds 3]
"""

LORA_ADAPTERS = ("a0", "a1", "a2", "a3")
LORA_MODULES = {"q_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn", "gate_proj": "mlp",
           "down_proj": "mlp"}    # the projections the adapters change, and where PEFT names them


def write_lora_adapter(path: Path, config: dict, rank: int, seed: int) -> None:
    """A random LoRA adapter of the model's `config` (config.json) in PEFT's layout, non-zero A and B."""
    from safetensors.torch import save_file

    from lmi_handler.engine.model.lora import base_module_shapes

    shapes, generator, tensors = base_module_shapes(config), torch.Generator().manual_seed(seed), {}
    for layer in range(config["num_hidden_layers"]):
        for module, sublayer in LORA_MODULES.items():
            in_features, out_features = shapes[module]
            name = f"base_model.model.model.layers.{layer}.{sublayer}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(LORA_MODULES)}))


def lora_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=LORA_DOC.splitlines()[0])
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the engine's dtype (activations, KV cache)")
    p.add_argument("--threads", type=int, default=2, help="torch / kernel threads")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each runs the base and the LoRA workload once")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    args = p.parse_args(argv)

    from lmi_handler.config import EngineConfig, LoraConfig
    from lmi_handler.engine.engine import Engine
    from lmi_handler.engine.sequence import SamplingParams

    model = REPO / "model"
    work = build_workload(model, 64, args.max_new_tokens)
    config = json.loads((model / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seed, name in enumerate(LORA_ADAPTERS):
            write_lora_adapter(root / name, config, args.rank, seed)
        lora = LoraConfig(max_loras=4, max_lora_rank=max(16, args.rank), max_cpu_loras=4, adapter_roots=(root,))
        engine = Engine(EngineConfig(model_path=model, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
                                     device_id=-1, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=None,
                                     block_size=16, kv_cache_bytes=1 << 30, num_threads=args.threads, lora=lora))
        for name in LORA_ADAPTERS:
            engine.adapters.load(name, root / name)
        params = SamplingParams(greedy=True, max_new_tokens=args.max_new_tokens, ignore_eos=True)

        def run(with_lora: bool) -> float:
            drop_prefix_cache(engine.allocator)
            requests = [(f"r{i}", ids, replace(params, adapter=LORA_ADAPTERS[i % 4] if with_lora else None))
                        for i, ids in enumerate(work.prompt_token_ids)]
            start = time.perf_counter()
            outputs = engine.generate(requests)
            seconds = time.perf_counter() - start
            tokens = sum(len(t.new_tokens) for outs in outputs.values() for t in outs)
            return tokens / seconds

        run(True)                                            # warm-up: the adapters' stacks, every shape once
        rates: dict[str, list[float]] = {"base": [], "lora": []}
        for r in range(args.rounds):
            for name in (("base", "lora") if r % 2 == 0 else ("lora", "base")):
                rates[name].append(run(name == "lora"))
    base, lora_rate = (statistics.median(rates[k]) for k in ("base", "lora"))
    print(f"{args.dtype}, {args.threads} threads, 64 requests x {args.max_new_tokens} tokens, 4 adapters of rank "
          f"{args.rank}: base {base:.1f} tok/s, lora {lora_rate:.1f} tok/s, lora / base {lora_rate / base:.3f} "
          f"(per round base {', '.join(f'{x:.1f}' for x in rates['base'])}; "
          f"lora {', '.join(f'{x:.1f}' for x in rates['lora'])})")



# ==== the command line ======================================================================================

COMMANDS = {
    "batch1": (batch1_main, BATCH1_DOC),
    "linears": (linears_main, LINEARS_DOC),
    "attention": (attention_main, ATTENTION_DOC),
    "prefill": (prefill_main, PREFILL_DOC),
    "engine": (engine_main, ENGINE_DOC),
    "lora": (lora_main, LORA_DOC),
}


def main(argv: list[str] | None = None) -> None:
    """`ab.py COMMAND [its options]`; `ab.py COMMAND --help` for a command's own."""
    run_command(COMMANDS, __doc__, argv)


if __name__ == "__main__":
    main()
