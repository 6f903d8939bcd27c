"""vLLM offline worker: runs inside benchmarks/.venv-vllm (vLLM's CPU build), never in the project's venv.

    .venv-vllm/bin/python benchmarks/vllm_worker.py --workload W.json --control-dir D --out R.json [--max-num-seqs 64 ...]
    .venv-vllm/bin/python benchmarks/vllm_worker.py --check --model model     # 8 greedy tokens, a set-up check

Long-lived (round_protocol.py): after the warm-up, each "run K" line on stdin sends all requests to
`vllm.LLM.generate` at once (the same prompt token ids as our engine, greedy, EOS ignored; the prefix
cache emptied first); "finish" runs one request alone through the engine's step loop for batch-1
decode tok/s, writes --out and exits.
Imports only vLLM, the standard library and the benchmark's plain-Python helpers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from preload import mapped_in  # noqa: E402
from round_protocol import serve, summarize  # noqa: E402
from stats import percentiles  # noqa: E402
from workload import Workload  # noqa: E402


def make_llm(model: str, args):
    from vllm import LLM

    return LLM(model=model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
               seed=0)


def greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def batch1_decode(llm, ids: list[int], max_tokens: int) -> dict:
    """Decode tok/s of one request alone: (tokens - 1) / (last token time - first token time).

    Steps the engine by hand (LLMEngine.add_request / step) to time each token; if this vLLM's
    engine API differs, falls back to (max_tokens - 1) / (t(max_tokens) - t(1)) with two generate() calls.
    """
    try:
        engine = llm.llm_engine
        engine.add_request("b1", {"prompt_token_ids": ids}, greedy(max_tokens))
        times, seen = [], 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                count = len(out.outputs[0].token_ids) if out.outputs else 0
                times.extend([now] * max(count - seen, 0))
                seen = max(seen, count)
        rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
        return {"output_tokens": len(times), "decode_tokens_per_s": rate,
                "method": "(tokens - 1) / (last token time - first token time), engine step loop"}
    except Exception as exc:  # noqa: BLE001 - an API difference must not lose the main result
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], greedy(1), use_tqdm=False)
        one = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], greedy(max_tokens), use_tqdm=False)
        full = time.perf_counter() - start
        return {"output_tokens": max_tokens, "decode_tokens_per_s": (max_tokens - 1) / (full - one),
                "method": f"(N - 1) / (t(N) - t(1)), two generate() calls (step loop failed: {exc!r})"}


def generate_round(llm, workload: Workload) -> dict:
    """All the workload's requests through one LLM.generate call, from an empty prefix cache."""
    prefix_cache_reset = bool(llm.reset_prefix_cache())  # round 2 must not find round 1's prompts cached
    prompts = [{"prompt_token_ids": ids} for ids in workload.prompt_token_ids]
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy(workload.max_new_tokens), use_tqdm=False)
    wall = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    tokens = sum(map(len, token_ids))
    ttft = []
    for o in outs:  # RequestOutput.metrics is optional (None in some vLLM versions)
        m = getattr(o, "metrics", None)
        first, arrival = getattr(m, "first_token_time", None), getattr(m, "arrival_time", None)
        if first and arrival:
            ttft.append(first - arrival)
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "ttft_s": percentiles(ttft), "itl_s": None, "prefix_cache_reset": prefix_cache_reset,
            "output_token_ids": token_ids}


def preload_seen() -> dict:
    """LD_PRELOAD as this worker got it, and whether each library is mapped in this process and in its
    children (vLLM's engine core runs in one), read from /proc/PID/maps."""
    paths = [Path(p) for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    try:
        import psutil

        children = [c.pid for c in psutil.Process().children(recursive=True)]
    except ImportError:
        children = []
    return {"ld_preload": os.environ.get("LD_PRELOAD", ""), "mapped": mapped_in(["self", *children], paths)}


def run(args) -> dict:
    import torch
    import vllm

    workload = Workload.load(args.workload)
    start = time.perf_counter()
    llm = make_llm(workload.model, args)
    startup_s = time.perf_counter() - start
    # warm-up, the same as our engine's
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in workload.warmup().prompt_token_ids], greedy(2), use_tqdm=False)
    warmup_s = time.perf_counter() - start
    rounds = serve(args.control_dir, {"startup_s": startup_s, "warmup_s": warmup_s},
                   lambda k: generate_round(llm, workload))
    return {"engine": "vllm", "vllm_version": vllm.__version__, "torch": torch.__version__,
            "torch_num_threads": torch.get_num_threads(), "startup_s": startup_s, "warmup_s": warmup_s,
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"), "preload": preload_seen(),
            **summarize(rounds),
            "batch1": batch1_decode(llm, workload.prompt_token_ids[0], workload.max_new_tokens)}


def check(args) -> int:
    """Generate 8 greedy tokens from one short chat prompt; print them. Exit code 0 when 8 came back."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                     tokenize=False)
    args.max_model_len = args.max_model_len or 1024
    start = time.perf_counter()
    llm = make_llm(args.model, args)
    out = llm.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0]
    print(json.dumps({"ok": len(out.token_ids) == 8, "text": out.text, "token_ids": list(out.token_ids),
                      "seconds": time.perf_counter() - start, "preload": preload_seen()}))
    return 0 if len(out.token_ids) == 8 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--control-dir", type=Path, help="where ready.json and round-K.json go")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--model", default="model", help="model directory (--check)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args(argv)
    if args.check:
        return check(args)
    if not (args.workload and args.out and args.control_dir):
        parser.error("--workload, --control-dir and --out are needed (or --check)")
    args.out.write_text(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
