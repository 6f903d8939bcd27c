"""`ab.py prefill`: one step's forward: the fused decoder stack against the same C++ ops called one by one.

A command of benchmarks/ab.py, which calls prefill_main; `ab.py prefill --help` prints PREFILL_DOC.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from workload import REPO, bench_engine, build_workload

PREFILL_DOC = """Interleaved A/B of one step's forward: the fused decoder stack against the same C++ ops called one by one.

The fused stack is kernels' DecoderStack, one C++ call (the gate_up linear with silu * up in its store, each
layer's residual add in the next norm); the other side is forward.DecoderModel's walk (`stack` None), the same
C++ ops called one by one from Python (the gate_up linear, then silu_mul). One process, one engine, the two alternating, the order
flipping each round. Both give the same bits (after the rounds, the first round's logits of each are compared
with torch.equal).

The step is the benchmark's first (workload.build_workload: 64 MT-bench prompts, the engine's 2048-token
budget: a prefill of 1882 tokens from 24 prompts), or with `--decode-steps N` a decode step of the 64
sequences after the 4 prefill steps and N decode steps. Prints the median ms of each and fused / split. The
split path also pays ~30 x 9 Python calls a step (~0.1-0.3 ms), so at a decode step the difference is within
that.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py prefill [--dtype fp32] [--rounds 6] [--decode-steps 0]
"""

def prefill_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=PREFILL_DOC.splitlines()[0])
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the engine's dtype (activations, KV cache)")
    p.add_argument("--threads", type=int, default=2, help="torch / kernel threads")
    p.add_argument("--rounds", type=int, default=6, help="rounds, each times the fused and the split forward once")
    p.add_argument("--decode-steps", type=int, default=0,
                   help="0: time the first (prefill) step; N: a decode step after the 4 prefill and N decode steps")
    args = p.parse_args(argv)

    from lmi_handler.engine.sequence import SamplingParams

    engine = bench_engine(str(REPO / "model"), args.dtype, args.threads)
    work = build_workload(REPO / "model", 64, 128)
    params = SamplingParams(greedy=True, max_new_tokens=128, ignore_eos=True)
    for i, ids in enumerate(work.prompt_token_ids):
        engine.add_request(f"r{i}", ids, params, seed=0)
    steps = 4 + args.decode_steps if args.decode_steps else 0     # the 4 prefill steps, then N decode steps
    for _ in range(steps):
        engine.step()
    sched = engine.scheduler.schedule()
    model_input = engine.runner.prepare(sched)
    model = engine.runner.model
    stack = model.stack
    print(f"{args.dtype}, {args.threads} threads: a step of {sum(sched.num_scheduled_tokens)} tokens "
          f"({len(sched.seqs)} sequences)")
    times: dict[str, list[float]] = {"fused": [], "split": []}
    logits = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            for name in (("fused", "split") if r % 2 == 0 else ("split", "fused")):
                model.stack = stack if name == "fused" else None
                start = time.perf_counter()
                out = engine.runner.execute(model_input)        # rewrites the same K/V slots each time
                times[name].append(time.perf_counter() - start)
                logits.setdefault(name, out.logits)
    model.stack = stack
    assert torch.equal(logits["fused"], logits["split"]), "the fused stack and the split ops differ"
    fused, split = (statistics.median(times[k]) for k in ("fused", "split"))
    print(f"fused {fused * 1e3:.1f} ms, split {split * 1e3:.1f} ms: fused / split {fused / split:.3f} "
          f"(per round {', '.join(f'{a / b:.3f}' for a, b in zip(times['fused'], times['split']))}; same logits)")
