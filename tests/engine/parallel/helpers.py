"""A small tensor-parallel model for the tests of the TP machinery (engine/parallel/): real shards of a tiny
Llama checkpoint, run through the group's collectives by real processes.

Per step: vocabulary-parallel embedding (each rank looks up the ids it holds; gather_rows picks the
owner's row), layer 0's MLP (gate/up column-parallel, down_proj row-parallel + the fixed-order
all-reduce), the final norm, vocabulary-parallel lm_head (logits gathered to rank 0). Weights are read
shard by shard from safetensors slices (layout.take). No attention or KV cache: those are the model's.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open

from lmi_handler.engine.model.attention import AttentionMetadata
from lmi_handler.engine.model.linear import invariant_linear
from lmi_handler.engine.model.loader import read_config, spec_from_config
from lmi_handler.engine.model_runner import ModelInput, ModelOutput
from lmi_handler.engine.parallel.executor import RankContext
from lmi_handler.engine.parallel.group import LOOPBACK, Rendezvous, TPGroup, open_store
from lmi_handler.engine.parallel.layout import ShardLayout, check_degree, shard_of, take
from tests.engine.helpers import build_tiny_llama

CPU = torch.device("cpu")

FAULT_TOKEN = 511   # a step holding this token id triggers the spec's fault on its rank


def build_toy_checkpoint(path) -> str:
    """A tiny Llama whose shape takes degrees 2 and 3 (6 heads, 6 KV heads, intermediate 96, vocabulary 600)."""
    build_tiny_llama(path, tie_word_embeddings=False, intermediate_size=96, num_attention_heads=6,
                     num_key_value_heads=6, hidden_size=96, vocab_size=600)
    return str(path)


@dataclass(frozen=True)
class ToySpec:
    """RunnerSpec of the toy. fault: (rank, kind) with kind raise | exit | hang, when a step holds
    FAULT_TOKEN; fail_build_rank: that rank raises while loading its shard."""

    model_dir: str
    fault: tuple[int, str] | None = None
    fail_build_rank: int | None = None

    def check(self, degree: int, device: torch.device = CPU) -> None:
        check_degree(spec_from_config(read_config(self.model_dir)), degree)

    def num_blocks_fit(self, rank: int, degree: int) -> int:
        return 100 + 7 * rank          # ranks differ: the engine must take the minimum (100)

    def build(self, context: RankContext, num_blocks: int) -> "ToyRunner":
        if context.rank == self.fail_build_rank:
            raise MemoryError(f"toy shard of rank {context.rank} does not fit")
        return ToyRunner(self, context, num_blocks)


class ToyRunner:
    def __init__(self, spec: ToySpec, context: RankContext, num_blocks: int):
        self.spec, self.rank, self.group = spec, context.rank, context.group
        self.args = spec_from_config(read_config(spec.model_dir))
        self.layout = ShardLayout.of(self.args, context.rank, context.degree)
        self.num_blocks, self.block_size, self.device = num_blocks, 4, context.device
        self.digests: list[list[int]] = []     # rank 0: every rank's digest of each step's all-reduce output
        p = "model.layers.0."
        with safe_open(os.path.join(spec.model_dir, "model.safetensors"), framework="pt") as f:
            def get(name):
                return take(f.get_slice(name), shard_of(name, self.layout))
            self.embed = get("model.embed_tokens.weight")                                    # (V / d, hidden)
            self.lm_head = get("lm_head.weight")
            self.norm_in, self.norm_out = get(p + "post_attention_layernorm.weight"), get("model.norm.weight")
            self.gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            self.down = get(p + "mlp.down_proj.weight")                                        # (hidden, I / d)

    def execute(self, mi: ModelInput) -> ModelOutput | None:
        self._maybe_fault(mi)
        ids, (v0, v1), eps = mi.input_ids, self.layout.vocab, self.args.norm_eps
        mine = (ids >= v0) & (ids < v1)
        rows = self.embed[torch.where(mine, ids - v0, 0)]                                    # (T, hidden)
        x = self.group.gather_rows(rows, ids // self.layout.vocab_size)
        gate, up = invariant_linear(_rms(x, self.norm_in, eps), self.gate_up).chunk(2, dim=-1)
        y = x + self.group.all_reduce(invariant_linear(F.silu(gate) * up, self.down))
        self._record_digest(y)
        local = invariant_linear(_rms(y[mi.logit_rows], self.norm_out, eps), self.lm_head)
        logits = self.group.gather_last_dim(local)                                           # (R, V) on rank 0
        return None if logits is None else ModelOutput(logits=logits[mi.num_chunk_rows:], chunk_logits={})

    def _record_digest(self, y: torch.Tensor) -> None:
        digest = torch.tensor([int(y.view(torch.int32).to(torch.int64).sum())])   # sync: a test probe
        every = self.group.all_gather(digest)
        if self.rank == 0:
            self.digests.append([int(d) for d in every])

    def _maybe_fault(self, mi: ModelInput) -> None:
        if self.spec.fault is None or self.spec.fault[0] != self.rank or not bool((mi.input_ids == FAULT_TOKEN).any()):
            return
        kind = self.spec.fault[1]
        if kind == "raise":
            raise RuntimeError(f"toy fault on rank {self.rank}")
        if kind == "exit":
            os._exit(3)
        time.sleep(3600)   # hang


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def single_rank(spec: ToySpec) -> ToyRunner:
    """The toy at degree 1 (no processes): the reference the sharded runs are compared with."""
    return spec.build(RankContext(0, 1, torch.device("cpu"), TPGroup(0, 1, torch.device("cpu"))), 100)


def toy_input(prompts: list[list[int]]) -> ModelInput:
    """A prefill step of `prompts` as a ModelInput (logits at each prompt's last token; fake block tables)."""
    counts = [len(p) for p in prompts]
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    positions = torch.cat([torch.arange(n) for n in counts])
    attn = AttentionMetadata(slot_mapping=positions.clone(), block_tables=torch.zeros(len(prompts), 1, dtype=torch.int32),
                             context_lens=torch.tensor(counts, dtype=torch.int32),
                             cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), query_lens=counts,
                             context_lens_host=counts, block_size=4)
    return ModelInput(input_ids=torch.tensor([t for p in prompts for t in p]), positions=positions, attn=attn,
                      logit_rows=torch.tensor(cu[1:]) - 1, num_chunk_rows=0, chunk_spans={})


