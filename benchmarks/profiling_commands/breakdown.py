"""`profiling.py breakdown`: one decode step, component by component (engine parts, then the forward's ops).

A command of benchmarks/profiling.py, which calls breakdown_main; `profiling.py breakdown --help` prints
BREAKDOWN_DOC.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from workload import REPO, bench_engine, build_workload

from lmi_handler.engine.model.attention import attention_paged
from lmi_handler.engine.model.kernels import packed_linear
from lmi_handler.engine.sequence import SamplingParams

BREAKDOWN_DOC = """Where a decode step goes, component by component, on the benchmark's workload (demo model, no server).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profiling.py breakdown [--dtype fp32|bf16] [--quantize int8]
        [--batch 64] [--decode-steps 64] [--threads 1] [--repeats 5] [--bf16-dot auto|fma|native|amx]

Adds the first `--batch` MT-bench prompts of the benchmark (workload.build_workload: chat template, 128
greedy tokens, EOS ignored), steps the engine through their prefill and `--decode-steps` decode steps (so
the contexts are those of the benchmark's middle: prompt + that many tokens), then measures one decode step
`--repeats` times, each part on its own:

- engine parts: scheduler.schedule, runner.prepare, Engine._prepare_sampling, the sampler (process + pick +
  stop reasons), OutputProcessor.process (the host sync, detokenization, stop strings), the finish loop;
  measured inside a real Engine.step by wrapping each method;
- the forward, op by op: the fused decoder stack's C++ ops called one at a time (forward.DecoderModel's walk on
  the cpp backend, bitwise the fused stack), each timed: add_rmsnorm, the qkv / o / gate_up / down linears,
  rope_kv_write, paged attention, silu_mul; then the final norm, the logit rows and lm_head. Re-running a
  step's forward rewrites the same K/V slots with the same values, so every repeat sees the same state.

