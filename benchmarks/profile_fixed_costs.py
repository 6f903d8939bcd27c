"""What a batch-1 decode step costs besides streaming its weights: the demo model's step against a model of
the same layer geometry whose weights stay in cache, and the read probe, taking turns in one process.

The "skeleton" is a random Llama with the demo model's 30 layers, 9 query heads, 3 KV heads and head_dim 64,
but hidden size 144, intermediate size 64 and a 512-token vocabulary (written once with transformers to
`--skeleton-dir`, the demo model's tokenizer and chat template beside it): its step runs every op the demo model's does, at
the same contexts (the same prompt's length, its ids taken modulo 512, and the same number of tokens), with about 14 MB of weights (bf16), so its
time is the per-step cost that does not scale with the weights' bytes: the engine's Python, the decoder
stack's attention, norms, RoPE, allocations and thread hand-offs. The demo model's step adds to that the
streaming of 269 MB (bf16). Each round: the read probe (probes.read_bandwidth, as the benchmark takes it
before a batch-1 round), one request alone on the demo model, one on the skeleton (`--tokens` greedy tokens,
EOS ignored, the order flipping each round). Per round it prints each engine's step (wall ms, median over the
decode steps), the ceiling step (weight bytes / read bandwidth), the demo step's fraction of that ceiling,
and (demo - skeleton) against the ceiling: how close the weight streaming alone comes to the probe.

Writes the rounds and the host's load to `--out` (JSON, default benchmarks/results/fixed-costs-<date>.json) and a
plot beside it (.png: per round, the ceiling step, the demo step and the skeleton step).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_fixed_costs.py [--dtype bf16] [--rounds 6] [--tokens 128]
        [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_breakdown import bench_engine  # noqa: E402
from workload import REPO, build_workload, weight_bytes_per_token  # noqa: E402

SKELETON = dict(hidden_size=144, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, head_dim=64, vocab_size=512, max_position_embeddings=2048,
                rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def write_skeleton(path: Path, model_dir: Path) -> None:
    """The skeleton checkpoint (random weights, seed 0, bf16) and the demo model's tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SKELETON)).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, path / name)


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per request (EOS ignored)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=str(REPO / "model"))
    p.add_argument("--out", default=None, help="results JSON (a .png of the same name beside it)")
    p.add_argument("--skeleton-dir", default=str(Path(tempfile.gettempdir()) / "lmi-skeleton-model"),
                   help="where the skeleton checkpoint is written (once) and read")
    args = p.parse_args(argv)

    from probes import read_bandwidth

    model_dir, skeleton_dir = Path(args.model), Path(args.skeleton_dir)
    if not (skeleton_dir / "config.json").is_file():
        skeleton_dir.mkdir(parents=True, exist_ok=True)
        write_skeleton(skeleton_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    nbytes = weight_bytes_per_token(config, args.dtype)["bytes"]
    engines = {"demo": bench_engine(str(model_dir), args.dtype, args.threads),
               "skeleton": bench_engine(str(skeleton_dir), args.dtype, args.threads)}
    prompt = build_workload(model_dir, 1, args.tokens).prompt_token_ids[0]
    # the same length (so the same contexts) in the skeleton's vocabulary
    prompts = {"demo": prompt, "skeleton": [t % SKELETON["vocab_size"] for t in prompt]}
    for name, engine in engines.items():                # first-use costs, untimed
        step_times(engine, prompts[name], 4, f"warm-{name}")
    print(f"{args.dtype}, {args.threads} threads, {args.tokens} tokens a request, {nbytes / 1e6:.1f} MB of weights "
          f"a token; per round: step ms (median over the decode steps)")
    rows, scratch = [], Path(tempfile.mkdtemp(prefix="lmi-probe-"))
    load_before = os.getloadavg()
    for r in range(args.rounds):
        gbs = read_bandwidth(args.threads, None, 3, scratch)["best_bytes_per_s"] / 1e9
        step = {}
        for name in (("demo", "skeleton") if r % 2 == 0 else ("skeleton", "demo")):
            step[name] = statistics.median(step_times(engines[name], prompts[name], args.tokens, f"r{r}-{name}"))
        ceiling = nbytes / (gbs * 1e9)
        demo, skeleton = step["demo"], step["skeleton"]
        rows.append({"read_gb_per_s": gbs, "ceiling_step_s": ceiling, "demo_step_s": demo, "skeleton_step_s": skeleton,
                     "demo_fraction_of_ceiling": ceiling / demo, "streaming_fraction_of_ceiling": ceiling / (demo - skeleton)})
        print(f"round {r}: read {gbs:.1f} GB/s, ceiling step {ceiling * 1e3:.2f}; demo {demo * 1e3:.2f} "
              f"({ceiling / demo:.2f} of the ceiling), skeleton {skeleton * 1e3:.2f}; demo - skeleton "
              f"{(demo - skeleton) * 1e3:.2f} ({ceiling / (demo - skeleton):.2f} of the ceiling)", flush=True)
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print(f"median: demo step {median['demo_step_s'] * 1e3:.2f} ms = {median['demo_fraction_of_ceiling']:.2f} of its "
          f"round's ceiling; skeleton step {median['skeleton_step_s'] * 1e3:.2f} ms; streaming (demo - skeleton) at "
          f"{median['streaming_fraction_of_ceiling']:.2f} of the ceiling")
    out = Path(args.out or REPO / "benchmarks" / "results" / f"fixed-costs-{time.strftime('%Y-%m-%d-%H%M')}.json")
    source = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    out.write_text(json.dumps({
        "what": __doc__.splitlines()[0], "dtype": args.dtype, "threads": args.threads, "tokens": args.tokens,
        "weight_bytes_per_token": nbytes, "skeleton_config": SKELETON, "source": source,
        "load_before": load_before, "load_after": os.getloadavg(), "cpu": platform.processor() or platform.machine(),
        "rounds": rows, "median": median}, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"), args.dtype)
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(rows: list[dict], path: Path, dtype: str) -> None:
    """Per round: the ceiling step, the demo model's step and the skeleton's (ms), as grouped bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for i, (key, label) in enumerate((("ceiling_step_s", "ceiling (weight bytes / read bandwidth)"),
                                      ("demo_step_s", "demo model step"),
                                      ("skeleton_step_s", "skeleton step (weights in cache)"))):
        ax.bar([r + (i - 1) * width for r in range(len(rows))], [row[key] * 1e3 for row in rows], width, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Batch-1 decode step, {dtype}: what is not weight streaming")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

if __name__ == "__main__":
    main()
