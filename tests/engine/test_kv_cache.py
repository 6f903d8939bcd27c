"""BlockAllocator invariants under random allocate/free, and the slot-mapping / block-table tensors."""
from __future__ import annotations

import random

import pytest
import torch

from lmi_handler.engine.kv_cache import BlockAllocator, build_block_tables, build_slot_mapping, num_blocks_needed


def check_invariants(allocator: BlockAllocator, owned: dict[int, list[int]]) -> None:
    used = [b for blocks in owned.values() for b in blocks]
    assert len(used) == len(set(used)), "a block is owned twice"
    assert allocator.num_free_blocks + len(used) == allocator.num_blocks
    assert all(0 <= b < allocator.num_blocks for b in used)


def test_invariants_hold_after_random_allocate_and_free():
    rng = random.Random(0)
    allocator = BlockAllocator(num_blocks=37, block_size=4)
    owned: dict[int, list[int]] = {}
    for step in range(2000):
        if owned and rng.random() < 0.45:
            owner = rng.choice(list(owned))
            allocator.free(owned.pop(owner))
        else:
            n = rng.randint(0, 12)
            free_before = allocator.num_free_blocks
            blocks = allocator.allocate(n)
            if blocks is None:
                assert n > free_before and allocator.num_free_blocks == free_before
            else:
                assert len(blocks) == n
                owned[step] = blocks
        check_invariants(allocator, owned)


def test_allocate_returns_none_without_side_effects_when_short():
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    first = allocator.allocate(3)
    assert allocator.allocate(2) is None
    assert allocator.num_free_blocks == 1
    assert allocator.allocate(1) is not None and allocator.num_free_blocks == 0
    allocator.free(first)
    assert allocator.num_free_blocks == 3


def test_double_free_raises_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    blocks = allocator.allocate(2)
    allocator.free(blocks[:1])
    with pytest.raises(ValueError):
        allocator.free(blocks)          # blocks[0] already free
    assert allocator.num_free_blocks == 3
    with pytest.raises(ValueError):
        allocator.free([blocks[1], blocks[1]])
    allocator.free(blocks[1:])
    assert allocator.num_free_blocks == 4


def test_num_blocks_needed_is_ceil():
    assert [num_blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_slot_mapping_follows_block_tables():
    slots = build_slot_mapping([[7, 2, 9], [3]], starts=[5, 0], lengths=[4, 2], block_size=4)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0, 12, 13]


def test_slot_mapping_raises_when_block_table_is_too_short():
    with pytest.raises(IndexError):
        build_slot_mapping([[1]], starts=[3], lengths=[2], block_size=4)


def test_block_tables_are_padded_int32():
    tables = build_block_tables([[4, 5, 6], [1]])
    assert tables.dtype == torch.int32 and tables.tolist() == [[4, 5, 6], [1, 0, 0]]
