"""Scheduler invariants on toy sizes: token budget, batch size, KV blocks, recompute preemption, prefix caching."""
import random
from types import SimpleNamespace

import pytest

from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig
from lmi_handler.engine.sequence import SamplingParams, Sequence, SequenceStatus
from tests.engine.helpers import run_step


def make_seq(i: int, prompt_len: int, prefix: list[int] = (), prompt_logprobs: bool = False) -> Sequence:
    """Request r{i}: `prefix`, then prompt tokens no other request has (so only `prefix` can hit the cache)."""
    own = list(range(1000 * (i + 1), 1000 * (i + 1) + prompt_len - len(prefix)))
    return Sequence(f"r{i}", list(prefix) + own, SamplingParams(max_new_tokens=8, prompt_logprobs=prompt_logprobs))


def check_invariants(sched: Scheduler, alloc: BlockAllocator) -> None:
    """Block accounting with sharing: ref counts are the number of tables holding each block."""
    tables = [s.block_table for s in sched.running + list(sched.waiting)]
    holders = [0] * alloc.num_blocks
    for table in tables:
        assert len(table) == len(set(table)), "a block is owned twice by one table"
        for b in table:
            holders[b] += 1
    assert [alloc.ref_count(b) for b in range(alloc.num_blocks)] == holders
    assert alloc.num_used_blocks == sum(1 for h in holders if h)
    assert alloc.num_free_blocks + alloc.num_used_blocks == alloc.num_blocks
    evictable = alloc.evictable_block_ids()
    assert sorted(evictable) == [b for b in range(alloc.num_blocks) if not holders[b] and alloc.block_hash(b)]
    for seq in sched.running:
        assert len(seq.block_table) * alloc.block_size >= seq.num_computed_tokens
        assert seq.num_cached_blocks <= seq.num_computed_tokens // alloc.block_size
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=19), alloc)
    seq = make_seq(0, 40)
    sched.add(seq)
    chunks = []
    while not seq.output_token_ids:
        out = sched.schedule()
        chunks.append(out.num_scheduled_tokens[0])
        sched.update_from_output(out)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(1)
    assert chunks == [16, 16, 8]
    assert seq.is_prefill is False


def test_running_sequences_decode_one_token_each_and_new_ones_join_between_steps():
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=32), alloc)
    first = make_seq(0, 5)
    sched.add(first)
    run_step(sched)
    second, third, fourth = make_seq(1, 6), make_seq(2, 3), make_seq(3, 3)
    for s in (second, third, fourth):
        sched.add(s)
    out = sched.schedule()
    assert out.seqs[0] is first and out.num_scheduled_tokens[0] == 1
    assert [s.request_id for s in out.seqs] == ["r0", "r1", "r2"]  # max_num_seqs caps admission
    assert list(sched.waiting) == [fourth]
    check_invariants(sched, alloc)


def test_out_of_blocks_preempts_the_latest_sequence_which_resumes_with_its_tokens():
    alloc = BlockAllocator(6, 4)  # 24 token slots
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    a, b = make_seq(0, 12), make_seq(1, 12)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 3 blocks each, cache full
    assert alloc.num_free_blocks == 0
    run_step(sched)  # a computes its 13th token: a 4th block: b is preempted
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.output_token_ids == [1]  # keeps its tokens for recompute
    check_invariants(sched, alloc)
    sched.finish(a)
    seqs = run_step(sched)
    assert seqs == [b] and b.num_computed_tokens == 13
    check_invariants(sched, alloc)


def test_random_workload_keeps_block_accounting_exact():
    rng = random.Random(0)
    alloc = BlockAllocator(40, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=24), alloc)
    for step in range(300):
        if rng.random() < 0.3:
            sched.add(make_seq(step, rng.randint(1, 30)))
        run_step(sched)
        for seq in list(sched.running):
            if seq.num_output_tokens >= seq.params.max_new_tokens or rng.random() < 0.05:
                sched.finish(seq)
        check_invariants(sched, alloc)
    assert sched.num_unfinished <= 300


