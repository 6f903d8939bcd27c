"""Where the time goes: profiles of the engine and its kernels on the benchmark's workload (no server).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profiling.py COMMAND [options]      (COMMAND --help: its options)

breakdown    one decode step, component by component (engine parts, then the forward's ops)
steps        the offline run's wall time, step by step (prefill apart from decode; CPU time beside wall time)
fixed-costs  what a batch-1 decode step costs besides streaming its weights (against a same-geometry skeleton)
kernels      the batch-invariant CPU kernels against MKL and the tiled path; --dtypes: batch-1 decode per dtype
grammar      the two grammar libraries (llguidance, xgrammar): tokenizer set-up, compile time, per-step mask cost

(Named profiling.py, not profile.py: a benchmarks/profile.py would shadow the standard library's `profile`,
which cProfile imports, for every script run from benchmarks/.)
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from workers import drop_prefix_cache
from workload import REPO, WEIGHT_BYTES, bench_engine, build_workload, step_linears, weight_bytes_per_token

from lmi_handler.engine.kv_cache import BlockAllocator, num_blocks_needed
from lmi_handler.engine.model.attention import AttentionMetadata, attention_paged, attention_per_sequence
from lmi_handler.engine.model.kernels import cpu_kernels, pack_weight, packed_linear
from lmi_handler.engine.model.kernels.build import BF16_AMX, BF16_DP, BF16_FMA
from lmi_handler.engine.model.llama import INVARIANT_TILE, _tiled_matmul
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import SamplingParams, Sequence

# ==== breakdown =============================================================================================

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
- the forward, op by op: the fused decoder layer's C++ ops called one at a time (llama._forward_split with no
  group, bitwise the fused layer), each timed: add_rmsnorm, the qkv / o / gate_up / down linears,
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
                   help="bf16 panels' dot form (kernels.build.choose_bf16_dot; fma and native give the same bits)")
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
    import torch

    from lmi_handler.engine.model.kernels.build import bf16_dot_form, bf16_form_name, choose_bf16_dot
    from lmi_handler.engine.sequence import SamplingParams

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
    """llama._forward_split's ops one at a time (group None: bitwise the fused layer), each timed."""
    import torch

    from lmi_handler.engine.model.attention import attention_paged
    from lmi_handler.engine.model.kernels import (
        fused_add_rmsnorm,
        fused_rope_kv_write,
        fused_silu_mul,
        packed_linear,
    )

    model, meta = engine.runner.model, mi.attn
    a = model.args
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
            x = model.embed(mi.input_ids)
            freqs = mi.positions.float()[:, None] * model.inv_freq.float()[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(x.dtype).contiguous(), emb.sin().to(x.dtype).contiguous()
            x = x.contiguous().clone()
            ops["embed + rope tables"] += clock() - start
            delta = None
            for layer, (k_cache, v_cache) in zip(model.layers, engine.runner.kv_caches):
                attn, mlp = layer.self_attn, layer.mlp
                h = op("rmsnorm (+ residual add)", fused_add_rmsnorm, x, delta, layer.input_layernorm.weight,
                       layer.input_layernorm.eps)
                qkv = op("linear qkv", packed_linear, h, attn.qkv_weight, attn.qkv_bias)
                q = op("rope + kv write", fused_rope_kv_write, qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                       a.num_heads, a.num_kv_heads)
                o = op("paged attention", attention_paged, q, k_cache, v_cache, meta, attn.scale)
                delta = op("linear o", packed_linear, o.view(x.shape[0], -1), attn.o_weight, attn.o_bias)
                h = op("rmsnorm (+ residual add)", fused_add_rmsnorm, x, delta, layer.post_attention_layernorm.weight,
                       layer.post_attention_layernorm.eps)
                gu = op("linear gate_up", packed_linear, h, mlp.gate_up_weight, mlp.gate_up_bias)
                act = op("silu * up", fused_silu_mul, gu)
                delta = op("linear down", packed_linear, act, mlp.down_weight, mlp.down_bias)
            hidden = op("rmsnorm (+ residual add)", fused_add_rmsnorm, x, delta, model.norm.weight, model.norm.eps)
            rows = op("logit rows", torch.index_select, hidden, 0, mi.logit_rows)
            op("lm_head", model.compute_logits, rows)
            total = sum(ops.values())
            for label, value in ops.items():
                times[f"  fwd: {label}"].append(value)
            times["  fwd: (sum of ops)"].append(total)


# ==== steps =================================================================================================

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

    from lmi_handler.engine.sequence import SamplingParams

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
                          "steps_main": time.thread_time() - main_cpu})
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"round {k + 1} (load {load}): wall {wall:.2f} s, process CPU {cpu:.2f} s ({cpu / wall:.2f} cores), "
              f"{len(steps)} steps")
        prefill = [s for s in steps if s["tokens"] > s["seqs"]]
        decode = [s for s in steps if s["tokens"] == s["seqs"]]
        for label, sel in (("prefill", prefill), ("decode", decode)):
            parts = ", ".join(f"{label} {sum(s.get(label, 0.0) for s in sel):.2f}" for _, _, label in ENGINE_PARTS)
            print(f"  {label}: {len(sel)} steps, {sum(s['tokens'] for s in sel)} tokens, wall "
                  f"{sum(s['wall'] for s in sel):.2f} s, process CPU {sum(s['proc'] for s in sel):.2f} s, steps_main thread "
                  f"CPU {sum(s['steps_main'] for s in sel):.2f} s; parts (wall s): {parts}")
        if decode:
            walls = [s["wall"] * 1e3 for s in decode]
            print(f"  decode step wall ms: median {statistics.median(walls):.1f}, least {min(walls):.1f}")


