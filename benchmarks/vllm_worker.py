"""vLLM offline worker: runs inside benchmarks/.venv-vllm (vLLM's CPU build), never in the project's venv.

    .venv-vllm/bin/python benchmarks/vllm_worker.py --workload W.json --control-dir D --out R.json [--max-num-seqs 64 ...]
    .venv-vllm/bin/python benchmarks/vllm_worker.py --workload W.json --schemas S.json ...   # structured output
    .venv-vllm/bin/python benchmarks/vllm_worker.py --check --model model     # 8 greedy tokens, a set-up check

Long-lived (round_protocol.py): after the warm-up, each "run K" line on stdin sends all requests to
`vllm.LLM.generate` at once (the same prompt token ids as our engine, greedy, EOS ignored; the prefix
cache emptied first); "finish" runs one request alone through the engine's step loop for batch-1
decode tok/s, writes --out and exits. With --schemas (structured.py), each round runs the prompts with
their JSON schemas (SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)), vLLM's default
backend: "auto") and without, EOS honoured, instead; "finish" then just writes --out.
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
from peers import mapped_in  # noqa: E402
from round_protocol import percentiles, serve, summarize  # noqa: E402
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


def start_llm(workload: Workload, args):
    """The LLM, its start-up seconds and its warm-up seconds (the same warm-up as our engine's)."""
    start = time.perf_counter()
    llm = make_llm(workload.model, args)
    startup_s = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in workload.warmup().prompt_token_ids], greedy(2), use_tqdm=False)
    return llm, startup_s, time.perf_counter() - start


def run(args) -> dict:
    import torch
    import vllm

    workload = Workload.load(args.workload)
    llm, startup_s, warmup_s = start_llm(workload, args)
    rounds = serve(args.control_dir, {"startup_s": startup_s, "warmup_s": warmup_s},
                   lambda k: generate_round(llm, workload))
    return {"engine": "vllm", "vllm_version": vllm.__version__, "torch": torch.__version__,
            "torch_num_threads": torch.get_num_threads(), "startup_s": startup_s, "warmup_s": warmup_s,
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"), "preload": preload_seen(),
            **summarize(rounds),
            "batch1": batch1_decode(llm, workload.prompt_token_ids[0], workload.max_new_tokens)}


def structured_params(max_tokens: int, schema: dict | None):
    """Greedy, EOS honoured; with `schema`, constrained to it through vLLM's default backend."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = None if schema is None else StructuredOutputsParams(json=schema)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)


def structured_run(llm, ids: list[list[int]], params: list) -> dict:
    """One LLM.generate over these prompts, from an empty prefix cache; structured.run_figures plus each
    output's token ids, text and whether it ended on a stop (vLLM: eos after the grammar's end)."""
    from structured import run_figures

    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    wall = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    return {**run_figures(wall, list(map(len, token_ids))), "output_token_ids": token_ids,
            "texts": [o.outputs[0].text for o in outs],
            "finished_on_grammar": [o.outputs[0].finish_reason == "stop" for o in outs]}


def backends_used(params: list) -> dict:
    """{backend: requests} as vLLM resolved each request's structured_outputs (its `_backend`, set when the
    request was validated; "auto" picks xgrammar and falls back to guidance or outlines per schema)."""
    counts: dict[str, int] = {}
    for p in params:
        so = p.structured_outputs
        name = (getattr(so, "_backend", None) or "unresolved") if so is not None else "none"
        counts[name] = counts.get(name, 0) + 1
    return counts


def run_structured(args) -> dict:
    import torch
    import vllm
    from structured import compile_record, structured_round

    workload = Workload.load(args.workload)
    schemas = json.loads(args.schemas.read_text())
    llm, startup_s, warmup_s = start_llm(workload, args)
    ids, n = workload.prompt_token_ids, workload.max_new_tokens
    specs = [structured_params(n, s) for s in schemas]
    one_plain = structured_run(llm, ids[:1], [structured_params(1, None)])["wall_s"]
    one_cold = structured_run(llm, ids[:1], [structured_params(1, schemas[0])])["wall_s"]
    all_plain = structured_run(llm, ids, [structured_params(2, None)] * len(ids))["wall_s"]
    warm = [structured_params(2, s) for s in schemas]
    all_cold = structured_run(llm, ids, warm)["wall_s"]
    compiles = compile_record(one_cold, one_plain, all_cold, all_plain,
                              "as ours: one 1-token request with the first schema minus the same unconstrained, "
                              "then all requests at 2 tokens with their schemas minus the same unconstrained "
                              "(vLLM's grammar compiler caches compiled schemas)")

    def run(mode: str, lengths: list[int] | None) -> dict:
        from vllm import SamplingParams

        params = {"constrained": lambda: specs, "unconstrained": lambda: [structured_params(n, None)] * len(ids),
                  "length_matched": lambda: [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                                             for m in lengths]}
        return structured_run(llm, ids, params[mode]())

    rounds = serve(args.control_dir, {"startup_s": startup_s, "warmup_s": warmup_s,
                                      "first_compile_s": compiles["first_compile_s"]},
                   lambda k: structured_round(k, run, schemas))
    config = getattr(llm.llm_engine.vllm_config, "structured_outputs_config", None)
    return {"engine": "vllm", "vllm_version": vllm.__version__, "torch": torch.__version__,
            "torch_num_threads": torch.get_num_threads(), "startup_s": startup_s, "warmup_s": warmup_s,
            "structured_outputs_backend_configured": getattr(config, "backend", None),
            "structured_outputs_backend_used": backends_used(specs + warm),
            "grammar_backend": grammar_versions(), "compile": compiles,
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "preload": preload_seen(),
            **summarize(rounds)}


def grammar_versions() -> dict:
    """The installed versions of the libraries vLLM's backends use (importlib.metadata; None: not installed)."""
    from importlib import metadata

    out = {}
    for dist in ("xgrammar", "llguidance", "outlines_core"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


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
    parser.add_argument("--schemas", type=Path, help="the structured-output phase: a JSON list, one schema per prompt")
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
    args.out.write_text(json.dumps(run_structured(args) if args.schemas else run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