def test_prefill_chunks_are_cut_the_same_alone_and_beside_other_prompts():
    """Chunk boundaries depend only on the sequence, not on the budget others leave (batch invariance)."""
    def chunks_of(target_len: int, others: list[int]) -> list[int]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=19), BlockAllocator(200, 4))
        for i, n in enumerate(others):
            sched.add(make_seq(i + 1, n))
        target = make_seq(0, target_len)
        sched.add(target)
        sizes = []
        while not target.output_token_ids:
            out = sched.schedule()
            sizes += [n for s, n in zip(out.seqs, out.num_scheduled_tokens) if s is target]
            sched.update_from_output(out)
            for s in out.seqs:
                if s.num_computed_tokens == s.num_tokens:
                    s.output_token_ids.append(1)
        return sizes

    alone = chunks_of(40, [])
    assert alone == [16, 16, 8]
    assert chunks_of(40, [5]) == alone
    assert chunks_of(40, [12, 3]) == alone
    assert chunks_of(40, [30]) == alone


def test_a_prompt_arriving_during_a_long_prefill_gets_in_before_the_next_chunk():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=19), BlockAllocator(200, 4))
    long = make_seq(0, 64)
    sched.add(long)
    run_step(sched)                      # long: first chunk of 16
    short = make_seq(1, 6)
    sched.add(short)
    seqs = run_step(sched)               # short comes first; long's 16-token chunk no longer fits
    assert seqs == [short]
    seqs = run_step(sched)               # short decodes, long's next full chunk goes on
    assert seqs == [short, long] and long.num_computed_tokens == 32


# ---- prefix caching --------------------------------------------------------------------------

def finish_all(sched: Scheduler) -> None:
    for seq in list(sched.running) + list(sched.waiting):
        sched.finish(seq)


def test_a_second_prompt_with_the_same_prefix_attaches_the_cached_full_blocks():
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    system = list(range(10))                       # 2 full blocks + 2 tokens
    first = make_seq(0, 15, prefix=system)
    sched.add(first)
    run_step(sched)
    second = make_seq(1, 13, prefix=system)
    sched.add(second)
    out = sched.schedule()
    assert out.seqs == [first, second] and out.num_scheduled_tokens == [1, 13 - 8]
    assert second.num_computed_tokens == second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] not in first.block_table
    assert [alloc.ref_count(b) for b in first.block_table[:2]] == [2, 2]
    assert alloc.prefix_cache_stats.num_queried_tokens == 15 + 13
    assert alloc.prefix_cache_stats.num_hit_tokens == 8
    check_invariants(sched, alloc)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    prompt = list(range(12))                       # exactly 3 full blocks
    first = Sequence("a", prompt, SamplingParams())
    sched.add(first)
    run_step(sched)
    first_blocks = list(first.block_table)
    sched.finish(first)
    again = Sequence("b", prompt, SamplingParams())
    sched.add(again)
    out = sched.schedule()
    # the third block holds the last token, whose logits the step needs: only 2 blocks are hits,
    # and the last block is a fresh one (a hit block is never written again)
    assert again.num_cached_tokens == 8 and out.num_scheduled_tokens == [4]
    assert again.block_table[:2] == first_blocks[:2]
    assert alloc.ref_count(again.block_table[2]) == 1 and alloc.block_hash(again.block_table[2]) is None
    check_invariants(sched, alloc)


def test_requests_for_prompt_log_probs_take_no_hits_but_fill_the_cache():
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    system = list(range(8))
    details = make_seq(0, 12, prefix=system, prompt_logprobs=True)
    sched.add(details)
    run_step(sched)
    assert details.num_cached_tokens == 0 and alloc.num_cached_blocks == 3
    plain = make_seq(1, 10, prefix=system)
    details_again = make_seq(2, 10, prefix=system, prompt_logprobs=True)
    sched.add(plain)
    sched.add(details_again)
    sched.schedule()
    assert plain.num_cached_tokens == 8 and details_again.num_cached_tokens == 0
    assert alloc.prefix_cache_stats.num_queries == 1          # prompt-logprob requests do not query
    check_invariants(sched, alloc)


def test_disabled_prefix_caching_neither_caches_nor_hits():
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(SchedulerConfig(4, 64, enable_prefix_caching=False), alloc)
    a, b = make_seq(0, 12, prefix=list(range(8))), make_seq(1, 12, prefix=list(range(8)))
    sched.add(a)
    run_step(sched)
    sched.add(b)
    run_step(sched)
    assert b.num_cached_tokens == 0 and alloc.num_cached_blocks == 0
    assert alloc.prefix_cache_stats.num_queries == 0
    finish_all(sched)
    assert alloc.num_free_blocks == alloc.num_blocks and alloc.num_evictable_blocks == 0