# ==== fixed-costs ===========================================================================================

FIXED_COSTS_DOC = """What a batch-1 decode step costs besides streaming its weights, measured against a same-geometry model in cache.

In one process, taking turns each round: the read probe, a request alone on `--model` (the demo model by
default), and the same request on a "skeleton", a random Llama with the model's layers, query heads, KV heads and
head_dim but hidden size 16 x heads, intermediate size 64 and a 512-token vocabulary (the demo model's skeleton:
15.1 MB of bf16 weights, which stay in the L3; in fp32 twice that, nearly the whole 32 MiB L3 of the host this was
written on). The skeleton is written once with transformers to `--skeleton-dir` (default
`<tmp>/lmi-skeleton-model`), the model's tokenizer files and chat template beside it, and rewritten when its
config.json no longer matches the model's geometry. Its step runs every op the model's does, at the same contexts
(the same prompt's length, its ids taken modulo 512, and the same number of tokens), so its time is what a step
costs that does not scale with the weights' bytes: the engine's Python, the decoder stack's attention, norms,
RoPE, allocations and thread hand-offs. The model's step adds the streaming of its weights (269 MB a token for
the demo model in bf16).

Each round: the read probe (host.read_bandwidth, as the benchmark takes it before a batch-1 round), a plain
read of the model's weights in a step's call pattern (host.step_read: one OpenMP region per linear, then the
lm_head, no arithmetic; best of 5 sweeps), one request alone on the model and one on the skeleton (`--tokens`
greedy tokens, EOS ignored, the order flipping each round). Per round it prints the read bandwidth, the ceiling
step (weight bytes / read bandwidth), the model's step (wall ms, median over the decode steps) and its fraction
of that ceiling, the skeleton's step, (model - skeleton) against the ceiling: how close the weight streaming
alone comes to the probe, and the plain read's time (best of its sweeps, beside the steps' medians: the
optimistic floor) and the plain read plus the skeleton's step against the ceiling: the fraction a step reaches
if its weights stream as fast as a plain read can and none of its other work overlaps them. A fraction above 1
means the probe caught the host busier than the round did (it is flagged); rerun on a quieter host. Then the
medians over the rounds.

Writes the rounds, the host (CPU model, load average before and after) and the source commit to `--out` (JSON,
default benchmarks/results/fixed-costs-<UTC date and time, YYYY-MM-DD-HHMM>.json: commit it only as a cited run of
record) and a plot beside it (.png: per round the ceiling step, the plain read's, the model's step and the
skeleton's). The JSON's rounds hold `plain_read_step_s`, `plain_read_fraction_of_ceiling` (ceiling / plain read) and
`unoverlapped_fraction_of_ceiling` (ceiling / (plain read + skeleton step)) beside the earlier keys (the model's
step is `demo_step_s`, its fraction `demo_fraction_of_ceiling`: names from when the model was the demo model).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profiling.py fixed-costs [--dtype bf16] [--rounds 6] [--tokens 128]
        [--threads 2] [--model model] [--skeleton-dir DIR] [--out FILE.json]

"""

