"""The tensor-parallel group's collectives (engine/parallel/group.py) over real gloo groups on the loopback, the
ranks run as threads of this process (gloo allows it; the process-level tests are test_parallel_executor.py)."""
from __future__ import annotations

import pickle

import pytest
import torch

from lmi_handler.engine.parallel.group import TPGroup, dumps
from tests.engine.parallel.helpers import run_ranks, toy_input


def parts_of(rank: int) -> torch.Tensor:
    """Rank r's partial sums: values whose float32 sum depends on the order they are added in."""
    g = torch.Generator().manual_seed(rank)
    return (torch.randn(5, 33, generator=g) * 10 ** (3 * rank)).float()


def test_all_reduce_adds_in_rank_order_and_every_rank_gets_the_same_bits():
    results = run_ranks(3, lambda group: group.all_reduce(parts_of(group.rank)))
    expected = (parts_of(0) + parts_of(1)) + parts_of(2)
    for out in results:
        assert torch.equal(out, expected)
    reverse = (parts_of(2) + parts_of(1)) + parts_of(0)
    assert not torch.equal(expected, reverse), "the test values must depend on the order of the adds"


def test_a_rows_all_reduce_does_not_depend_on_the_other_rows():
    def reduce_alone_and_batched(group):
        x = parts_of(group.rank)
        return group.all_reduce(x[2:3]), group.all_reduce(x)[2:3]

    for alone, batched in run_ranks(3, reduce_alone_and_batched):
        assert torch.equal(alone, batched)


def test_gather_rows_copies_each_row_from_its_owner_exactly():
    owner = torch.tensor([2, 0, 1, 1, 2])
    results = run_ranks(3, lambda group: group.gather_rows(parts_of(group.rank), owner))
    expected = torch.stack([parts_of(int(o))[t] for t, o in enumerate(owner)])
    assert all(torch.equal(out, expected) for out in results)


def test_rank_0_gets_the_vocabulary_slices_in_rank_order():
    results = run_ranks(3, lambda group: group.gather_last_dim(parts_of(group.rank)))
    assert torch.equal(results[0], torch.cat([parts_of(r) for r in range(3)], dim=-1))
    assert results[1] is None and results[2] is None


def test_min_int_and_the_step_broadcast_reach_every_rank():
    step = toy_input([[1, 2, 3], [4]])

    def exchange(group):
        return group.min_int(10 - group.rank), group.broadcast(step if group.rank == 0 else None)

    for smallest, received in run_ranks(3, exchange):
        assert smallest == 8
        assert torch.equal(received.input_ids, step.input_ids) and received.attn.query_lens == [3, 1]
        assert torch.equal(received.attn.block_tables, step.attn.block_tables)


def test_the_step_pickle_keeps_every_tensor_bitwise_and_dtype():
    step = toy_input([[5, 6, 7, 8], [9, 10]])
    back = pickle.loads(dumps(step))
    for name in ("input_ids", "positions", "logit_rows"):
        assert torch.equal(getattr(back, name), getattr(step, name))
    for name in ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q"):
        a, b = getattr(back.attn, name), getattr(step.attn, name)
        assert a.dtype == b.dtype and torch.equal(a, b)
    odd = {"view": torch.arange(10)[2:7:2], "bf16": torch.ones(3, dtype=torch.bfloat16)}
    assert all(torch.equal(pickle.loads(dumps(odd))[k], v) for k, v in odd.items())


def test_degree_1_needs_no_group():
    group = TPGroup(0, 1, torch.device("cpu"))
    x = parts_of(0)
    assert group.all_reduce(x) is x and group.gather_last_dim(x) is x and group.all_gather(x) == [x]


@pytest.mark.parametrize("degree", [2, 4])
def test_the_collectives_work_at_other_degrees(degree):
    results = run_ranks(degree, lambda group: group.all_reduce(parts_of(group.rank)))
    expected = parts_of(0)
    for r in range(1, degree):
        expected = expected + parts_of(r)
    assert all(torch.equal(out, expected) for out in results)