def test_a_preempted_sequence_resumes_from_its_own_cached_blocks_and_eviction_is_lru():
    alloc = BlockAllocator(6, 4)  # 24 token slots
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    a, b = make_seq(0, 12), make_seq(1, 12)
    sched.add(a)
    sched.add(b)
    run_step(sched)          # both prefilled: 3 full (cached) blocks each, cache full
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    run_step(sched)          # a's 13th token needs a 4th block: b is preempted and its blocks become
    assert b.status is SequenceStatus.WAITING      # evictable, its last block first: a takes that one
    assert alloc.block_hash(b_blocks[2]) is None and a.block_table[3] == b_blocks[2]
    assert alloc.evictable_block_ids() == [b_blocks[1], b_blocks[0]]
    check_invariants(sched, alloc)
    sched.finish(a)          # a's partial last block is empty; its 3 full ones queue up after b's
    assert alloc.evictable_block_ids() == [b_blocks[1], b_blocks[0], a_blocks[2], a_blocks[1], a_blocks[0]]
    out = sched.schedule()
    assert out.seqs == [b] and b.num_cached_tokens == 8 and b.block_table[:2] == b_blocks[:2]
    assert out.num_scheduled_tokens == [13 - 8]
    # b's 2 new blocks: the empty one, then the least recently released cached one (a's last)
    assert b.block_table[2:] == [b_blocks[2], a_blocks[2]]
    assert alloc.evictable_block_ids() == [a_blocks[1], a_blocks[0]]
    check_invariants(sched, alloc)