SKELETON_VOCAB = 512


def skeleton_config(model_config: dict) -> dict:
    """The skeleton's config.json fields: the model's attention geometry (layers, query and KV heads, head_dim,
    positions, RoPE, norm eps) with small hidden (16 x heads), intermediate (64) and vocabulary (512) sizes."""
    heads = model_config["num_attention_heads"]
    geometry = {k: model_config[k] for k in ("num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                                             "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters")
                if k in model_config}
    return {**geometry, "num_key_value_heads": model_config.get("num_key_value_heads", heads),
            "head_dim": model_config.get("head_dim") or model_config["hidden_size"] // heads,
            "hidden_size": 16 * heads, "intermediate_size": 64, "vocab_size": SKELETON_VOCAB,
            "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def ensure_skeleton(path: Path, model_dir: Path, config: dict) -> None:
    """The skeleton checkpoint at `path` (random weights, seed 0, bf16) with the model's tokenizer files and chat
    template; (re)written unless its config.json already holds `config`'s values."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    written = path / "config.json"
    if written.is_file():
        old = json.loads(written.read_text())
        if all(old.get(k) == v for k, v in config.items() if not k.startswith("rope_")):   # (RoPE: normalised on save)
            return
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, path / name)


def cpu_model() -> str:
    """/proc/cpuinfo's model name (platform.processor() is empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def step_times(engine, prompt: list[int], tokens: int, request_id: str) -> list[float]:
    """Wall seconds of each decode step of one request alone (the prefill step left out)."""
    from lmi_handler.engine.sequence import SamplingParams

    engine.add_request(request_id, prompt, SamplingParams(greedy=True, max_new_tokens=tokens, ignore_eos=True), seed=0)
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[1:]


def fixed_costs_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=FIXED_COSTS_DOC.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"), help="the engines' dtype")
    p.add_argument("--rounds", type=int, default=6, help="rounds (probe, model, skeleton); at least 1")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per request (EOS ignored); at least 3")
    p.add_argument("--threads", type=int, default=2, help="torch / kernel threads")
    p.add_argument("--model", default=str(REPO / "model"), help="a Llama checkpoint with a chat template")
    p.add_argument("--out", help="results JSON, a .png of the same name beside it",
                   default=str(REPO / "benchmarks" / "results" / f"fixed-costs-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}.json"))
    p.add_argument("--skeleton-dir", default=str(Path(tempfile.gettempdir()) / "lmi-skeleton-model"),
                   help="where the skeleton checkpoint is written (once) and read")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.tokens < 3:
        p.error("--rounds must be at least 1 and --tokens at least 3 (two decode steps)")

    from host import read_bandwidth, step_read

    model_dir, skeleton_dir = Path(args.model), Path(args.skeleton_dir)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    ensure_skeleton(skeleton_dir, model_dir, skeleton_config(config))
    nbytes = weight_bytes_per_token(config, args.dtype)["bytes"]
    source = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    engines = {"model": bench_engine(str(model_dir), args.dtype, args.threads),
               "skeleton": bench_engine(str(skeleton_dir), args.dtype, args.threads)}
    prompt = build_workload(model_dir, 1, args.tokens).prompt_token_ids[0]
    # the same length (so the same contexts) in the skeleton's vocabulary
    prompts = {"model": prompt, "skeleton": [t % SKELETON_VOCAB for t in prompt]}
    for name, engine in engines.items():                # first-use costs, untimed
        step_times(engine, prompts[name], 4, f"warm-{name}")
    print(f"{args.dtype}, {args.threads} threads, {args.tokens} tokens a request, {nbytes / 1e6:.1f} MB of weights "
          f"a token; per round: step ms (median over the decode steps)")
    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="lmi-probe-") as scratch:
        layers, layer, lm_head = step_linears(config)
        size = WEIGHT_BYTES[args.dtype]
        for r in range(args.rounds):
            gbs = read_bandwidth(args.threads, None, 3, Path(scratch))["best_bytes_per_s"] / 1e9
            plain = step_read(args.threads, layers, [rows * cols * size for rows, cols in layer],
                              lm_head[0] * lm_head[1] * size, 5, Path(scratch))
            step = {}
            for name in (("model", "skeleton") if r % 2 == 0 else ("skeleton", "model")):
                step[name] = statistics.median(step_times(engines[name], prompts[name], args.tokens, f"r{r}-{name}"))
            ceiling = nbytes / (gbs * 1e9)
            whole, skeleton = step["model"], step["skeleton"]
            read_step = plain["best_s"]
            rows.append({"read_gb_per_s": gbs, "ceiling_step_s": ceiling, "demo_step_s": whole,
                         "skeleton_step_s": skeleton, "demo_fraction_of_ceiling": ceiling / whole,
                         "streaming_fraction_of_ceiling": ceiling / (whole - skeleton),
                         "plain_read_step_s": read_step, "plain_read_gb_per_s": plain["best_bytes_per_s"] / 1e9,
                         "plain_read_fraction_of_ceiling": ceiling / read_step,
                         "unoverlapped_fraction_of_ceiling": ceiling / (read_step + skeleton)})
            flag = "  (above 1: the probe caught a busier host than the round)" if ceiling > whole - skeleton else ""
            print(f"round {r}: read {gbs:.1f} GB/s, ceiling step {ceiling * 1e3:.2f}; model {whole * 1e3:.2f} "
                  f"({ceiling / whole:.2f} of the ceiling), skeleton {skeleton * 1e3:.2f}; model - skeleton "
                  f"{(whole - skeleton) * 1e3:.2f} ({ceiling / (whole - skeleton):.2f} of the ceiling){flag}; plain read "
                  f"of the weights in the step's calls {read_step * 1e3:.2f} ({ceiling / read_step:.2f} of the "
                  f"ceiling), plain read + skeleton, unoverlapped {(read_step + skeleton) * 1e3:.2f} "
                  f"({ceiling / (read_step + skeleton):.2f} of the ceiling)", flush=True)
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print(f"median: model step {median['demo_step_s'] * 1e3:.2f} ms = {median['demo_fraction_of_ceiling']:.2f} of its "
          f"round's ceiling; skeleton step {median['skeleton_step_s'] * 1e3:.2f} ms; streaming (model - skeleton) at "
          f"{median['streaming_fraction_of_ceiling']:.2f} of the ceiling; a plain read of the weights in the step's "
          f"calls at {median['plain_read_fraction_of_ceiling']:.2f}, with the skeleton's step after it (nothing "
          f"overlapped) {median['unoverlapped_fraction_of_ceiling']:.2f}")
    out.write_text(json.dumps({
        "what": FIXED_COSTS_DOC.splitlines()[0], "model": str(model_dir), "dtype": args.dtype, "threads": args.threads,
        "tokens": args.tokens, "weight_bytes_per_token": nbytes, "skeleton_config": skeleton_config(config),
        "source": source, "load_before": load_before, "load_after": os.getloadavg(), "cpu": cpu_model(),
        "rounds": rows, "median": median}, indent=1) + "\n")
    fixed_costs_plot(rows, out.with_suffix(".png"), args.dtype)
    print(f"wrote {out} and {out.with_suffix('.png')}")


def fixed_costs_plot(rows: list[dict], path: Path, dtype: str) -> None:
    """Per round: the ceiling step, the plain read's, the model's step and the skeleton's (ms), as grouped bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = 0.2
    for i, (key, label) in enumerate((("ceiling_step_s", "ceiling (weight bytes / read bandwidth)"),
                                      ("plain_read_step_s", "plain read of the weights, the step's calls"),
                                      ("demo_step_s", "the model's step"),
                                      ("skeleton_step_s", "the skeleton's step (weights in cache)"))):
        ax.bar([r + (i - 1.5) * width for r in range(len(rows))], [row[key] * 1e3 for row in rows], width, label=label)
    ax.set_xticks(range(len(rows)))
    ax.set_xlabel("round")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Batch-1 decode step, {dtype}: what is not weight streaming")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ==== kernels ===============================================================================================

KERNELS_DOC = """Microbenchmark of the batch-invariant CPU kernels against MKL and the previous tiled path.

Per op (the demo model's shapes): packed C++ linear in float32, bfloat16 (FMA form, and VDPBF16PS where
the CPU has it) and int8 vs F.linear in float32 and bfloat16 (MKL / oneDNN, not invariant) vs 16-row
tiled bmm (the PyTorch fallback) at M = 1, 16, 64; paged attention vs one SDPA call per
sequence for a 64-sequence decode step; and a whole ModelRunner decode step at batch 1 and 64
in both modes (KV contents are left as they are: timing only), the batch-invariant one both with
the fused C++ decoder layers (LlamaModel.fused, the default) and module by module (the PyTorch
reference path); `--profile` adds a torch.profiler per-op breakdown of a batch-1 step of each. Best of a few runs, wall clock;
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
    packed_linear picks it (build.bf16_dot_form) and, where the CPU has VDPBF16PS, through it
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
                   "tiled16_ms": best_ms(lambda x=x, w=weight: _tiled_matmul(x, w, INVARIANT_TILE), r)}
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


