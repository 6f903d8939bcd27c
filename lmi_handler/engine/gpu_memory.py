"""option.gpu_memory_utilization: how many KV-cache blocks a CUDA engine gets, as vLLM and LMI size them.

Owns the arithmetic (kv_cache_blocks_for_gpu, a pure function of byte counts, tested on CPU) and the
profiling forwards that measure its inputs (blocks_for_gpu, profile_step); leaves allocating the cache and
capturing the graphs to model_runner.py / cuda_graphs.py. CPU engines size their cache by option.kv_cache_bytes.

The rule: of the GPU's `total` bytes the engine may use utilization x total. Already in use after loading the
weights and a profiling forward (memory freed back to the device first) is total - free: the weights, the
CUDA context, the allocator's leftovers and any other process on the device. On top of that, every step
needs its activations (the profiling forward's peak above what was allocated before it, plus the sampler's
scratch) and the decode graphs their pool. The KV cache gets the rest, in whole blocks.
"""
from __future__ import annotations

import logging

import torch

from lmi_handler.config import ConfigError
from lmi_handler.engine.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)

SAMPLER_ROWS_SCRATCH = 8   # (rows, vocab) float32 tensors the sampler may hold at once (logits, noise, filters)


def kv_cache_blocks_for_gpu(total_bytes: int, free_bytes: int, activation_bytes: int, graph_bytes: int,
                            utilization: float, block_bytes: int) -> int:
    """KV-cache blocks: (utilization x total_bytes - (total_bytes - free_bytes) - activation_bytes - graph_bytes)
    // block_bytes.

    total_bytes, free_bytes: torch.cuda.mem_get_info()'s (total, free) after the weights loaded and the
    profiling forward's memory went back to the device; activation_bytes: a step's peak above the weights
    (profile_activation_bytes); graph_bytes: the decode graphs' pool (0 without graphs); block_bytes: one block
    over every layer (model_runner.kv_block_bytes).
    Raises ConfigError naming option.gpu_memory_utilization and the bytes when not one block is left;
    ValueError for a utilization outside (0, 1] or a block of no bytes (config.py refuses the former first).
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    allowed = int(utilization * total_bytes)
    in_use = total_bytes - free_bytes
    left = allowed - in_use - activation_bytes - graph_bytes
    if left < block_bytes:
        raise ConfigError(
            f"option.gpu_memory_utilization={utilization} leaves no room for the KV cache: {allowed} of the GPU's "
            f"{total_bytes} bytes, of which {in_use} are in use (the weights, the CUDA context, other processes), "
            f"{activation_bytes} a step's activations need and {graph_bytes} the CUDA graphs, leaves {left} bytes, "
            f"less than one KV block of {block_bytes} bytes; raise option.gpu_memory_utilization, lower "
            f"option.max_rolling_batch_prefill_tokens or option.max_rolling_batch_size, or free the GPU")
    return left // block_bytes


def sampler_scratch_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """The sampler's working memory for a step of max_num_seqs rows: SAMPLER_ROWS_SCRATCH (rows, vocab) float32
    tensors (its processors and the seeded race each make one or two)."""
    return SAMPLER_ROWS_SCRATCH * max_num_seqs * vocab_size * 4


def profile_activation_bytes(run_step, device: torch.device) -> int:
    """The bytes `run_step()` allocates at its peak above what was allocated before it, on `device` (CUDA):
    the allocator's peak statistic reset first, the step's memory returned to the device after."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return max(peak, 0)


def blocks_for_gpu(runner, utilization: float, block_bytes: int, num_kv_heads: int, max_num_seqs: int,
                   max_num_batched_tokens: int, graphs: bool) -> int:
    """KV blocks for a ModelRunner (its model loaded, no cache yet) on its CUDA device at
    option.gpu_memory_utilization: a prefill of max_num_batched_tokens rows (logits for every row, as prompt
    log-probs ask) and a decode step of max_num_seqs rows profiled over a one-block cache nothing is written
    to; the decode step's peak stands for the graphs' pool when `graphs` (captured largest first into one
    pool, they hold about the largest step's activations). Logged. Raises ConfigError when not one block fits."""
    config, device = runner.config, runner.device
    scratch = torch.zeros(config.num_layers, 2, 1, runner.block_size, num_kv_heads, config.head_dim,
                          dtype=runner.dtype, device=device)
    caches = [(layer[0], layer[1]) for layer in scratch]
    with torch.inference_mode():
        prefill = profile_activation_bytes(lambda: profile_step(runner, caches, 1, max_num_batched_tokens), device)
        decode = profile_activation_bytes(lambda: profile_step(runner, caches, max_num_seqs, 1), device)
    free, total = torch.cuda.mem_get_info(device)
    activation = max(prefill, decode) + sampler_scratch_bytes(max_num_seqs, config.vocab_size)
    graph_bytes = decode if graphs else 0
    num_blocks = kv_cache_blocks_for_gpu(total, free, activation, graph_bytes, utilization, block_bytes)
    logger.info("KV cache at gpu_memory_utilization=%s: %d blocks (%.2f GiB) of %.2f GiB total; %.2f GiB in use "
                "after the weights, %.2f GiB kept for a step's activations, %.2f GiB for the CUDA graphs",
                utilization, num_blocks, num_blocks * block_bytes / 2**30, total / 2**30, (total - free) / 2**30,
                activation / 2**30, graph_bytes / 2**30)
    return num_blocks


def profile_step(runner, caches, num_seqs: int, query_len: int) -> torch.Tensor:
    """The runner's forward over num_seqs sequences of query_len new rows each, on `caches` (any number of
    blocks: every block table entry is block 0 and every slot -1, so nothing is written), lm_head over every
    row. Returns the (num_seqs * query_len, vocab) float32 logits."""
    num_tokens, device, block_size = num_seqs * query_len, runner.device, runner.block_size
    attn = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(num_seqs, -(-query_len // block_size), dtype=torch.int32, device=device),
        context_lens=torch.full((num_seqs,), query_len, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32, device=device),
        query_lens=[query_len] * num_seqs, context_lens_host=[query_len] * num_seqs, block_size=block_size)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(query_len, device=device).repeat(num_seqs)
    hidden = runner.model(ids, positions, caches, attn, None)
    return runner.model.compute_logits(hidden)
