"""Serving benchmark: our /invocations streaming server vs transformers' own generate().

Starts `lmi-handler serve` on a free loopback port, sends MT-bench prompts (turns[0] through the
chat template) with fixed concurrency, greedy, streaming, and measures TTFT, ITL, end-to-end
latency and throughput. Then, after the server has stopped (no CPU contention), runs
`AutoModelForCausalLM.generate` on the same prompts one at a time and as left-padded batches of
the same concurrency. Writes benchmarks/results/serving-<date>.json and a PNG plot.

    .venv/bin/python benchmarks/bench_serving.py [--num-prompts 16 --concurrency 8 --max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from lmi_handler.server.process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"  # ../shared beside the checkout


@dataclass
class RequestResult:
    prompt_index: int
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None
    num_output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    generated_text: str = ""
    finish_reason: str | None = None
    error: str | None = None


# ---------------------------------------------------------------- server side

async def stream_one(client: httpx.AsyncClient, index: int, prompt: str, max_new_tokens: int,
                     timeout_s: float) -> RequestResult:
    body = {"inputs": prompt, "stream": True,
            "parameters": {"max_new_tokens": max_new_tokens, "do_sample": False, "details": True}}
    result = RequestResult(prompt_index=index)
    token_times: list[float] = []
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/invocations", json=body) as resp:
                if resp.status_code != 200:
                    result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                    return result
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    now = time.perf_counter()
                    doc = json.loads(line)
                    token = doc.get("token") or {}
                    if token.get("id", -1) != -1:  # -1: LMI's sentinel, no real token
                        token_times.append(now)
                        result.token_ids.append(token["id"])
                    if "generated_text" in doc:
                        result.generated_text = doc["generated_text"]
                        result.finish_reason = (doc.get("details") or {}).get("finish_reason")
                    if doc.get("error"):
                        result.error = str(doc["error"])
    except (httpx.HTTPError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - start
    result.num_output_tokens = len(token_times)
    if token_times:
        result.ttft_s = token_times[0] - start
    if len(token_times) > 1:
        result.itl_s = (token_times[-1] - token_times[0]) / (len(token_times) - 1)
    return result


async def run_load(url: str, prompts: list[str], concurrency: int, max_new_tokens: int,
                   timeout_s: float) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        # warm-up: one short request, not measured
        await stream_one(client, -1, prompts[0], 4, timeout_s)

        async def bounded(i: int, prompt: str) -> RequestResult:
            async with sem:
                return await stream_one(client, i, prompt, max_new_tokens, timeout_s)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i, p) for i, p in enumerate(prompts)))
        return list(results), time.perf_counter() - start


def bench_server(args, prompts: list[str], log_path: Path) -> dict:
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)} if args.threads else {}
    server = ServerProcess({"max_rolling_batch_size": str(args.max_rolling_batch_size),
                            "batch_invariant": args.batch_invariant}, log_path,
                           REPO / "serving.properties", env=threads)
    try:
        ready_s = server.wait_ready(args.server_start_timeout_s)
        load_before = os.getloadavg()
        results, wall_s = asyncio.run(run_load(server.url, prompts, args.concurrency,
                                               args.max_new_tokens, args.request_timeout_s))
    finally:
        server.stop()
    return {"results": results, "wall_s": wall_s, "ready_s": ready_s,
            "loadavg": {"before": load_before, "after": os.getloadavg()}}


# ---------------------------------------------------------------- transformers peer

def trim_at_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    """Generated ids up to and including the first eos (HF pads finished rows with pad = eos)."""
    for i, tok in enumerate(ids):
        if tok in eos_ids:
            return ids[: i + 1]
    return ids


def bench_hf(args, prompts: list[str]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, temperature=None,
                      top_p=None, top_k=None, pad_token_id=tok.pad_token_id)

    def generate(batch: list[str], max_new_tokens: int) -> list[list[int]]:
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**enc, **{**gen_kwargs, "max_new_tokens": max_new_tokens})
        width = enc["input_ids"].shape[1]
        return [trim_at_eos(row[width:].tolist(), eos_ids) for row in out]

    generate(prompts[:1], 4)  # warm-up
    load_before = os.getloadavg()
    start = time.perf_counter()
    sequential = [generate([p], args.max_new_tokens)[0] for p in prompts]
    seq_s = time.perf_counter() - start

    start = time.perf_counter()
    batched: list[list[int]] = []
    for i in range(0, len(prompts), args.concurrency):
        batched.extend(generate(prompts[i:i + args.concurrency], args.max_new_tokens))
    batch_s = time.perf_counter() - start
    return {"loadavg": {"before": load_before, "after": os.getloadavg()},
            "sequential": sequential, "sequential_s": seq_s, "batched": batched, "batched_s": batch_s,
            "eos_ids": eos_ids, "decode": lambda ids: tok.decode(ids, skip_special_tokens=True)}


# ---------------------------------------------------------------- report

def load_prompts(n: int, model: str) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    questions = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    if n > len(questions):
        raise SystemExit(f"only {len(questions)} MT-bench questions, asked for {n}")
    return [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                    add_generation_prompt=True, tokenize=False) for q in questions[:n]]


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    values = sorted(values)

    def pct(p: float) -> float:
        k = (len(values) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (k - lo)

    return {"mean": statistics.fmean(values), "p50": pct(0.5), "p90": pct(0.9),
            "min": values[0], "max": values[-1]}


def machine_info(threads: int | None) -> dict:
    import torch
    import transformers

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_num_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)),
            "server_threads": "OMP_NUM_THREADS=%s" % threads if threads else "torch default"}


def compare_outputs(ours: list[RequestResult], hf: list[list[int]], eos_ids: set[int], decode) -> dict:
    """How many of our greedy outputs equal HF's sequential greedy output (informational)."""
    token_equal = text_equal = 0
    mismatches = []
    for r, ref in zip(ours, hf):
        a = [t for t in r.token_ids if t not in eos_ids]
        b = [t for t in ref if t not in eos_ids]
        token_equal += a == b
        text_equal += r.generated_text.strip() == decode(ref).strip()
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append({"prompt_index": r.prompt_index, "first_diff_token": first,
                               "ours_len": len(a), "hf_len": len(b)})
    return {"num_compared": len(hf), "token_equal": token_equal, "text_equal": text_equal,
            "mismatches": mismatches}


