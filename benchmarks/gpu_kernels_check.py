"""The Triton backend's kernels on a GPU: their tests compiled (not interpreted), then paged attention and the
linear timed against torch on the demo model's shapes (SmolLM2-135M: hidden 576, 9 heads over 3 KV heads of 64,
MLP 1536, vocab 49152), bf16, and the LoRA term (4 adapters of rank 16) against lora.py's torch product.

    python benchmarks/gpu_kernels_check.py                 # on a CUDA machine, from the repo root
    python benchmarks/gpu_kernels_check.py --out DIR       # where gpu-kernels-<UTC date>.json goes ($OUT or
                                                           # benchmarks/results by default)
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels_check.py --smoke   # CPU: tiny shapes, checks the script
    python benchmarks/gpu_kernels_check.py --summary DIR --kernels-json K --bench-json B [--bench-eager-json E]
        --rc NAME=CODE ...
        # gpu_check.sh's last word: DIR/gpu-<UTC date>.json from this script's JSON, bench.py's JSON and the
        # steps' exit codes, with the GPU's read bandwidth measured here (--smoke: on CPU, a small buffer)

Exit status: 0 when the tests passed, 1 when one failed, 2 when there is no GPU (without --smoke); --summary:
0 once the JSON is written.
The torch peers: attention_per_sequence (one SDPA call per sequence: today's batch-invariant CUDA path) and
attention_padded (one padded SDPA call with a mask: today's fast path) from engine/model/attention.py;
torch.nn.functional.linear (cuBLAS, which may split K) for the linears.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTER, VOCAB = 576, 9, 3, 64, 1536, 49152
LINEARS = {"qkv": (HIDDEN, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM), "o": (HIDDEN, HIDDEN),
           "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN), "lm_head": (HIDDEN, VOCAB)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results"),
                        help="folder for gpu-kernels-<UTC date>.json")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, any device (CPU under TRITON_INTERPRET=1): checks the script, not speed")
    parser.add_argument("--skip-tests", action="store_true", help="time only")
    parser.add_argument("--tests-timeout-s", type=int, default=240, help="limit for the kernel tests")
    parser.add_argument("--summary", type=Path, metavar="DIR", help="write DIR/gpu-<UTC date>.json (gpu_check.sh)")
    parser.add_argument("--kernels-json", default="", help="with --summary: this script's gpu-kernels-*.json")
    parser.add_argument("--bench-json", default="", help="with --summary: bench.py's bench-*.json")
    parser.add_argument("--bench-eager-json", default="",
                        help="with --summary: bench.py's bench-*.json of the option.enforce_eager=true run")
    parser.add_argument("--rc", action="append", default=[], metavar="NAME=CODE",
                        help="with --summary: a gpu_check.sh step's exit code")
    return parser.parse_args(argv)


def run_tests(timeout_s: int) -> dict:
    """tests/engine/triton on the GPU: the kernels compiled, bf16 included (the interpreter turned off)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
                               "tests/engine/triton"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = 124, f"timed out after {timeout_s} s\n{(exc.stdout or '')[-3000:]}"
    print(tail)
    return {"rc": rc, "passed": rc == 0, "seconds": round(time.perf_counter() - start, 1)}


