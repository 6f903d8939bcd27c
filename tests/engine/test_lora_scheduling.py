"""LoRA in the scheduler: the prefix cache keyed on the adapter (two adapters never share cached K/V) and
option.max_loras distinct adapters in one step."""
from pathlib import Path

from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.lora import LoraAdapter
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig
from lmi_handler.engine.sequence import SamplingParams, Sequence
from tests.engine.test_scheduler import check_invariants, run_step

PROMPT = list(range(100, 117))      # 4 full blocks of 4 and one token more


def _adapter(name: str) -> LoraAdapter:
    return LoraAdapter(name, Path(name), rank=8, scale=1.0, weights={})


def _seq(request_id: str, adapter: LoraAdapter | None) -> Sequence:
    return Sequence(request_id, list(PROMPT), SamplingParams(max_new_tokens=4, adapter=adapter and adapter.name),
                    adapter=adapter)


def _cached_after(first: Sequence, second: Sequence) -> int:
    """Tokens `second` finds in the prefix cache once `first` has computed the same prompt."""
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    sched.add(first)
    run_step(sched)
    sched.add(second)
    run_step(sched)
    check_invariants(sched, alloc)
    return second.num_cached_tokens


def test_two_adapters_never_share_cached_kv_and_one_adapter_does():
    a, b = _adapter("a"), _adapter("b")
    assert _cached_after(_seq("1", a), _seq("2", a)) == 16           # same adapter: the prefix is reused
    assert _cached_after(_seq("1", a), _seq("2", b)) == 0            # another adapter: computed afresh
    assert _cached_after(_seq("1", a), _seq("2", None)) == 0         # the base never reads an adapter's K/V
    assert _cached_after(_seq("1", None), _seq("2", a)) == 0         # ... nor an adapter the base's
    assert _cached_after(_seq("1", None), _seq("2", None)) == 16
    assert _cached_after(_seq("1", a), _seq("2", _adapter("a"))) == 0  # the same name loaded again: a new key


def test_a_step_holds_at_most_max_loras_adapters_and_the_base_runs_beside_them():
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_loras=2), alloc)
    a, b, c = _adapter("a"), _adapter("b"), _adapter("c")
    seqs = [_seq("a1", a), _seq("b1", b), _seq("c1", c), _seq("base", None), _seq("a2", a)]
    for seq in seqs:
        sched.add(seq)
    first = run_step(sched)
    assert [s.request_id for s in first] == ["a1", "b1", "base", "a2"]   # c waits: a and b fill max_loras
    sched.finish(seqs[0])
    sched.finish(seqs[4])                                                  # adapter a has no running request left
    assert "c1" in [s.request_id for s in run_step(sched)]
    check_invariants(sched, alloc)
