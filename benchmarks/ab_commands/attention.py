"""`ab.py attention`: the paged-attention kernel: bitwise check on small cases, then a decode step's 30 layer calls.

A command of benchmarks/ab.py, which calls attention_main; `ab.py attention --help` prints ATTENTION_DOC.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from ab_commands.revision import old_kernels

from lmi_handler.engine.model.kernels import cpu_kernels
from lmi_handler.engine.model.kernels.build import empty_huge

ATTENTION_DOC = """Interleaved A/B of the paged-attention kernel: this checkout's C++ kernels against another revision's,
in one process (old_kernels builds the old sources as an extension of their own).

First checks that both give bitwise the same output on small random cases (bf16 and fp32, decode and
prefill rows, head dims 16-64, GQA and MHA, contexts not a multiple of the block size); then times one
decode step's 30 layer calls on the demo model's shapes (64 decode rows, 9 query / 3 KV heads of 64,
16-token blocks, contexts 112-240 keys, each layer's blocks scattered over a cache of its own twice the
size needed, in huge-page memory), old and new alternating, `--rounds` rounds of 4 steps each. Prints the
medians (ms a layer call), the K/V bytes read per second, and old/new.

The 30 layers matter: one layer's K/V (17 MB in float32) fits this host's 32 MiB L3, so repeating one
layer's call measures the L3, not the memory stream a real step reads (the first version of this script
did that: 0.3 ms a call against 0.67 in the engine's step).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py attention --old-rev HEAD [--threads 2]
"""

ATTENTION_CHECKS = [(7, 9, 3, 64, 16, 1, 70, 1), (5, 4, 2, 32, 16, 20, 40, 5), (3, 8, 8, 64, 16, 33, 90, 17),
          (4, 6, 2, 48, 4, 3, 30, 2), (2, 4, 1, 16, 16, 1, 3, 1)]


ATTENTION_LAYERS, ATTENTION_STEPS = 30, 4   # the demo model's layers; steps timed per round


def attention_case(g, dtype, seqs, heads, kv_heads, head_dim, block, ctx_lo, ctx_hi, query_rows, pool=2):
    """paged_attention's arguments: random q and caches, block tables drawn from `pool` x the blocks needed."""
    ctx = torch.randint(max(ctx_lo, query_rows), ctx_hi, (seqs,), generator=g, dtype=torch.int32)
    max_blocks = (int(ctx.max()) + block - 1) // block
    num_blocks = seqs * max_blocks * pool
    caches = []
    for _ in range(2):
        cache = empty_huge(num_blocks, block, kv_heads, head_dim, dtype=dtype)
        cache.copy_(torch.randn(num_blocks, block, kv_heads, head_dim, generator=g))
        caches.append(cache)
    tables = torch.randperm(num_blocks, generator=g)[: seqs * max_blocks].to(torch.int32).view(seqs, max_blocks)
    cu = torch.arange(seqs + 1, dtype=torch.int32) * query_rows
    q = (3 * torch.randn(seqs * query_rows, heads, head_dim, generator=g)).to(dtype)
    return q, caches[0], caches[1], tables.contiguous(), ctx, cu, head_dim ** -0.5


def attention_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=ATTENTION_DOC.splitlines()[0])
    p.add_argument("--old-rev", default="HEAD")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    new, old = cpu_kernels(), old_kernels(args.old_rev)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ATTENTION_CHECKS:
            inputs = attention_case(g, dtype, *shape)
            if not torch.equal(old.paged_attention(*inputs), new.paged_attention(*inputs)):
                raise SystemExit(f"{dtype} {shape}: the two builds differ")
    print(f"bitwise equal: {args.old_rev} and this checkout on {2 * len(ATTENTION_CHECKS)} cases")
    for dtype in (torch.bfloat16, torch.float32):
        layers = [attention_case(g, dtype, 64, 9, 3, 64, 16, 112, 240, 1, pool=2) for _ in range(ATTENTION_LAYERS)]
        kv_bytes = sum(int(inputs[4].sum()) * 2 * inputs[1].stride(1) * inputs[1].element_size() for inputs in layers)
        times = {"old": [], "new": []}
        for r in range(args.rounds):
            order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
            for name, module in order:
                for inputs in layers:
                    module.paged_attention(*inputs)
                start = time.perf_counter()
                for _ in range(ATTENTION_STEPS):
                    for inputs in layers:
                        module.paged_attention(*inputs)
                times[name].append((time.perf_counter() - start) / ATTENTION_STEPS)
        old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"{dtype}, {args.threads} threads: old {old_s / ATTENTION_LAYERS * 1e3:.3f} ms, new {new_s / ATTENTION_LAYERS * 1e3:.3f} ms "
              f"a call ({kv_bytes / old_s / 1e9:.1f} / {kv_bytes / new_s / 1e9:.1f} GB/s of K/V), old/new "
              f"{old_s / new_s:.2f}")
