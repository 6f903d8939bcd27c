"""Benchmark workers that run in the project's venv, one engine per process (so its RSS is its own).

    python benchmarks/workers.py hf|peak --workload W.json --out R.json [options]
    python benchmarks/workers.py ours-offline|ours-batch1 --workload W.json --control-dir D --out R.json [options]
    python benchmarks/workers.py ours-structured --workload W.json --schemas S.json --control-dir D --out R.json [options]

Each writes one JSON result to --out. ours-offline, ours-batch1 and ours-structured are long-lived: after the warm-up they
run one round (the whole workload; one request alone) per "run K" line on stdin and end on "finish"
(round_protocol.py). The orchestrator (bench.py) samples their memory; nothing here starts another engine.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_protocol import READY, percentiles, serve, summarize, write_json  # noqa: E402
from workload import REPO, Workload  # noqa: E402


def latency_stats(token_times: dict[str, list[float]], start: float) -> dict:
    """TTFT per request (start -> first token) and pooled ITL (gaps between a request's tokens), seconds."""
    ttft = [times[0] - start for times in token_times.values() if times]
    gaps = [b - a for times in token_times.values() for a, b in pairwise(times)]
    return {"ttft_s": percentiles(ttft), "itl_s": percentiles(gaps)}


# ---------------------------------------------------------------- our engine

def unknown_options(options: dict[str, str]) -> list[str]:
    """The keys of `options` that this engine build's Settings does not define. Settings ignores unknown keys
    (serving.properties carries other tools' keys too), so an option this build lacks (`quantize` before it
    exists) would run silently without it: the benchmark refuses those instead."""
    from lmi_handler.config import Settings

    return sorted(k for k in options if k.lower() not in Settings.model_fields)


def our_settings(options: dict[str, str]):
    """Settings as the server would build them: serving.properties, then the benchmark's options.
    Raises ValueError naming any option this engine build does not have; ConfigError on a bad value."""
    from lmi_handler.config import Settings, read_serving_properties

    if unknown := unknown_options(options):
        raise ValueError(f"option.{', option.'.join(unknown)}: not supported by this engine build "
                         "(lmi_handler.config.Settings has no such field)")
    props = read_serving_properties(REPO / "serving.properties", environ={})
    props.update(options)
    return Settings.from_properties(props)


def run_engine(engine, workload: Workload, params, prefix: str) -> dict:
    """Add every request at once, step until all finish; per-request token times and outputs."""
    start = time.perf_counter()
    seqs = {f"{prefix}{i}": engine.add_request(f"{prefix}{i}", ids, params, seed=0)
            for i, ids in enumerate(workload.prompt_token_ids)}
    token_times: dict[str, list[float]] = {rid: [] for rid in seqs}
    num_steps = 0
    while engine.has_unfinished:
        outputs = engine.step()
        now = time.perf_counter()
        num_steps += 1
        for out in outputs:
            token_times[out.request_id].extend([now] * len(out.new_tokens))
    wall = time.perf_counter() - start
    tokens = sum(seq.num_output_tokens for seq in seqs.values())
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall, "num_steps": num_steps,
            **latency_stats(token_times, start), "token_times": token_times,
            "output_token_ids": [seq.output_token_ids for seq in seqs.values()]}


def drop_prefix_cache(allocator) -> None:
    """Empty the engine's prefix cache, so that every round computes its prompts as the first one did.

    The engine has no reset call: allocating every free block evicts the cached ones (allocate clears
    their hashes), and freeing them leaves them empty. Only between rounds, when no sequence holds a block.
    """
    allocator.free(allocator.allocate(allocator.num_free_blocks))
    assert allocator.num_cached_blocks == 0, "a sequence still holds cached blocks between rounds"


def batch1_decode(engine, workload: Workload, params, prefix: str) -> dict:
    """One request (the workload's first prompt) alone: decode tok/s = (tokens - 1) / (last token time -
    first token time), so the prefill (before the first token) is left out."""
    one = run_engine(engine, workload.head(1), params, prefix)
    times = next(iter(one.pop("token_times").values()))
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    return {"output_tokens": one["output_tokens"], "wall_s": one["wall_s"], "decode_tokens_per_s": decode,
            "output_token_ids": one["output_token_ids"],
            "method": "(tokens - 1) / (last token time - first token time), one request alone"}


def restart_as_lmi_handler_would(options: dict[str, str]) -> None:
    """Our engine's process as `lmi-handler serve` / `batch` start it: once more with glibc malloc's heap on
    huge pages, unless option.malloc_tuning or option.huge_pages is off (engine/host_memory.py). A setting
    the worker refuses is left for it to report."""
    from lmi_handler.engine.host_memory import restart_with_malloc_huge_pages

    try:
        settings = our_settings(options)
    except Exception:  # noqa: BLE001 - reported where the worker starts its engine
        return
    restart_with_malloc_huge_pages(settings.malloc_tuning, settings.huge_pages)