class ShadowCache:
    """What the model would have written: slot -> every token up to and including that position.

    Checks that a sequence's computed positions hold exactly its own prefix, whoever computed them
    (a hit attaches the right K/V), and that no step writes into a block another table holds.
    """

    def __init__(self, alloc: BlockAllocator):
        self.alloc = alloc
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def write(self, out) -> None:
        bs = self.alloc.block_size
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            tokens = seq.all_token_ids
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = seq.block_table[p // bs]
                assert self.alloc.ref_count(block) == 1, "a step writes into a shared block"
                self.slots[block, p % bs] = tuple(tokens[:p + 1])

    def check(self, seqs: list[Sequence]) -> None:
        bs = self.alloc.block_size
        for seq in seqs:
            tokens = seq.all_token_ids
            for p in range(seq.num_computed_tokens):
                assert self.slots[seq.block_table[p // bs], p % bs] == tuple(tokens[:p + 1])


def check_lru(before: list[int], alloc: BlockAllocator) -> None:
    """Across one schedule(): blocks evicted from `before` (oldest first) were its oldest survivors."""
    now = alloc.evictable_block_ids()
    still = set(now)
    evicted = [i for i, b in enumerate(before) if alloc.block_hash(b) is None]
    for i in evicted:
        assert not still.intersection(before[:i]), "a cached block was evicted before an older one"
    survivors = [b for b in before if b in still]
    assert now[:len(survivors)] == survivors, "surviving evictable blocks changed their order"


def test_random_workloads_with_shared_prefixes_keep_block_and_cache_accounting_exact():
    """Toy sizes, every step checked: ref counts, free + used == total, LRU eviction, correct hits."""
    for seed in range(6):
        rng = random.Random(seed)
        alloc = BlockAllocator(rng.choice([18, 24, 40]), rng.choice([2, 4]))  # >= the longest request (36 tokens)
        sched = Scheduler(SchedulerConfig(max_num_seqs=rng.randint(2, 5), max_num_batched_tokens=24), alloc)
        shadow = ShadowCache(alloc)
        prefixes = [list(range(500 + 100 * k, 500 + 100 * k + rng.randint(2, 14))) for k in range(3)]
        seqs, hits = [], 0
        for step in range(250):
            if step < 200 and rng.random() < 0.35:
                prefix = rng.choice(prefixes + [[]])
                seq = make_seq(step, len(prefix) + rng.randint(1, 12), prefix, prompt_logprobs=rng.random() < 0.1)
                seqs.append(seq)
                sched.add(seq)
            before = alloc.evictable_block_ids()
            out = sched.schedule()
            check_lru(before, alloc)
            check_invariants(sched, alloc)
            shadow.check(out.seqs)              # hits carry this sequence's own prefix
            shadow.write(out)
            sched.update_from_output(out)
            for seq in out.seqs:
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.output_token_ids.append(rng.choice([1, 2]))
            for seq in list(sched.running):
                if seq.num_output_tokens >= seq.params.max_new_tokens or rng.random() < 0.03:
                    sched.finish(seq)
            check_invariants(sched, alloc)
            hits += sum(1 for s in out.seqs if s.num_cached_tokens and s.num_computed_tokens == s.num_cached_tokens)
        finish_all(sched)
        check_invariants(sched, alloc)
        assert all(alloc.ref_count(b) == 0 for b in range(alloc.num_blocks))
        assert alloc.num_free_blocks == alloc.num_blocks and alloc.num_used_blocks == 0
        assert alloc.num_evictable_blocks == alloc.num_cached_blocks
        assert alloc.prefix_cache_stats.num_hit_tokens > 0, f"seed {seed}: the workload never hit the cache"


def test_park_sets_sequences_aside_with_their_blocks_and_restore_brings_them_back_in_order():
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    seqs = [make_seq(i, 6) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)                                   # all three running, prompts computed
    late = make_seq(3, 5)
    sched.add(late)                                   # waiting
    tables = [list(s.block_table) for s in seqs]

    parked = sched.park([seqs[0], seqs[2]])
    assert sched.running == [seqs[1]] and list(sched.waiting) == []
    assert [s.block_table for s in seqs] == tables    # parked, not freed
    assert run_step(sched) == [seqs[1]]               # the step sees only what is left, admits nobody
    sched.restore(parked)
    assert sched.running == seqs and list(sched.waiting) == [late]
    check_invariants(sched, alloc)
    assert run_step(sched) == [*seqs, late]


def test_restore_leaves_out_a_parked_sequence_that_finished_and_keeps_one_preempted_meanwhile_first():
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    seqs = [make_seq(i, 6) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)
    held = make_seq(3, 5)
    sched.add(held)
    parked = sched.park([seqs[0]])
    sched.finish(seqs[0])                             # aborted while parked
    sched._preempt(seqs[2])                           # preempted by a step while the others were parked
    sched.restore(parked)
    assert sched.running == [seqs[1]] and list(sched.waiting) == [seqs[2], held]
    assert seqs[0].status is SequenceStatus.FINISHED and seqs[0].block_table == []
    check_invariants(sched, alloc)


def test_fault_hooks_see_each_steps_work_in_order_and_what_one_raises_leaves_the_queues_as_scheduled():
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    seen = []
    sched.fault_hooks.append(lambda out: seen.append([s.request_id for s in out.seqs]))
    sched.add(make_seq(0, 6))
    run_step(sched)
    assert seen == [["r0"]]

    def fail(out):
        raise RuntimeError("boom")

    sched.fault_hooks.append(fail)
    sched.add(make_seq(1, 6))
    with pytest.raises(RuntimeError, match="boom"):
        sched.schedule()
    assert seen == [["r0"], ["r0", "r1"]]                          # in order: the first hook ran, then the second
    assert [s.request_id for s in sched.running] == ["r0", "r1"]   # admitted, blocks reserved, as a failed step leaves it
    check_invariants(sched, alloc)


# ---- priority scheduling (option.scheduling_policy) ------------------------------------------

def ranked(i: int, prompt_len: int, priority: int, max_new_tokens: int = 8) -> Sequence:
    """Request r{i} with `priority`, arriving at time i (the tie-break within a priority)."""
    seq = make_seq(i, prompt_len)
    seq.params = SamplingParams(max_new_tokens=max_new_tokens, priority=priority)
    seq.arrival_time = float(i)
    return seq


def first_token_steps(sched: Scheduler, alloc: BlockAllocator, seqs: list[Sequence], late: Sequence,
                      late_step: int) -> dict[str, int]:
    """Run steps until every sequence is done (max_new_tokens each), adding `late` before step `late_step`;
    returns the step at which each one got its first token, checking the invariants after every step."""
    first: dict[str, int] = {}
    for seq in seqs:
        sched.add(seq)
    for step in range(10_000):
        if step == late_step:
            sched.add(late)
        for seq in run_step(sched):
            if seq.num_output_tokens == 1:
                first.setdefault(seq.request_id, step)
        for seq in list(sched.running):
            if seq.num_output_tokens >= seq.params.max_new_tokens:
                sched.finish(seq)
        check_invariants(sched, alloc)
        if step > late_step and not sched.num_unfinished:
            return first
    raise AssertionError("the workload did not finish")


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_under_priority_a_request_behind_64_queued_lower_ones_gets_its_first_token_before_any_not_started(policy):
    alloc = BlockAllocator(400, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy=policy), alloc)
    low = [ranked(i, 6, priority=5) for i in range(64)]
    high = ranked(100, 6, priority=0, max_new_tokens=2)
    first = first_token_steps(sched, alloc, low, high, late_step=3)
    not_started = [s.request_id for s in low if first[s.request_id] >= 3]
    assert len(not_started) >= 56
    before = [rid for rid in not_started if first[rid] <= first["r100"]]
    if policy == "priority":
        assert before == [] and first["r100"] == 3     # a seat freed for it at once: a low one was preempted
    else:
        assert len(before) == len(not_started)         # fcfs: the priority is not read, it waits its turn


def test_under_priority_a_higher_waiting_request_short_of_blocks_preempts_the_lowest_running_one():
    alloc = BlockAllocator(6, 4)                   # 24 token slots
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="priority"),
                      alloc)
    a, b = ranked(0, 11, priority=1), ranked(1, 11, priority=2)
    sched.add(a)
    sched.add(b)
    run_step(sched)                                # both prefilled: 3 blocks each, cache full (decodes fit)
    c = ranked(2, 7, priority=0)
    sched.add(c)
    out = sched.schedule()
    assert out.preempted == [b] and b.status is SequenceStatus.WAITING and b.output_token_ids == [1]
    assert out.seqs == [a, c] and list(sched.waiting) == [b]
    check_invariants(sched, alloc)
    same = ranked(3, 4, priority=2)
    sched.add(same)
    sched.add(ranked(4, 4, priority=1))
    # waiting in rank order: the preempted b before the later arrival of its priority, behind a better one
    assert [s.request_id for s in sched.waiting] == ["r4", "r1", "r3"]


