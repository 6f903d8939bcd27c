"""`profiling.py fixed-costs`: what a batch-1 decode step costs besides streaming its weights (against a same-geometry
skeleton).

A command of benchmarks/profiling.py, which calls fixed_costs_main; `profiling.py fixed-costs --help` prints
FIXED_COSTS_DOC.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from workload import REPO, WEIGHT_BYTES, bench_engine, build_workload, step_linears, weight_bytes_per_token

from lmi_handler.engine.sequence import SamplingParams

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