def start_engine(options: dict[str, str]):
    """Settings from `options`, the Engine, greedy SamplingParams; and the start-up seconds."""
    from lmi_handler.engine.engine import Engine

    settings = our_settings(options)
    start = time.perf_counter()
    engine = Engine(settings.engine_config())
    return settings, engine, time.perf_counter() - start


def engine_facts(settings, engine) -> dict:
    """What the run was: settings, device, dtype, threads, and whether malloc's heap was on huge pages
    (`malloc`: host_memory's phrase, from GLIBC_TUNABLES as this worker was started)."""
    import torch

    from lmi_handler.engine.host_memory import malloc_huge_pages_state

    return {"engine": "ours", "settings": settings.model_dump(mode="json"), "device": str(engine.device),
            "dtype": str(engine.runner.dtype), "torch_num_threads": torch.get_num_threads(),
            "malloc": malloc_huge_pages_state()}


def ours_offline(args, workload: Workload) -> dict:
    """Start and warm up the engine, run the workload once per "run K" command, then batch-1 decode."""
    from lmi_handler.engine.sequence import SamplingParams

    settings, engine, startup_s = start_engine(dict(args.option))
    params = SamplingParams(greedy=True, max_new_tokens=workload.max_new_tokens, ignore_eos=True)
    start = time.perf_counter()
    run_engine(engine, workload.warmup(), replace(params, max_new_tokens=2), "warmup-")
    warmup_s = time.perf_counter() - start

    def one_round(k: int) -> dict:
        drop_prefix_cache(engine.allocator)
        stats = engine.allocator.prefix_cache_stats
        hits = stats.num_hit_tokens
        result = run_engine(engine, workload, params, f"r{k}-")
        result["num_requests"] = len(result.pop("token_times"))
        result["prefix_cache_hit_tokens"] = stats.num_hit_tokens - hits
        return result

    rounds = serve(args.control_dir, {"startup_s": startup_s, "warmup_s": warmup_s}, one_round)
    batch1 = batch1_decode(engine, workload, params, "b1-")
    batch1.pop("output_token_ids")
    return {**engine_facts(settings, engine), "startup_s": startup_s, "warmup_s": warmup_s, **summarize(rounds),
            "batch1": batch1}


def ours_batch1(args, workload: Workload) -> dict | None:
    """Batch-1 decode in rounds (round_protocol.py), beside the batch-1 peer: each "run K" measures the read
    bandwidth (read_probe_before_round), then decodes the workload's first prompt alone from an empty prefix
    cache; a round's output_tokens_per_s is its decode tok/s (batch1_decode). An option the engine refuses
    at start-up (a ConfigError, an option this build lacks) is written to ready.json as "refused" and the worker ends without a result (returns None)."""
    from lmi_handler.config import ConfigError
    from lmi_handler.engine.sequence import SamplingParams

    try:
        settings, engine, startup_s = start_engine(dict(args.option))
    except (ConfigError, ValueError) as exc:
        write_json(args.control_dir / READY, {"refused": f"{type(exc).__name__}: {exc}"})
        return None
    params = SamplingParams(greedy=True, max_new_tokens=workload.max_new_tokens, ignore_eos=True)
    start = time.perf_counter()
    run_engine(engine, workload.head(1), replace(params, max_new_tokens=4), "warmup-")
    warmup_s = time.perf_counter() - start

    def one_round(k: int) -> dict:
        drop_prefix_cache(engine.allocator)
        read = read_probe_before_round(args.threads, args.control_dir)
        result = batch1_decode(engine, workload, params, f"r{k}-")
        return {**result, "output_tokens_per_s": result["decode_tokens_per_s"], **read}

    rounds = serve(args.control_dir, {"startup_s": startup_s, "warmup_s": warmup_s}, one_round)
    return {**engine_facts(settings, engine), "startup_s": startup_s, "warmup_s": warmup_s, **summarize(rounds)}


def read_probe_before_round(threads: int, scratch: Path) -> dict:
    """The read bandwidth of this minute (host.read_bandwidth, 3 passes of its default buffer, the same
    threads), taken just before a batch-1 round so that its ceiling is the round's own: the host's bandwidth
    moved 2x between one run's start and end probes. {"read_bytes_per_s": B/s} or {"read_probe_skipped": why}."""
    from host import read_bandwidth

    try:
        return {"read_bytes_per_s": read_bandwidth(threads, None, 3, scratch)["best_bytes_per_s"]}
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:
        return {"read_probe_skipped": str(exc)[:300]}


