"""Decode steps as CUDA graphs: one graph per padded batch size, captured at start-up, replayed per step.

Owns the padded batch sizes (graph_batch_sizes), the static input buffers a graph reads, the step function
over them (DecodeGraphs.step: an ordinary function, so it also runs eagerly on CPU, which is how it is tested),
capture into one memory pool and replay; leaves deciding which steps come here to model_runner.py (decode
steps only: one row per sequence, no LoRA, no block copy; prefill and mixed steps run eagerly) and the
kernels to the model's backend. nano-vllm and vLLM capture decode the same way; the code is our own.

A graph replays the kernels it recorded on the memory it recorded, so everything a step varies lives in
static buffers that each step overwrites: the token ids, positions, slots, block tables and context
lengths of its rows. A step of n sequences replays the graph of the smallest size b >= n; rows n..b-1 are
padding: slot -1 (the K/V store writes nothing) and context length 0 (attention reads nothing and writes
zeros). The kernels compute a row from that row alone, so a real row's bits are those of the unpadded step.
"""
from __future__ import annotations

import logging
import time

import torch

from lmi_handler.engine.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, 8, then every multiple of 8 up to 128 and of 16 beyond,
    below max_num_seqs, and max_num_seqs itself (the largest a decode step can have)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    size = 16
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 128 else 16
    return sizes + [max_num_seqs]


def graph_unfit(model, device: torch.device) -> str:
    """Why decode steps of `model` on `device` cannot be graphs ('' when they can): CUDA only, and only the
    Triton backend's forward, whose kernels read every length from device tensors (the PyTorch reference
    loops over host lists; the C++ path is CPU), and no RoPE whose frequencies depend on the step's lengths."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if model.kernel_backend != "triton":
        return f"kernel_backend={model.kernel_backend} reads host-side lengths each step"
    if any(layer.rope is not None and layer.rope.depends_on_length for layer in model.spec.layers):
        return "the model's RoPE frequencies depend on each step's sequence lengths (dynamic / longrope)"
    return ""


class DecodeGraphs:
    """The decode step over static buffers, for every size of graph_batch_sizes(max_num_seqs).

    `model`: the runner's forward (forward(input_ids, positions, kv_caches, meta, lora) and
    compute_logits); `kv_caches`: the runner's per-layer (K, V); `max_blocks`: the widest block table a
    step may bring (wider steps run eagerly). The buffers, on `device`: input_ids, positions, slot_mapping
    (B,) int64; block_tables (B, max_blocks) int32; context_lens (B,) int32; cu_seqlens_q = 0..B int32
    (one row per sequence); logits (B, vocab) float32, the step's output. B = max_num_seqs.
    """

    def __init__(self, model, kv_caches, block_size: int, max_num_seqs: int, max_blocks: int, vocab_size: int,
                 device: torch.device):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks = max_blocks
        size = self.sizes[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.context_lens_host = [0] * size      # the host-side metadata of the step (eager backends read it)
        self.logits = torch.zeros(size, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def takes(self, model_input) -> bool:
        """Whether this step is a decode step these buffers hold: one row per sequence, at most max_num_seqs,
        no prompt-logprob rows, LoRA or block copy, its block table no wider than max_blocks, (T,) positions (a
        row at M-RoPE's three streams, the last prompt token after a prefix-cache hit, runs eager)."""
        mi = model_input
        return (mi.num_chunk_rows == 0 and mi.lora is None and mi.blocks_to_copy is None and mi.positions.dim() == 1
                and mi.input_ids.shape[0] == mi.attn.num_seqs <= self.sizes[-1]
                and mi.attn.block_tables.shape[1] <= self.max_blocks)

    def size_for(self, num_seqs: int) -> int:
        """The smallest captured size that holds num_seqs rows."""
        return next(size for size in self.sizes if size >= num_seqs)

    def load(self, model_input, size: int) -> None:
        """Copy the step's rows into the buffers (host or device tensors; no sync) and mark rows
        num_seqs..size-1 as padding: slot -1, context length 0. The padding rows' ids and positions keep
        whatever valid values an earlier step left there: no real row reads them."""
        mi, n = model_input, model_input.attn.num_seqs
        self.input_ids[:n].copy_(mi.input_ids, non_blocking=True)
        self.positions[:n].copy_(mi.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(mi.attn.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(mi.attn.context_lens, non_blocking=True)
        self.block_tables[:n, :mi.attn.block_tables.shape[1]].copy_(mi.attn.block_tables, non_blocking=True)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.context_lens[n:size].zero_()
        self.context_lens_host[:size] = list(mi.attn.context_lens_host) + [0] * (size - n)

    def step(self, size: int) -> torch.Tensor:
        """The decode step of the first `size` rows of the buffers: the forward (K/V of the real rows written
        into the cache) and lm_head, the float32 logits written into self.logits[:size], which it returns.
        What a graph records; called directly, it runs the same step eagerly (on CPU too)."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size], cu_seqlens_q=self.cu_seqlens_q[:size + 1],
            query_lens=[1] * size, context_lens_host=self.context_lens_host[:size], block_size=self.block_size)
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta, None)
        self.logits[:size].copy_(self.model.compute_logits(hidden))
        return self.logits[:size]

    def run(self, model_input) -> torch.Tensor:
        """The step's (num_seqs, vocab) float32 logits: its rows loaded, then the graph of its padded size
        replayed (or, where none was captured, step() run eagerly). The logits are a view of the static
        buffer, valid until the next run."""
        n = model_input.attn.num_seqs
        size = self.size_for(n)
        self.load(model_input, size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self.step(size)
        return self.logits[:n]

    def capture(self) -> tuple[float, int]:
        """Capture every size's step, largest first, into one memory pool (CUDA). Each capture follows an
        eager run of the same step (Triton compiles its kernels outside the capture). The rows are all
        padding meanwhile, so the KV cache is never written. Returns (seconds, bytes of GPU memory taken)."""
        device = self.logits.device
        start, (free_before, _) = time.perf_counter(), torch.cuda.mem_get_info(device)
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        self.context_lens_host[:] = [0] * len(self.context_lens_host)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.step(size)                                  # warm-up: compiles, autotunes, fills caches
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.step(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        return time.perf_counter() - start, free_before - torch.cuda.mem_get_info(device)[0]