def build_report(args, prompts, server: dict, hf: dict) -> dict:
    results: list[RequestResult] = server["results"]
    ok = [r for r in results if r.error is None]
    ours_tokens = sum(r.num_output_tokens for r in ok)
    seq_tokens = sum(len(ids) for ids in hf["sequential"])
    batch_tokens = sum(len(ids) for ids in hf["batched"])
    ours_tps = ours_tokens / server["wall_s"]
    seq_tps = seq_tokens / hf["sequential_s"]
    batch_tps = batch_tokens / hf["batched_s"]
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine_info(args.threads),
        "server": {
            "startup_s": server["ready_s"], "wall_s": server["wall_s"], "loadavg_1_5_15": server["loadavg"],
            "num_requests": len(results), "num_errors": len(results) - len(ok),
            "errors": [{"prompt_index": r.prompt_index, "error": r.error} for r in results if r.error],
            "output_tokens": ours_tokens, "output_tokens_per_s": ours_tps,
            "requests_per_s": len(ok) / server["wall_s"],
            "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "itl_s": percentiles([r.itl_s for r in ok if r.itl_s is not None]),
            "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
            "output_tokens_per_request": percentiles([float(r.num_output_tokens) for r in ok]),
            "finish_reasons": {str(fr): sum(r.finish_reason == fr for r in ok)
                               for fr in {r.finish_reason for r in ok}},
            "per_request": [{k: v for k, v in asdict(r).items() if k not in ("token_ids", "generated_text")}
                            for r in results],
        },
        "hf_loadavg_1_5_15": hf["loadavg"],
        "hf_sequential": {"wall_s": hf["sequential_s"], "output_tokens": seq_tokens,
                          "output_tokens_per_s": seq_tps},
        "hf_batched": {"wall_s": hf["batched_s"], "batch_size": args.concurrency,
                       "output_tokens": batch_tokens, "output_tokens_per_s": batch_tps},
        "ratios": {"ours_vs_hf_sequential": ours_tps / seq_tps, "ours_vs_hf_batched": ours_tps / batch_tps},
        "greedy_match_vs_hf_sequential": compare_outputs(ok, [hf["sequential"][r.prompt_index] for r in ok],
                                                         hf["eos_ids"], hf["decode"]),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_request = [r for r in report["server"]["per_request"] if r["error"] is None]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    names = ["lmi_handler\n(serving, C=%d)" % report["config"]["concurrency"], "HF generate\nsequential",
             "HF generate\nbatched (%d)" % report["config"]["concurrency"]]
    values = [report["server"]["output_tokens_per_s"], report["hf_sequential"]["output_tokens_per_s"],
              report["hf_batched"]["output_tokens_per_s"]]
    bars = axes[0].bar(names, values, color=["tab:blue", "tab:gray", "tab:orange"])
    axes[0].bar_label(bars, fmt="%.1f")
    axes[0].set_ylabel("output tokens / s")
    axes[0].set_title("Throughput")
    axes[1].hist([r["ttft_s"] for r in per_request if r["ttft_s"] is not None], bins=12, color="tab:blue")
    axes[1].set_xlabel("TTFT (s)")
    axes[1].set_ylabel("requests")
    axes[1].set_title("Time to first token")
    axes[2].hist([r["itl_s"] * 1000 for r in per_request if r["itl_s"] is not None], bins=12, color="tab:green")
    axes[2].set_xlabel("mean ITL per request (ms)")
    axes[2].set_title("Inter-token latency")
    m = report["machine"]
    fig.suptitle(f"{report['config']['num_prompts']} MT-bench prompts, max_new_tokens="
                 f"{report['config']['max_new_tokens']}, greedy; torch {m['torch']}, "
                 f"{m['cpu_count']} CPUs, {m['torch_num_threads']} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(report: dict) -> None:
    s, seq, bat = report["server"], report["hf_sequential"], report["hf_batched"]
    print(f"\n{'':28}{'tok/s':>9}{'wall s':>9}{'tokens':>8}")
    print(f"{'lmi_handler serving':28}{s['output_tokens_per_s']:9.1f}{s['wall_s']:9.1f}{s['output_tokens']:8d}")
    print(f"{'HF generate, sequential':28}{seq['output_tokens_per_s']:9.1f}{seq['wall_s']:9.1f}{seq['output_tokens']:8d}")
    print(f"{'HF generate, batched':28}{bat['output_tokens_per_s']:9.1f}{bat['wall_s']:9.1f}{bat['output_tokens']:8d}")
    print(f"\nrequests/s {s['requests_per_s']:.3f}   errors {s['num_errors']}/{s['num_requests']}")
    for key in ("ttft_s", "itl_s", "e2e_s"):
        p = s[key]
        if p:
            print(f"{key:8} p50 {p['p50']:.3f}  p90 {p['p90']:.3f}  mean {p['mean']:.3f}")
    r = report["ratios"]
    print(f"ours/HF sequential {r['ours_vs_hf_sequential']:.2f}x   ours/HF batched {r['ours_vs_hf_batched']:.2f}x")
    g = report["greedy_match_vs_hf_sequential"]
    print(f"greedy outputs equal to HF: {g['token_equal']}/{g['num_compared']} by tokens, "
          f"{g['text_equal']}/{g['num_compared']} by text")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-invariant", choices=["true", "false"], default="true",
                        help="option.batch_invariant of the server (false: plain GEMMs, one padded attention call)")
    parser.add_argument("--max-rolling-batch-size", type=int, default=16,
                        help="OPTION_MAX_ROLLING_BATCH_SIZE for the server")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both the server (OMP_NUM_THREADS) and HF generate; "
                             "0: torch's own choice (one per core, slow when the CPU is shared; see README)")
    parser.add_argument("--model", type=Path, default=REPO / "model")
    parser.add_argument("--request-timeout-s", type=float, default=300)
    parser.add_argument("--server-start-timeout-s", type=float, default=180)
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.num_prompts, str(args.model))
    log_path = Path(tempfile.mkstemp(prefix="bench-server-", suffix=".log")[1])
    print(f"server log: {log_path}", flush=True)
    server = bench_server(args, prompts, log_path)
    print(f"served {len(prompts)} requests in {server['wall_s']:.1f} s; running HF generate ...", flush=True)
    hf = bench_hf(args, prompts)
    report = build_report(args, prompts, server, hf)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    variant = "" if args.batch_invariant == "true" else "-plain"
    stem = args.out_dir / f"serving-{dt.date.today().isoformat()}{variant}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, stem.with_suffix(".png"))
    print_summary(report)
    print(f"\nwrote {stem}.json and {stem}.png")
    return 1 if report["server"]["num_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
