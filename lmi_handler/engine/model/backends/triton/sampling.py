"""log_softmax, greedy and the seeded sampler as Triton kernels, one program per row.

Each program walks its row in VOCAB_BLOCK-wide chunks in order, so a row's bits do not depend on the batch.
The seeded sampler is the CPU sampler's exponential race (engine/sampler.py): token = argmax(logprobs -
log E) with E = -log(u) and u from the same counter-based hash of (seed, position, token id), bit for bit
(splitmix64 over (seed, position) in uint64, lowbias32 over (row key, token id) in uint32), so the draw of a
row depends only on its seed, its position and its own log-probs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

VOCAB_BLOCK = 1024


@triton.jit
def _log_softmax_kernel(out, logits, vocab, stride_l, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)         # per-lane running max and sum, merged at the end
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(logits + row * stride_l + start + cols, mask=start + cols < vocab,
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))
    for start in range(0, vocab, BLOCK):
        mask = start + cols < vocab
        x = tl.load(logits + row * stride_l + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + row * stride_o + start + cols, x - lse, mask=mask)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log_softmax of (S, V) logits, float32 out."""
    num_rows, vocab = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(num_rows, vocab, dtype=torch.float32, device=logits.device)
    if num_rows and vocab:
        _log_softmax_kernel[(num_rows,)](out, logits, vocab, logits.stride(0), out.stride(0), BLOCK=VOCAB_BLOCK)
    return out


@triton.jit
def _row_key(seed, position):
    """splitmix64(splitmix64(seed + GAMMA) + position * GAMMA), high 32 bits (sampler.exponential_log_noise)."""
    z = seed.to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    z = z + position.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return (z >> 32).to(tl.uint32)


@triton.jit
def _log_noise(row_key, token):
    """log(E), E = -log(u), u = ((lowbias32(row_key + (token + 1) * GAMMA32) >> 9) + 0.5) / 2**23."""
    z = row_key + (token + 1).to(tl.uint32) * 0x9E3779B9
    z = (z ^ (z >> 16)) * 0x7FEB352D
    z = (z ^ (z >> 15)) * 0x846CA68B
    z = z ^ (z >> 16)
    u = ((z >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return tl.log(-tl.log(u))


@triton.jit
def _argmax_kernel(out, scores, seeds, positions, vocab, stride_s, SEEDED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    if SEEDED:
        key = _row_key(tl.load(seeds + row), tl.load(positions + row))
    best = float("-inf")
    best_id = 0
    for start in range(0, vocab, BLOCK):
        ids = start + cols
        x = tl.load(scores + row * stride_s + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
        if SEEDED:
            x = tl.where(ids < vocab, x - _log_noise(key, ids), float("-inf"))
        chunk_max = tl.max(x, axis=0)
        chunk_id = tl.min(tl.where(x == chunk_max, ids, 2147483647), axis=0)     # lowest index on ties
        better = chunk_max > best
        best_id = tl.where(better, chunk_id, best_id)
        best = tl.where(better, chunk_max, best)
    tl.store(out + row, best_id.to(tl.int64))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of (S, V) logits, the lowest index on ties: (S,) int64."""
    out = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0] and logits.shape[1]:
        _argmax_kernel[(logits.shape[0],)](out, logits, out, out, logits.shape[1], logits.stride(0), SEEDED=False,
                                           BLOCK=VOCAB_BLOCK)
    return out


def seeded_sample(logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax(logprobs - log E) per row, E from (seed, position, token id) as in
    engine/sampler.py. logprobs: (S, V) float32 (the processed distribution's); seeds, positions: (S,) int64.
    Returns (S,) int64."""
    out = torch.zeros(logprobs.shape[0], dtype=torch.int64, device=logprobs.device)
    if logprobs.shape[0] and logprobs.shape[1]:
        _argmax_kernel[(logprobs.shape[0],)](out, logprobs, seeds, positions, logprobs.shape[1],
                                             logprobs.stride(0), SEEDED=True, BLOCK=VOCAB_BLOCK)
    return out