def bench_decode_step(model_dir: Path, batch_invariant: bool, repeats: int, profile: bool) -> list[dict]:
    runner = ModelRunner(model_dir, torch.float32, torch.device("cpu"), block_size=16, num_blocks=2048,
                         batch_invariant=batch_invariant)
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    results = []
    for fused in ((True, False) if batch_invariant else (False,)):
        runner.model.fused = fused
        result = {"batch_invariant": batch_invariant, "fused_layers": fused}
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
    runner.model.fused = True
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
}


def weight_bytes(model) -> int:
    """Bytes of weights one decode step streams: every packed linear and lm_head (the embedding is read a
    row at a time, the norms are negligible)."""
    from lmi_handler.engine.model.kernels import PackedWeight

    linears = [getattr(m, n) for layer in model.layers for m, n in (
        (layer.self_attn, "qkv_weight"), (layer.self_attn, "o_weight"), (layer.mlp, "gate_up_weight"),
        (layer.mlp, "down_weight"))] + [model.lm_head]
    return sum(w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size() for w in linears)


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
        report["decode_step"] = [r for inv in (True, False)
                                 for r in bench_decode_step(args.model_dir, inv, max(3, args.repeats // 4), args.profile)]
    report["load_average_after"] = os.getloadavg()
    out = REPO / "benchmarks" / "results" / f"kernels-{dt.date.today().isoformat()}-t{args.threads}-{args.clock}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


# ==== grammar ===============================================================================================

GRAMMAR_DOC = """Measure the two grammar libraries on this machine: tokenizer set-up, compile time, per-step mask cost.

Usage: .venv/bin/python benchmarks/profiling.py grammar [--model model] [--out FILE.json]
Each library is measured only when it is installed (the project installs llguidance; add xgrammar with
`pip install xgrammar` to compare). Compile times are wall seconds with the library's cache off (a fresh
matcher per spec), median of 3. The per-step cost is the thread CPU time (time.thread_time, so other
processes on the host do not count) of one mask fill plus one token consume, walked along a valid
output's tokens, 1 thread; its wall median is printed beside it. The GIL figure is how many iterations
of a pure-Python loop the main thread ran while a worker thread compiled the largest schema, as a
fraction of the same loop alone over the same wall time (1.0 = the compile never held the GIL).
"""

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}},
        "owner": {"type": "object", "properties": {"name": {"type": "string"},
                                                    "email": {"type": "string", "format": "email"}},
                  "required": ["name"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}, "minItems": 1}},
        "required": ["id", "tags", "owner", "items"]},
    "wide_enum": {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "enum": [f"value_{i}_{j}" for j in range(40)]} for i in range(60)},
        "required": [f"field_{i}" for i in range(60)]},
}
INSTANCES = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "nested": {"id": 7, "tags": ["red", "blue"], "owner": {"name": "Bob", "email": "bob@example.com"},
               "items": [{"sku": "ABC-1234", "qty": 2}, {"sku": "XYZ-0001", "qty": 10}]},
}
# --large adds it: llguidance builds it in about a second, xgrammar compiled it for minutes here
LARGE_SCHEMA = {"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 50 + 1}}}[0-9]+x{i}$"} for i in range(3000)},
    "required": [f"p{i}" for i in range(3000)]}
