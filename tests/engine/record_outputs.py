"""Record a model's greedy outputs as exact bits, to prove a refactor of the model layer moved nothing.

Not a test (pytest does not collect it): run it on the revision before a change, save the JSON outside the
repository, run it again after the change with --compare, and every token and log-prob bit must match.

    PYTHONPATH=$PWD .venv/bin/python -m tests.engine.record_outputs /tmp/before.json
    PYTHONPATH=$PWD .venv/bin/python -m tests.engine.record_outputs /tmp/after.json --compare /tmp/before.json

Cases: the demo model (model/, kernel_backend=cpp) in fp32, bf16 and int8 at tensor_parallel_degree 1 and 3
(its 9 heads take no degree 2), and a tiny checkpoint with 6 heads (written once into --toy-dir, kept for the
second run) at degrees 1, 2 and 3; each runs a few prompts alone, then together with chunked prefill. Each
sequence records its greedy tokens, each chosen token's log-prob as float32 bits, and a digest of every
logit row it got.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

from lmi_handler.config import EngineConfig, ParallelConfig
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.parallel.launch import start_runner
from lmi_handler.engine.precision import Precision
from tests.engine.helpers import build_tiny_llama, greedy_generate

PRECISIONS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "int8": (torch.float32, "int8")}
DEMO_PROMPTS = [[1, 504, 3250, 314, 260, 1123, 28], list(range(100, 160)), [1, 42, 7, 9000, 17]]
TOY_PROMPTS = [[1, 17, 300, 45, 9], list(range(10, 50)), [1, 250, 599, 3]]


def build_toy(path: Path) -> Path:
    """A tiny Llama whose heads take degrees 2 and 3 (6 heads, 6 KV heads); written once, reused after."""
    if not (path / "config.json").is_file():
        build_tiny_llama(path, seed=7, tie_word_embeddings=False, intermediate_size=96, num_attention_heads=6,
                         num_key_value_heads=6, hidden_size=96, vocab_size=600)
    return path


def bits(x: float) -> str:
    return f"{torch.tensor([x], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF:08x}"


def record_run(runner, prompts: list[list[int]], n: int, chunks: list[int] | None) -> list[dict]:
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    tokens, logits = greedy_generate(runner, allocator, prompts, n, chunk_sizes=chunks)
    out = []
    for toks, rows in zip(tokens, logits):
        logprobs = [bits(float(row.float().log_softmax(-1)[t])) for t, row in zip(toks, rows)]
        digest = hashlib.sha256(b"".join(row.float().numpy().tobytes() for row in rows)).hexdigest()[:16]
        out.append({"tokens": toks, "logprobs": logprobs, "logits_sha": digest})
    return out


def record_case(model_dir: Path, precision: str, degree: int, prompts: list[list[int]], n: int) -> dict:
    dtype, quantize = PRECISIONS[precision]
    config = EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=8,
                          max_num_batched_tokens=256, max_model_len=None, block_size=16, kv_cache_bytes=64 << 20,
                          kernel_backend="cpp", parallel=ParallelConfig(degree, 60.0, None))
    runner = start_runner(config, torch.device("cpu"), Precision(dtype, quantize, "record_outputs"))
    try:
        alone = [record_run(runner, [p], n, None)[0] for p in prompts]
        batched = record_run(runner, prompts, n, [len(prompts[0])] + [16] * (len(prompts) - 1))
    finally:
        close = getattr(runner, "close", None)
        if close is not None:
            close()
    return {"alone": alone, "batched": batched, "backend": getattr(runner, "kernel_backend", None)}


def record(demo_dir: Path, toy_dir: Path, n: int) -> dict:
    result = {}
    for precision in PRECISIONS:
        for degree in (1, 3):
            result[f"demo/{precision}/tp{degree}"] = record_case(demo_dir, precision, degree, DEMO_PROMPTS, n)
            print(f"demo/{precision}/tp{degree}", file=sys.stderr, flush=True)
        for degree in (1, 2, 3):
            result[f"toy/{precision}/tp{degree}"] = record_case(toy_dir, precision, degree, TOY_PROMPTS, n)
            print(f"toy/{precision}/tp{degree}", file=sys.stderr, flush=True)
    return result


def compare(new: dict, old: dict) -> list[str]:
    """The cases whose recording differs (or is missing on one side), each with its first difference."""
    diffs = []
    for case in sorted(set(new) | set(old)):
        a, b = new.get(case), old.get(case)
        if a is None or b is None:
            diffs.append(f"{case}: only in {'old' if a is None else 'new'}")
            continue
        for part in ("alone", "batched"):
            for i, (x, y) in enumerate(zip(a[part], b[part])):
                for key in ("tokens", "logprobs", "logits_sha"):
                    if x[key] != y[key]:
                        diffs.append(f"{case} {part}[{i}] {key}: {x[key]} != {y[key]}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--demo-dir", type=Path, default=Path("model"))
    parser.add_argument("--toy-dir", type=Path, default=Path("/tmp/record_outputs_toy"))
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--compare", type=Path, help="an earlier recording: exit 1 when any bit differs")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    result = record(args.demo_dir, build_toy(args.toy_dir), args.new_tokens)
    args.out.write_text(json.dumps(result, indent=1))
    if args.compare is None:
        return 0
    diffs = compare(result, json.loads(args.compare.read_text()))
    cases = len(result)
    print(f"{cases} cases, {len(diffs)} differences" + "".join(f"\n  {d}" for d in diffs[:40]))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