# ---------------------------------------------------------------- transformers generate()

def hf_generate(args, workload: Workload) -> dict:
    """Static batches (left padding) of transformers' generate(), greedy, EOS ignored.

    Probes each of --hf-batch-sizes on the first `size` prompts with --hf-probe-tokens tokens, then runs
    the whole workload in batches of the fastest size.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32}.get(args.dtype) or getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(workload.model)
    model = AutoModelForCausalLM.from_pretrained(workload.model, dtype=dtype).to(device).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    config = model.generation_config
    config.eos_token_id = None  # EOS ignored: every row runs to max_new_tokens, as in the other engines
    config.pad_token_id = pad
    config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None

    def generate(rows: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                 max_new_tokens=max_new_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        return out[:, width:].tolist(), time.perf_counter() - start

    generate(workload.prompt_token_ids[:1], 4)  # warm-up
    probes = []
    for size in args.hf_batch_sizes:
        rows = workload.prompt_token_ids[:size]
        if len(rows) < size:
            continue
        out, secs = generate(rows, args.hf_probe_tokens)
        probes.append({"batch_size": size, "output_tokens": sum(map(len, out)), "wall_s": secs,
                       "output_tokens_per_s": sum(map(len, out)) / secs})
    best = max(probes, key=lambda p: p["output_tokens_per_s"])["batch_size"] if probes else 1
    outputs, wall = [], 0.0
    for i in range(0, workload.num_prompts, best):
        out, secs = generate(workload.prompt_token_ids[i:i + best], workload.max_new_tokens)
        outputs.extend(out)
        wall += secs
    tokens = sum(map(len, outputs))
    return {"engine": "hf", "device": device, "dtype": str(dtype), "torch_num_threads": torch.get_num_threads(),
            "probes": probes, "probe_tokens": args.hf_probe_tokens, "batch_size": best,
            "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "output_token_ids": outputs}


# ---------------------------------------------------------------- structured output

def run_requests(engine, prompt_ids: list[list[int]], params_list: list, prefix: str) -> dict:
    """Add every request at once (each its own SamplingParams), step until all finish; the run's figures
    (structured.run_figures), each request's token ids, text and whether it ended on eos/a stop id."""
    from structured import run_figures

    from lmi_handler.engine.sequence import FinishReason

    start = time.perf_counter()
    seqs = [engine.add_request(f"{prefix}{i}", ids, params, seed=0)
            for i, (ids, params) in enumerate(zip(prompt_ids, params_list, strict=True))]
    num_steps = 0
    while engine.has_unfinished:
        engine.step()
        num_steps += 1
    wall = time.perf_counter() - start
    ids = [list(seq.output_token_ids) for seq in seqs]
    errors = [seq.request_id for seq in seqs if seq.finish_reason is FinishReason.ERROR]
    if errors:
        raise RuntimeError(f"requests {errors[:5]} ended with finish reason error")
    return {**run_figures(wall, [seq.num_output_tokens for seq in seqs], num_steps), "output_token_ids": ids,
            "texts": [engine.tokenizer.decode(x, skip_special_tokens=True) for x in ids],
            "finished_on_grammar": [seq.finish_reason in (FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE)
                                    for seq in seqs]}


def ours_structured(args, workload: Workload) -> dict:
    """The structured-output phase (structured.py): the workload's prompts, EOS honoured, each with its JSON
    schema (SamplingParams.structured_output, as protocol/decoding.py builds it for response_format
    json_schema) and without, both runs in every round (the order alternating); compile times first."""
    from structured import compile_record, schema_text, structured_round

    from lmi_handler.engine.sequence import GrammarKind, SamplingParams, StructuredOutputSpec

    schemas = json.loads(args.schemas.read_text())
    settings, engine, startup_s = start_engine(dict(args.option))
    plain = SamplingParams(greedy=True, max_new_tokens=workload.max_new_tokens)
    specs = [replace(plain, structured_output=StructuredOutputSpec(GrammarKind.JSON_SCHEMA, schema_text(s)))
             for s in schemas]
    start = time.perf_counter()
    run_engine(engine, workload.warmup(), replace(plain, max_new_tokens=2, ignore_eos=True), "warmup-")
    warmup_s = time.perf_counter() - start
    ids = workload.prompt_token_ids
    # compile costs, each against the same request unconstrained (the prompt's prefix then cached for both)
    one_plain = run_requests(engine, ids[:1], [replace(plain, max_new_tokens=1)], "c1u-")["wall_s"]
    one_cold = run_requests(engine, ids[:1], [replace(specs[0], max_new_tokens=1)], "c1c-")["wall_s"]
    drop_prefix_cache(engine.allocator)
    all_plain = run_requests(engine, ids, [replace(plain, max_new_tokens=2)] * len(ids), "cau-")["wall_s"]
    drop_prefix_cache(engine.allocator)
    all_cold = run_requests(engine, ids, [replace(p, max_new_tokens=2) for p in specs], "cac-")["wall_s"]
    compiles = compile_record(
        one_cold, one_plain, all_cold, all_plain,
        "wall time of one 1-token request with the first schema (cold: the tokenizer table and its compile "
        "included) minus the same request unconstrained; then all requests at 2 tokens with their schemas (the "
        "other compiles, on the compile threads) minus the same unconstrained; the rounds then find every "
        "schema compiled (cached by spec)")

    def run(k: int, mode: str, lengths: list[int] | None) -> dict:
        drop_prefix_cache(engine.allocator)
        params = {"constrained": lambda: specs, "unconstrained": lambda: [plain] * len(ids),
                  "length_matched": lambda: [replace(plain, max_new_tokens=n, ignore_eos=True) for n in lengths]}
        return run_requests(engine, ids, params[mode](), f"r{k}{mode[0]}-")

    rounds = serve(args.control_dir, {"startup_s": startup_s, "warmup_s": warmup_s, **{
        k: v for k, v in compiles.items() if k != "method"}},
                   lambda k: structured_round(k, lambda mode, lengths: run(k, mode, lengths), schemas))
    return {**engine_facts(settings, engine), "startup_s": startup_s, "warmup_s": warmup_s,
            "grammar_backend": grammar_backend(), "compile": compiles, **summarize(rounds)}