REGEXES = {"date": r"\d{4}-\d{2}-\d{2}", "phone": r"\(\d{3}\) \d{3}-\d{4}",
           "choice": r"(yes|no|maybe)"}
REGEX_TEXT = {"date": "2024-01-31", "phone": "(555) 123-4567", "choice": "maybe"}


def gil_share(work) -> float:
    """Main-thread Python progress while `work` runs in a thread, relative to the loop alone."""
    def spin(seconds: float) -> int:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            count += 1
        return count

    thread = threading.Thread(target=work)
    start = time.perf_counter()
    thread.start()
    count = 0
    while thread.is_alive():
        count += spin(0.01)
    elapsed = time.perf_counter() - start
    alone = spin(elapsed)
    return count / max(alone, 1)


def walk(fill, consume, tokens: list[int]) -> tuple[float, float, bool]:
    """(median thread-CPU us, median wall us) per step of fill+consume along `tokens`; all allowed?"""
    cpu, wall, ok = [], [], True
    for token in tokens:
        c0, w0 = time.thread_time(), time.perf_counter()
        allowed = fill(token)
        consume(token)
        cpu.append((time.thread_time() - c0) * 1e6)
        wall.append((time.perf_counter() - w0) * 1e6)
        ok &= allowed
    return statistics.median(cpu), statistics.median(wall), ok