Times are thread CPU time (time.thread_time) with `--threads 1` (steady on a shared machine) and wall time
(time.perf_counter) otherwise; each figure is the median and the least over the repeats (ms per step).
"""

def breakdown_args(argv=None):
    p = argparse.ArgumentParser(description=BREAKDOWN_DOC.splitlines()[0])
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--quantize", default=None, choices=(None, "int8"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="threads while measuring")
    p.add_argument("--warmup-threads", type=int, default=2, help="threads while stepping to the measured step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default=str(REPO / "model"))
    p.add_argument("--bf16-dot", default="auto", choices=("auto", "fma", "native", "amx"),
                   help="bf16 panels' dot form (kernels.bf16_form.choose_bf16_dot; fma and native give the same bits)")
    return p.parse_args(argv)


# the parts of Engine.step that breakdown and steps time: (owner attribute, method, label)
ENGINE_PARTS = (("scheduler", "schedule", "schedule"), ("runner", "prepare", "prepare"),
                ("", "_prepare_sampling", "prepare_sampling"), ("runner", "execute", "execute (forward + lm_head)"),
                ("scheduler", "update_from_output", "scheduler update"), ("", "_sample", "sample (process, pick, stops)"),
                ("output", "process", "output process (sync, detok)"), ("", "_finish", "finish"))


def time_parts(engine, clock, record, parts=ENGINE_PARTS) -> None:
    """Wrap each of `parts` of `engine` so that every call reports record(label, its result, seconds by clock)."""
    for owner, name, label in parts:
        obj = getattr(engine, owner) if owner else engine
        fn = getattr(obj, name)

        def wrap(*a, _fn=fn, _label=label, **k):
            start = clock()
            out = _fn(*a, **k)
            record(_label, out, clock() - start)
            return out
        setattr(obj, name, wrap)


def breakdown_main(argv=None) -> None:
    args = breakdown_args(argv)

    from lmi_handler.engine.model.kernels import bf16_dot_form, bf16_form_name, choose_bf16_dot

    choose_bf16_dot(args.bf16_dot)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    engine = bench_engine(args.model, args.dtype, args.warmup_threads, args.quantize)
    work = build_workload(Path(args.model), args.batch, 128)
    params = SamplingParams(greedy=True, max_new_tokens=128, ignore_eos=True)
    for i, ids in enumerate(work.prompt_token_ids):
        engine.add_request(f"r{i}", ids, params, seed=0)
    while any(s.num_output_tokens < args.decode_steps for s in engine.seqs.values()):
        engine.step()
    torch.set_num_threads(args.threads)
    ctx = [s.num_tokens for s in engine.seqs.values()]
    print(f"dtype {args.dtype} quantize {args.quantize} threads {torch.get_num_threads()} batch {len(ctx)}: "
          f"contexts {min(ctx)}-{max(ctx)} (mean {sum(ctx) / len(ctx):.0f}); "
          f"{'thread CPU' if args.threads == 1 else 'wall'} ms per step, median of {args.repeats}; "
          f"bf16 dot {args.bf16_dot}: {bf16_form_name(bf16_dot_form())}")

    # ---- engine parts inside real steps
    times: dict[str, list[float]] = defaultdict(list)

    time_parts(engine, clock, lambda label, _out, seconds: times[label].append(seconds),
               ENGINE_PARTS + (("", "step", "step (all)"),))
    for _ in range(args.repeats):
        engine.step()
    # the sampler alone on this step's logits
    sched = engine.scheduler.schedule()
    mi = engine.runner.prepare(sched)
    sampling = engine._prepare_sampling(sched)
    out = engine.runner.execute(mi)
    for _ in range(args.repeats):
        start = clock()
        processed = engine.sampler.process(out.logits, sampling.meta)
        engine.sampler.pick(processed, sampling.meta)
        times["  sampler.process + pick"].append(clock() - start)

    # ---- the forward, op by op
    forward_ops(engine, mi, args.repeats, clock, times)
    width = max(len(k) for k in times)
    print(f"  {'':<{width}} {'median':>9} {'min':>9}")
    for label, values in times.items():
        print(f"  {label:<{width}} {statistics.median(values) * 1e3:9.2f} {min(values) * 1e3:9.2f}")


def forward_ops(engine, mi, repeats, clock, times) -> None:
    """The cpp backend's ops of DecoderModel's walk one at a time (bitwise the fused stack), each timed."""

    from lmi_handler.engine.model.kernels import (
        fused_add_rmsnorm,
        fused_rope_kv_write,
        fused_silu_mul,
    )

    model, meta = engine.runner.model, mi.attn
    eps, rope = model.spec.norm_eps, model.ropes[id(model.spec.layers[0].rope)]
    ops: dict[str, float] = defaultdict(float)

    def op(label, fn, *args):
        start = clock()
        out = fn(*args)
        ops[label] += clock() - start
        return out

    with torch.inference_mode():
        for _ in range(repeats):
            ops.clear()
            start = clock()
            x = model._embed(mi.input_ids)
            freqs = mi.positions.float()[:, None] * rope.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(x.dtype).contiguous(), emb.sin().to(x.dtype).contiguous()
            x = x.contiguous().clone()
            ops["embed + rope tables"] += clock() - start
            delta = None
            for w, (k_cache, v_cache) in zip(model.layer_weights, engine.runner.kv_caches):
                h = op("rmsnorm (+ residual add)", fused_add_rmsnorm, x, delta, w.attn_pre, eps)
                qkv = op("linear qkv", packed_linear, h, w.qkv, w.qkv_bias)
                q = op("rope + kv write", fused_rope_kv_write, qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                       model.num_heads, model.num_kv_heads)
                o = op("paged attention", attention_paged, q, k_cache, v_cache, meta, model.spec.scale)
                delta = op("linear o", packed_linear, o.view(x.shape[0], -1), w.o, w.o_bias)
                h = op("rmsnorm (+ residual add)", fused_add_rmsnorm, x, delta, w.mlp_pre, eps)
                gu = op("linear gate_up", packed_linear, h, w.gate_up, w.gate_up_bias)
                act = op("silu * up", fused_silu_mul, gu)
                delta = op("linear down", packed_linear, act, w.down, w.down_bias)
            hidden = op("rmsnorm (+ residual add)", fused_add_rmsnorm, x, delta, model.final_norm, eps)
            rows = op("logit rows", torch.index_select, hidden, 0, mi.logit_rows)
            op("lm_head", model.compute_logits, rows)
            total = sum(ops.values())
            for label, value in ops.items():
                times[f"  fwd: {label}"].append(value)
            times["  fwd: (sum of ops)"].append(total)
