"""BlockAllocator invariants under random allocate/attach/free, prefix-cache keys and LRU eviction,
and the slot-mapping / block-table tensors."""
from __future__ import annotations

import random

import pytest
import torch

from lmi_handler.engine.kv_cache import (
    BlockAllocator,
    build_block_tables,
    build_slot_mapping,
    extend_block_hashes,
    hash_block,
    num_blocks_needed,
)


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


# ---- prefix cache ----------------------------------------------------------------------------

def test_a_block_key_covers_its_tokens_and_everything_before_them():
    root = hash_block(None, [1, 2, 3, 4])
    assert len(root) == 32 and root == hash_block(None, [1, 2, 3, 4])
    assert hash_block(root, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(None, [256]) != hash_block(None, [1, 0])      # ids are packed whole, not as bytes
    hashes: list[bytes] = []
    assert extend_block_hashes(hashes, list(range(10)), 4, 2) == [hash_block(None, [0, 1, 2, 3]),
                                                                 hash_block(hash_block(None, [0, 1, 2, 3]),
                                                                            [4, 5, 6, 7])]
    with pytest.raises(ValueError):
        extend_block_hashes(hashes, list(range(10)), 4, 3)           # only 2 full blocks


def test_a_released_cached_block_stays_cached_until_no_empty_block_is_left():
    allocator = BlockAllocator(num_blocks=3, block_size=4)
    cached, plain = allocator.allocate(2)
    key = hash_block(None, [1, 2, 3, 4])
    assert allocator.cache_block(cached, key)
    allocator.free([cached, plain])
    assert allocator.num_free_blocks == 3 and allocator.num_used_blocks == 0
    assert allocator.evictable_block_ids() == [cached] and allocator.match_prefix([key]) == [cached]
    assert cached not in allocator.allocate(2)                 # the two empty blocks go first
    assert allocator.allocate(1) == [cached]                   # then the cached one is evicted
    assert allocator.match_prefix([key]) == [] and allocator.block_hash(cached) is None
    assert allocator.allocate(1) is None


def test_eviction_takes_the_least_recently_released_block_first_and_a_table_tail_before_its_head():
    allocator = BlockAllocator(num_blocks=4, block_size=1)
    first, second = allocator.allocate(2), allocator.allocate(2)
    parent = None
    for block_id, token in zip(first + second, [10, 11, 20, 21]):
        parent = hash_block(parent if block_id != second[0] else None, [token])
        allocator.cache_block(block_id, parent)
    allocator.free(first)
    allocator.free(second)
    assert allocator.evictable_block_ids() == [first[1], first[0], second[1], second[0]]
    allocator.attach([first[0]])                               # a hit refreshes nothing else
    assert allocator.evictable_block_ids() == [first[1], second[1], second[0]]
    allocator.free([first[0]])                                 # ...and releasing it makes it the newest
    assert allocator.allocate(3) == [first[1], second[1], second[0]]
    assert allocator.evictable_block_ids() == [first[0]]


def test_attached_blocks_are_shared_by_reference_count():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    table = allocator.allocate(2)
    keys = extend_block_hashes([], list(range(8)), 4, 2)
    assert [allocator.cache_block(b, k) for b, k in zip(table, keys)] == [True, True]
    hits = allocator.match_prefix(keys + [hash_block(keys[1], [9, 9, 9, 9])])
    assert hits == table
    assert allocator.num_free_after_attach(hits) == 2          # held blocks cost nothing to share
    allocator.attach(hits)
    assert [allocator.ref_count(b) for b in table] == [2, 2] and allocator.num_used_blocks == 2
    allocator.free(table)
    assert allocator.num_used_blocks == 2 and allocator.num_evictable_blocks == 0
    allocator.free(hits)
    assert allocator.num_evictable_blocks == 2 and allocator.num_free_after_attach(hits) == 2
    with pytest.raises(ValueError):
        allocator.free(hits)                                   # double free
    with pytest.raises(ValueError):
        allocator.attach(allocator.allocate(1))                # not cached: nobody's known prefix


def test_a_key_cached_twice_keeps_the_first_block():
    allocator = BlockAllocator(num_blocks=2, block_size=4)
    a, b = allocator.allocate(2)
    key = hash_block(None, [1, 2, 3, 4])
    assert allocator.cache_block(a, key) and not allocator.cache_block(b, key)
    allocator.free([a, b])
    assert allocator.evictable_block_ids() == [a] and allocator.match_prefix([key]) == [a]
    with pytest.raises(ValueError):
        allocator.cache_block(a, key)                          # not in use


def test_ref_counts_match_tables_after_random_allocate_attach_cache_and_free():
    rng = random.Random(1)
    allocator = BlockAllocator(num_blocks=23, block_size=2)
    chains = [extend_block_hashes([], [rng.randrange(5) for _ in range(16)], 2, 8) for _ in range(4)]
    tables: dict[int, list[int]] = {}
    for step in range(3000):
        if tables and rng.random() < 0.4:
            allocator.free(tables.pop(rng.choice(list(tables))))
        else:
            chain = rng.choice(chains)
            hits = allocator.match_prefix(chain[:rng.randint(0, 8)])
            n = rng.randint(0, 4)
            if n > allocator.num_free_after_attach(hits):
                continue
            allocator.attach(hits)
            table = hits + allocator.allocate(n)
            for i in range(len(hits), min(len(table), len(chain))):
                allocator.cache_block(table[i], chain[i])
            tables[step] = table
        holders = [0] * allocator.num_blocks
        for table in tables.values():
            assert len(table) == len(set(table))
            for b in table:
                holders[b] += 1
        assert [allocator.ref_count(b) for b in range(allocator.num_blocks)] == holders
        assert allocator.num_free_blocks + allocator.num_used_blocks == allocator.num_blocks
        assert allocator.num_used_blocks == sum(1 for h in holders if h)
    for table in tables.values():
        allocator.free(table)
    assert allocator.num_free_blocks == allocator.num_blocks
    assert allocator.num_evictable_blocks == allocator.num_cached_blocks
