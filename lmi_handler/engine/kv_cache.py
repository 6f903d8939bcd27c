"""Paged KV-cache bookkeeping: the block free list, and the slot mapping / block-table tensors for a step.

Owns which block belongs to whom; leaves deciding who gets blocks to scheduler.py and the
cache tensors themselves (and writing K/V into them) to model_runner.py and model/attention.py.
"""
from __future__ import annotations

from array import array
from itertools import chain

import torch


def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil division); 0 tokens need 0 blocks."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """A free list over `num_blocks` blocks of `block_size` tokens each.

    Running out returns None (nothing allocated); freeing a block that is not in use is a bug
    and raises ValueError.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0 and block_size={block_size} >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` blocks; None (and no change) when fewer than `n` are free. Raises ValueError if n < 0."""
        if n < 0:
            raise ValueError(f"cannot allocate n={n} blocks")
        if n > len(self._free):
            return None
        block_ids = [self._free.pop() for _ in range(n)]
        self._used.update(block_ids)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the free list. Raises ValueError on a double free or an unknown id
        (checked for all ids before any is freed, so a failed call changes nothing)."""
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids repeated in one free: {block_ids}")
        bad = [b for b in block_ids if b not in self._used]
        if bad:
            raise ValueError(f"freeing blocks not in use (double free?): {bad}")
        self._used.difference_update(block_ids)
        self._free.extend(reversed(block_ids))


def build_slot_mapping(block_tables: list[list[int]], starts: list[int],
                       lengths: list[int], block_size: int) -> torch.Tensor:
    """Map each token scheduled this step to its slot in the paged KV cache.

    Sequence i writes positions [starts[i], starts[i] + lengths[i]); position p
    lives in block block_tables[i][p // block_size] at offset p % block_size:

        block_table [7, 2, 9], block_size 4, start 5, length 4
        positions    5  6  7  8
        blocks       2  2  2  9      slots = 2*4+1, 2*4+2, 2*4+3, 9*4+0

    The loop is per sequence (bounds check); the per-token work is tensor ops (slots_for_positions).
    Returns: (sum(lengths),) int64 on CPU, in scheduled order.
    Raises: IndexError if a position is past its block table (too few blocks).
    """
    for i, (table, start, length) in enumerate(zip(block_tables, starts, lengths)):
        if length > 0 and (start + length - 1) // block_size >= len(table):
            raise IndexError(f"sequence {i}: position {start + length - 1} is past its "
                             f"{len(table)} blocks of {block_size}")
    num_tokens = sum(lengths)
    counts = torch.tensor(lengths, dtype=torch.int64)
    seq_index = torch.repeat_interleave(torch.arange(len(lengths)), counts, output_size=num_tokens)
    first_row = torch.cumsum(counts, 0) - counts                                   # (S,) flat row of each start
    positions = torch.arange(num_tokens) + (torch.tensor(starts, dtype=torch.int64) - first_row)[seq_index]
    return slots_for_positions(build_block_tables(block_tables), seq_index, positions, block_size)


def slots_for_positions(block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor,
                        block_size: int) -> torch.Tensor:
    """Slot of each flat token: block_tables[seq_index, pos // block_size] * block_size + pos % block_size.

    block_tables: (S, max_blocks) int32 (build_block_tables); seq_index, positions: (T,) int64.
    Returns (T,) int64 on block_tables' device. Positions past a sequence's real blocks read padding:
    the caller checks bounds (build_slot_mapping, ModelRunner.prepare).
    """
    if positions.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=block_tables.device)
    flat_index = seq_index * block_tables.shape[1] + positions // block_size     # into the flattened table
    return torch.take(block_tables, flat_index).long() * block_size + positions % block_size


def build_block_tables(block_tables: list[list[int]], pad_id: int = 0) -> torch.Tensor:
    """Pad the sequences' block tables into one tensor.

    Returns: (num_seqs, max_blocks) int32 on CPU; rows shorter than the longest are padded with
    `pad_id` (a real block id, so a gather over padding stays in bounds; attention masks it out).
    """
    max_blocks = max((len(t) for t in block_tables), default=0)
    if max_blocks == 0:
        return torch.zeros(len(block_tables), 0, dtype=torch.int32)
    # one flat int32 buffer, not torch.tensor over nested lists (measured ~1.5x faster for 64 x 32)
    flat = array("i", chain.from_iterable(t + [pad_id] * (max_blocks - len(t)) for t in block_tables))
    return torch.frombuffer(flat, dtype=torch.int32).view(len(block_tables), max_blocks)
