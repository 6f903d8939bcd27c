"""Scheduler invariants on toy sizes: token budget, batch size, KV blocks, recompute preemption."""
import random

from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig
from lmi_handler.engine.sequence import SamplingParams, Sequence, SequenceStatus


def make_seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(f"r{i}", list(range(prompt_len)), SamplingParams(max_new_tokens=8))


def run_step(sched: Scheduler) -> list[Sequence]:
    """Pretend the model ran: advance computed tokens and append a token to sequences at their end."""
    out = sched.schedule()
    sched.update_from_output(out)
    for seq in out.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(1)
    return out.seqs


def check_invariants(sched: Scheduler, alloc: BlockAllocator) -> None:
    owned = [b for s in sched.running + list(sched.waiting) for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert alloc.num_free_blocks + len(owned) == alloc.num_blocks
    for seq in sched.running:
        assert len(seq.block_table) * alloc.block_size >= seq.num_computed_tokens


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