def run_ranks(degree: int, fn, timeout_s: float = 20.0) -> list:
    """fn(group) on every rank of a fresh group (one thread per rank); returns each rank's result."""
    rendezvous = Rendezvous(LOOPBACK, 0, degree, timeout_s, 60.0)
    master = open_store(rendezvous, 0)
    rendezvous = Rendezvous(LOOPBACK, master.port, degree, timeout_s, 60.0)
    stores = [master] + [open_store(rendezvous, r) for r in range(1, degree)]
    barrier = threading.Barrier(degree)

    def rank(r: int):
        group = TPGroup.join(stores[r], r, degree, torch.device("cpu"), timeout_s)
        barrier.wait()
        return fn(group)

    with ThreadPoolExecutor(degree) as pool:
        return [f.result(timeout=120) for f in [pool.submit(rank, r) for r in range(degree)]]


class Broadcasting:
    """Rank 0's runner that sends each step to the other ranks first (TensorParallelExecutor's step, with
    the ranks as threads)."""

    def __init__(self, runner, group: TPGroup):
        self.runner, self.group = runner, group
        self.block_size = runner.block_size

    def prepare(self, sched):
        return self.runner.prepare(sched)

    def execute(self, model_input):
        self.group.broadcast(model_input)
        return self.runner.execute(model_input)


def sharded_greedy(model_dir, degree: int, prompts: list[list[int]], n: int, dtype=torch.float32,
                   quantize: str | None = None, num_blocks: int = 64, block_size: int = 4,
                   kernel_backend: str = "auto"):
    """greedy_generate (tests/engine/helpers.py) over `degree` real shards of the checkpoint, each a
    ModelRunner(layout, group) on a thread of this process, joined by gloo on the loopback; rank 0 decodes
    and broadcasts every step (`kernel_backend`: every rank's). Returns rank 0's (tokens, per-step logits)."""
    from lmi_handler.engine.kv_cache import BlockAllocator
    from lmi_handler.engine.model_runner import ModelRunner
    from tests.engine.helpers import greedy_generate

    spec = spec_from_config(read_config(model_dir))

    def rank(group: TPGroup):
        layout = ShardLayout.of(spec, group.rank, group.degree)
        runner = ModelRunner(model_dir, dtype, "cpu", block_size=block_size, num_blocks=num_blocks,
                             quantize=quantize, layout=layout, group=group, kernel_backend=kernel_backend)
        if group.rank == 0:
            result = greedy_generate(Broadcasting(runner, group), BlockAllocator(num_blocks, block_size), prompts, n)
            group.broadcast("done")
            return result
        while not isinstance(step := group.broadcast(), str):
            runner.execute(step)
        return None

    return run_ranks(degree, rank)[0]