def test_under_priority_a_waiting_request_never_preempts_one_of_its_own_or_a_better_priority():
    alloc = BlockAllocator(6, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="priority"),
                      alloc)
    a, b = ranked(0, 11, priority=1), ranked(1, 11, priority=2)
    sched.add(a)
    sched.add(b)
    run_step(sched)                                # cache full; their next tokens fit their blocks
    sched.add(ranked(2, 7, priority=2))
    out = sched.schedule()
    assert out.preempted == [] and out.seqs == [a, b] and len(sched.waiting) == 1


def test_under_priority_running_out_of_blocks_preempts_the_worst_ranked_sequence_not_the_latest():
    alloc = BlockAllocator(6, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="priority"),
                      alloc)
    a, b = ranked(0, 12, priority=3), ranked(1, 12, priority=0)   # b arrived last but ranks first
    sched.add(a)
    sched.add(b)
    run_step(sched)
    out = sched.schedule()                         # b's 13th token needs a 4th block: a goes, not b
    assert out.preempted == [a] and out.seqs == [b]
    assert a.status is SequenceStatus.WAITING and a.output_token_ids == [1]
    check_invariants(sched, alloc)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workloads_with_priorities_keep_block_accounting_exact_and_finish_every_request(seed):
    rng = random.Random(seed)
    alloc = BlockAllocator(30, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=24, scheduling_policy="priority"),
                      alloc)
    added = []
    for step in range(400):
        if step < 250 and rng.random() < 0.35:
            added.append(ranked(step, rng.randint(1, 30), priority=rng.randint(-2, 2), max_new_tokens=6))
            sched.add(added[-1])
        out = sched.schedule()
        ranks = [(s.params.priority, s.arrival_time) for s in sched.waiting]
        assert ranks == sorted(ranks)
        sched.update_from_output(out)
        for seq in out.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(1)
        for seq in list(sched.running):
            if seq.num_output_tokens >= seq.params.max_new_tokens:
                sched.finish(seq)
        check_invariants(sched, alloc)
    assert sched.num_unfinished == 0 and all(s.is_finished for s in added)


def test_under_priority_a_waiting_request_that_could_not_start_anyway_preempts_nobody():
    """Its LoRA adapter would pass max_loras: freeing a seat for it would only churn the running ones."""
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_loras=1,
                                      scheduling_policy="priority"), alloc)
    a, b, c = ranked(0, 5, priority=5), ranked(1, 5, priority=5), ranked(2, 5, priority=0)
    a.adapter, c.adapter = SimpleNamespace(key=b"adapter-a"), SimpleNamespace(key=b"adapter-c")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.add(c)
    for _ in range(3):
        out = sched.schedule()
        assert out.preempted == [] and out.seqs == [a, b]
        sched.update_from_output(out)
        for seq in out.seqs:
            seq.output_token_ids.append(1)
    check_invariants(sched, alloc)