def grammar_backend() -> str:
    import llguidance

    version = getattr(llguidance, "__version__", None) or (llguidance.get_version()
                                                            if hasattr(llguidance, "get_version") else "?")
    return f"llguidance {version}"


# ---------------------------------------------------------------- the machine's ceilings

def peak(args, workload: Workload) -> dict:
    """The probes of host.py: peak matmul FLOP/s in each of --dtypes (the first one's also at the top
    level, as older results had it), the memory read bandwidth and the cores' peak float32 FMA rate (each
    or why it could not be measured)."""
    import torch
    from host import fma_peak, peak_matmul, read_bandwidth

    config = json.loads((Path(workload.model) / "config.json").read_text())
    decode_shape = (64, config["hidden_size"], config["intermediate_size"])
    by_dtype = {d: peak_matmul(d, args.peak_size, args.threads, decode_shape) for d in args.dtypes.split(",")}
    try:
        mem = read_bandwidth(args.threads, args.mem_bytes or None, args.mem_repeats, args.out.parent)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        mem = {"skipped": str(exc)}
    try:      # the CPU's ceiling: on CUDA the GPU's is the matmul probe's
        fma = ({"skipped": "CUDA run: the float32 FMA peak is a CPU ceiling"} if torch.cuda.is_available()
               else fma_peak(args.threads, args.out.parent, repeats=args.mem_repeats))
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:
        fma = {"skipped": str(exc)}
    return {**by_dtype[args.dtypes.split(",")[0]], "by_dtype": by_dtype, "mem_read": mem, "fma_peak": fma}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("worker", choices=["ours-offline", "ours-batch1", "ours-structured", "hf", "peak"])
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--control-dir", type=Path, help="ours-offline: where ready.json and round-K.json go")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's choice)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--option", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                        help="our engine's option.KEY (ours-offline)")
    parser.add_argument("--schemas", type=Path, help="ours-structured: a JSON list, one schema per prompt")
    parser.add_argument("--hf-batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64])
    parser.add_argument("--hf-probe-tokens", type=int, default=32)
    parser.add_argument("--peak-size", type=int, default=0, help="peak: square matmul size (0: 2048; CUDA 8192)")
    parser.add_argument("--dtypes", default="fp32", help="peak: matmul dtypes, comma-separated (fp32, bf16)")
    parser.add_argument("--mem-bytes", type=int, default=0, help="peak: read-bandwidth buffer (0: probes' default)")
    parser.add_argument("--mem-repeats", type=int, default=10, help="peak: read-bandwidth passes (best is kept)")
    args = parser.parse_args(argv)
    if args.worker in ("ours-offline", "ours-batch1", "ours-structured") and args.control_dir is None:
        parser.error(f"{args.worker} needs --control-dir")
    if args.worker == "ours-structured" and args.schemas is None:
        parser.error("ours-structured needs --schemas")
    if argv is None and args.worker.startswith("ours-"):
        restart_as_lmi_handler_would(dict(args.option))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    workload = Workload.load(args.workload)
    run = {"ours-offline": ours_offline, "ours-batch1": ours_batch1, "ours-structured": ours_structured,
           "hf": hf_generate, "peak": peak}[args.worker]
    result = run(args, workload)
    if result is not None:
        args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