def timed(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bit_set(mask_row, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def measure_llguidance(tokenizer, vocab_size: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    out = {"version": llguidance.get_version() if hasattr(llguidance, "get_version") else "?",
           "tokenizer_s": time.perf_counter() - start, "compile_s": {}, "step_cpu_us": {}, "step_wall_us": {}}
    grammars = {f"json:{k}": llguidance.LLMatcher.grammar_from_json_schema(
        v, defaults={"whitespace_flexible": False}) for k, v in SCHEMAS.items()}
    grammars.update({f"regex:{k}": llguidance.LLMatcher.grammar_from_regex(v) for k, v in REGEXES.items()})
    for name, grammar in grammars.items():
        out["compile_s"][name] = timed(lambda grammar=grammar: llguidance.LLMatcher(lltok, grammar))
    mask = llt.allocate_token_bitmask(1, vocab_size)
    texts = {f"json:{k}": json.dumps(v, separators=(",", ":")) for k, v in INSTANCES.items()}
    texts.update({f"regex:{k}": v for k, v in REGEX_TEXT.items()})
    for name, text in texts.items():
        matcher = llguidance.LLMatcher(lltok, grammars[name])
        tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

        def fill(token, matcher=matcher):
            llt.fill_next_token_bitmask(matcher, mask, 0)
            return bit_set(mask[0], token)
        cpu, wall, ok = walk(fill, matcher.consume_token, tokens)
        out["step_cpu_us"][name], out["step_wall_us"][name] = cpu, wall
        out.setdefault("valid_walk", {})[name] = ok and not matcher.is_error()
    big = grammars["json:wide_enum"]
    out["gil_share_during_compile"] = gil_share(lambda: llguidance.LLMatcher(lltok, big))
    return out


def measure_xgrammar(tokenizer, vocab_size: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    out = {"tokenizer_s": time.perf_counter() - start, "compile_s": {}, "step_cpu_us": {}, "step_wall_us": {}}

    def compiler():
        return xgr.GrammarCompiler(info, cache_enabled=False)

    builders = {f"json:{k}": (lambda v=v: compiler().compile_json_schema(json.dumps(v), any_whitespace=False))
                for k, v in SCHEMAS.items()}
    builders.update({f"regex:{k}": (lambda v=v: compiler().compile_regex(v)) for k, v in REGEXES.items()})
    compiled = {}
    for name, build in builders.items():
        out["compile_s"][name] = timed(build)
        compiled[name] = build()
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    texts = {f"json:{k}": json.dumps(v, separators=(", ", ": ")) for k, v in INSTANCES.items()}
    texts.update({f"regex:{k}": v for k, v in REGEX_TEXT.items()})
    for name, text in texts.items():
        matcher = xgr.GrammarMatcher(compiled[name])
        tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

        def fill(token, matcher=matcher):
            matcher.fill_next_token_bitmask(mask, 0)
            return bit_set(mask[0], token)
        cpu, wall, ok = walk(fill, matcher.accept_token, tokens)
        out["step_cpu_us"][name], out["step_wall_us"][name] = cpu, wall
        out.setdefault("valid_walk", {})[name] = ok and matcher.is_terminated()
    big = json.dumps(SCHEMAS["wide_enum"])
    out["gil_share_during_compile"] = gil_share(lambda: compiler().compile_json_schema(big, any_whitespace=False))
    return out


def grammar_main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=GRAMMAR_DOC.splitlines()[0])
    parser.add_argument("--model", default="model")
    parser.add_argument("--out", default=None)
    parser.add_argument("--large", action="store_true", help="also compile a 3000-property schema")
    args = parser.parse_args(argv)
    if args.large:
        SCHEMAS["large_3000"] = LARGE_SCHEMA
    from transformers import AutoConfig, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
    results = {"vocab_size": vocab_size}
    for name, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        try:
            results[name] = measure(tokenizer, vocab_size)
        except ImportError as exc:
            results[name] = {"not_installed": str(exc)}
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


# ==== the command line ======================================================================================

COMMANDS = {
    "breakdown": (breakdown_main, BREAKDOWN_DOC),
    "steps": (steps_main, STEPS_DOC),
    "fixed-costs": (fixed_costs_main, FIXED_COSTS_DOC),
    "kernels": (kernels_main, KERNELS_DOC),
    "grammar": (grammar_main, GRAMMAR_DOC),
}


def run_command(commands: dict, doc: str, argv: list[str] | None = None) -> None:
    """`TOOL COMMAND [its options]` over `commands` (name -> (main, doc)); no command or --help prints `doc`,
    an unknown one exits naming the known ones. Shared by profiling.py and ab.py."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(doc)
        return
    if argv[0] not in commands:
        sys.exit(f"unknown command {argv[0]!r}: one of {', '.join(commands)} (--help says what each measures)")
    run, _ = commands[argv[0]]
    sys.argv[0] = f"{Path(sys.argv[0]).name} {argv[0]}"      # the command's --help and errors name it
    run(argv[1:])


def main(argv: list[str] | None = None) -> None:
    """`profiling.py COMMAND [its options]`; `profiling.py COMMAND --help` for a command's own."""
    run_command(COMMANDS, __doc__, argv)


if __name__ == "__main__":
    main()