def time_us(fn, *args) -> float:
    """Median microseconds of one call fn(*args): CUDA events around batches of calls after a warm-up (one timed
    call in --smoke on CPU)."""
    import torch
    fn(*args)
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        start = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    for _ in range(5):
        fn(*args)
    samples = []
    for _ in range(7):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(20):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3 / 20)
    return sorted(samples)[len(samples) // 2]


def attention_case(num_seqs: int, context_len: int, query_len: int, dtype, device, block_size: int = 16):
    """q, caches and metadata for num_seqs sequences each with query_len new rows ending at context_len."""
    import torch

    from lmi_handler.engine.model.attention import AttentionMetadata
    blocks_per_seq = -(-context_len // block_size)
    k_cache = torch.randn(num_seqs * blocks_per_seq, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_seqs * blocks_per_seq, device=device).reshape(num_seqs, blocks_per_seq).int()
    positions = torch.arange(context_len - query_len, context_len, device=device)
    slots = (tables.long()[:, positions // block_size] * block_size + positions % block_size).reshape(-1)
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=tables,
        context_lens=torch.full((num_seqs,), context_len, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(0, (num_seqs + 1) * query_len, query_len, dtype=torch.int32, device=device),
        query_lens=[query_len] * num_seqs, context_lens_host=[context_len] * num_seqs, block_size=block_size)
    q = torch.randn(num_seqs * query_len, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    return q, k_cache, v_cache, meta


def time_kernels(smoke: bool, device) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from lmi_handler.engine.model import attention as torch_attention
    from lmi_handler.engine.model.backends import triton as tb
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    # decode: 64 sequences at about the workload's length (a 170-token prompt + 128 tokens); a prefill step
    attention_cases = [("decode", 4, 40, 1), ("prefill", 2, 48, 48)] if smoke else \
        [("decode", 1, 300, 1), ("decode", 64, 300, 1), ("decode", 64, 1200, 1), ("prefill", 8, 256, 256)]
    for kind, num_seqs, context_len, query_len in attention_cases:
        case = (*attention_case(num_seqs, context_len, query_len, dtype, device), HEAD_DIM ** -0.5)
        diff = (tb.paged_attention(*case).float() - torch_attention.attention_per_sequence(*case).float()).abs()
        row = {"op": "paged_attention", "kind": kind, "num_seqs": num_seqs, "context_len": context_len,
               "query_len": query_len, "triton_us": time_us(tb.paged_attention, *case),
               "torch_per_sequence_us": time_us(torch_attention.attention_per_sequence, *case),
               "torch_padded_us": time_us(torch_attention.attention_padded, *case),
               "max_abs_diff_vs_torch": diff.max().item()}
        rows.append(row)
        print(json.dumps(row))
    for name, (k, n) in LINEARS.items():
        if smoke and name != "qkv":
            continue
        for num_rows in ([1, 8] if smoke else [1, 64, 2048]):
            x = torch.randn(num_rows, k, dtype=dtype, device=device)
            weight = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
            diff = (tb.linear(x, weight).float() - F.linear(x, weight).float()).abs()
            row = {"op": "linear", "name": name, "rows": num_rows, "k": k, "n": n,
                   "triton_us": time_us(tb.linear, x, weight), "torch_us": time_us(F.linear, x, weight),
                   "max_abs_diff_vs_torch": diff.max().item()}
            rows.append(row)
            print(json.dumps(row))
    rows += time_lora(smoke, device, dtype)
    return rows


def torch_lora_add(y, x, row_slot, a_stack, b_stack, scale, layout):
    """The torch path's LoRA step: y + lora.py's tiled product."""
    from lmi_handler.engine.model.lora import lora_delta
    return y + lora_delta(x, row_slot, a_stack, b_stack, scale, layout)


def time_lora(smoke: bool, device, dtype) -> list[dict]:
    """The LoRA term (issue 41) on the demo's widest and narrowest-output projections: 4 adapters of rank 16, 64
    decode rows on adapter i % 4 and a 2048-row prefill of 4 adapters' runs; the Triton kernel (added in place)
    against lora.py's tiled bmm (its tile layout made once, as once per step in the engine)."""
    import torch

    from lmi_handler.engine.model.backends import triton as tb
    from lmi_handler.engine.model.lora import lora_delta, tile_layout
    rows = []
    for name in (("qkv",) if smoke else ("gate_up", "down")):
        k, n = LINEARS[name]
        a = torch.randn(4, 16, k, device=device) / k ** 0.5
        b, scale = torch.randn(4, n, 16, device=device) / 4, torch.full((4,), 2.0, device=device)
        stack = tb.lora_stack(a, b)          # once per adapter set, as LoraBatch.backend_stacks
        for kind, num_rows in ([("decode", 8)] if smoke else [("decode", 64), ("prefill", 2048)]):
            order = torch.arange(num_rows, device=device)
            row_slot = order % 4 if kind == "decode" else order * 4 // num_rows
            x = torch.randn(num_rows, k, dtype=dtype, device=device)
            y, layout = torch.zeros(num_rows, n, dtype=dtype, device=device), tile_layout(row_slot)
            delta = lora_delta(x, row_slot, a, b, scale, layout)
            diff = (tb.lora_add(torch.zeros_like(y), x, row_slot, stack, scale).float() - delta.float()).abs()
            row = {"op": "lora", "name": name, "kind": kind, "rows": num_rows, "k": k, "n": n, "rank": 16,
                   "adapters": 4, "triton_us": time_us(tb.lora_add, y, x, row_slot, stack, scale),
                   "torch_us": time_us(torch_lora_add, y, x, row_slot, a, b, scale, layout),
                   "max_abs_diff_vs_torch": diff.max().item()}
            rows.append(row)
            print(json.dumps(row))
    return rows


def read_bandwidth_gb_s(device, smoke: bool) -> float:
    """The device's read bandwidth: the best of 10 sums over a 2 GiB float32 buffer (64 MiB in --smoke), in GB/s."""
    import torch
    x = torch.ones((64 if smoke else 2048) << 18, dtype=torch.float32, device=device)
    return x.numel() * x.element_size() / time_us(torch.sum, x) / 1e3


def load_json(path: str) -> dict:
    return json.loads(Path(path).read_text()) if path and Path(path).is_file() else {}


def lora_rates(log: Path) -> dict:
    """gpu_check.sh's LoRA row (benchmarks/ab.py lora's last line, appended to gpu-bench.log): 64 requests over 4
    adapters against the same 64 on the base, output tok/s; None where it did not run."""
    found = re.findall(r"base ([\d.]+) tok/s, lora ([\d.]+) tok/s, lora / base ([\d.]+)",
                       log.read_text(errors="replace") if log.is_file() else "")
    base, lora, ratio = (float(v) for v in found[-1]) if found else (None, None, None)
    return {"lora_base_tok_s": base, "lora_tok_s": lora, "lora_vs_base": ratio}


def summary(args: argparse.Namespace, device, device_name: str) -> dict:
    """issue 38's record of a GPU check: the throughputs from bench.py's phases (None where a phase did not
    run), the read bandwidth measured now, and invariance_bitwise: the Triton tests and gpu_check.sh's
    invariance tests all passed."""
    kernels, bench = load_json(args.kernels_json), load_json(args.bench_json)
    eager_phases = load_json(args.bench_eager_json).get("phases") or {}
    rcs = {name: int(code) for name, _, code in (item.partition("=") for item in args.rc) if code.lstrip("-").isdigit()}
    phases = bench.get("phases") or {}

    def rate(phase: str, key: str = "output_tokens_per_s", source: dict | None = None):
        value = ((phases if source is None else source).get(phase) or {}).get(key)
        return round(value, 1) if isinstance(value, (int, float)) else None

    record = {"device": device_name,
              "offline_tok_s_invariant": rate("ours_offline_bf16"),
              "offline_tok_s_eager": rate("ours_offline_bf16", source=eager_phases),
              "batch1_tok_s": rate("ours_batch1_bf16", "decode_tokens_per_s"),
              "hf_tok_s": rate("hf"),
              "bandwidth_gb_s": round(read_bandwidth_gb_s(device, args.smoke), 1),
              "invariance_bitwise": bool((kernels.get("tests") or {}).get("passed")) and rcs.get("invariance") == 0}
    flops = (phases.get("peak_start") or {}).get("peak_flops_per_s")
    record.update(lora_rates(args.summary / "gpu-bench.log"))
    record.update({
        "kernel_backend": "triton",
        "offline_vs_hf": (round(record["offline_tok_s_invariant"] / record["hf_tok_s"], 2)
                          if record["offline_tok_s_invariant"] and record["hf_tok_s"] else None),
        "graphs_vs_eager": (round(record["offline_tok_s_invariant"] / record["offline_tok_s_eager"], 2)
                            if record["offline_tok_s_invariant"] and record["offline_tok_s_eager"] else None),
        "matmul_bf16_tflop_s": round(flops / 1e12, 1) if flops else None,
        "workload": bench.get("workload", {}).get("num_prompts"), "max_new_tokens":
            bench.get("workload", {}).get("max_new_tokens"),
        "exit_codes": rcs, "kernels_json": Path(args.kernels_json).name if args.kernels_json else None,
        "bench_json": Path(args.bench_json).name if args.bench_json else None,
        "cuda_graphs": "offline_tok_s_invariant and batch1_tok_s: decode steps as CUDA graphs (the default); "
                       "offline_tok_s_eager: option.enforce_eager=true"})
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not on_gpu and not args.smoke:
        print("gpu_kernels_check: no CUDA device (or TRITON_INTERPRET=1 set): nothing to check; --smoke runs the "
              "script on tiny shapes under the interpreter")
        return 2
    device = torch.device("cuda" if on_gpu else "cpu")
    device_name = torch.cuda.get_device_name(0) if on_gpu else "cpu (interpreter)"
    stamp = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H%M%SZ}"
    if args.summary:
        record = summary(args, device, device_name)
        args.summary.mkdir(parents=True, exist_ok=True)
        path = args.summary / f"gpu-{stamp}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record, indent=1))
        print(f"gpu_kernels_check: wrote {path}")
        return 0
    import triton
    result = {"device": device_name, "torch": torch.__version__,
              "triton": triton.__version__, "smoke": args.smoke}
    if not args.skip_tests:
        result["tests"] = run_tests(args.tests_timeout_s)
    result["timings"] = time_kernels(args.smoke, device)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-kernels-{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"gpu_kernels_check: tests {'skipped' if args.skip_tests else result['tests']}; wrote {path}")
    return 0 if args.skip_tests or result["tests"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
