"""Scheduler: waiting/running queues, admission by batch size, token budget and free KV blocks.

Owns which sequences run each step and how many tokens each computes (chunked prefill, prefix-cache
hits, recompute preemption); it never sees a tensor: the model runner turns its output into one.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from lmi_handler.engine.kv_cache import BlockAllocator, BlockHash, extend_block_hashes, num_blocks_needed
from lmi_handler.engine.model.vision import image_block_keys
from lmi_handler.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int                  # sequences decoded together
    max_num_batched_tokens: int        # tokens computed in one step (>= max_num_seqs)
    enable_prefix_caching: bool = True  # share computed full blocks between sequences (kv_cache.py)
    max_loras: int | None = None       # distinct LoRA adapters running at once (option.max_loras); None = no LoRA
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"   # option.scheduling_policy (see Scheduler)

    @property
    def by_priority(self) -> bool:
        return self.scheduling_policy == "priority"

    @property
    def prefill_chunk_size(self) -> int:
        """Tokens per prefill chunk: the budget less one decode token for every other sequence.

        Chunks are cut at fixed multiples of this size, never to whatever budget is left, so a
        sequence's chunks (and with them the model runner's GEMM tiles) are the same alone and
        in any batch: part of the batch-invariance promise (DESIGN §6).
        """
        return max(self.max_num_batched_tokens - self.max_num_seqs + 1, 1)


@dataclass
class SchedulerOutput:
    """One step's work: sequence i computes `num_scheduled_tokens[i]` tokens from its num_computed_tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # copy-on-write of shared partial blocks (forked beams), (src, dst) block ids: done before the forward
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class Parked:
    """What `Scheduler.park` set aside: running sequences in their queue order, and the whole waiting queue."""

    running: list[Sequence]
    order: dict[int, int]              # id(seq) -> its index in the running queue when parked
    waiting: deque[Sequence]


class Scheduler:
    """vLLM-v1-style token-budget scheduler: running sequences first, then waiting ones in FIFO order.

    Every step, each running sequence asks for its uncomputed tokens (1 in decode, a chunk in
    prefill), capped by the step's token budget. When the KV cache runs out, the sequence that
    arrived last is preempted by recompute: its blocks are freed and it goes back to the head of
    the waiting queue, keeping its tokens (seeded draws depend only on position, so it resumes
    with the same tokens).

    Prefix caching (config.enable_prefix_caching): every full block a sequence has computed is
    registered in the allocator's prefix cache under its chain hash. At admission a sequence
    attaches the longest cached run of its leading full blocks and starts computing after them, so
    a shared system prompt or chat template is prefilled once; a resumed preempted sequence hits
    its own blocks unless they were evicted meanwhile. The hit always leaves the last token to
    compute (the step needs its logits), and a hit block is never written again. Sequences asking
    for prompt log probs (decoder_input_details) take no hits, since every prompt position's logits
    must be computed, but their blocks still fill the cache.

    Beam search (engine/beam_search.py): a request's beams share their blocks by reference count
    (`fork`); a beam about to write into a shared partial block first takes a copy of it
    (copy-on-write, `blocks_to_copy`). A group's beams are scheduled together, each computing its one
    decode token, or not at all; preempting one beam preempts its group, and a preempted group is
    admitted again as a whole, prefilling each beam up to its last token, which they then decode together.
    A beam request's prompt (before its first token) takes num_beams of the max_num_seqs seats.

    Priority (config.scheduling_policy "priority", vLLM's): a sequence ranks by (params.priority, arrival
    time), lower first. The waiting queue is kept in rank order (a preempted sequence goes back to its rank's
    place, not to the head); running sequences are scheduled in rank order and the victim of a preemption is
    the worst-ranked one; and before a step, while the best-ranked waiting sequence cannot be admitted for want
    of KV blocks or a seat, the worst-ranked running sequence ranked below it is preempted (vLLM v0's priority
    preemption). Under fcfs the ranks are never read.
    """

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._copies: list[tuple[int, int]] = []
        # Each called, in order, with each step's work once scheduled (blocks reserved, before the forward
        # pass); what one raises surfaces inside Engine.step as a model failure would (faults.FaultInjector).
        self.fault_hooks: list[Callable[[SchedulerOutput], None]] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        """Into the waiting queue: at its rank's place (behind its equals) under priority, else at the tail,
        or at the head (`front`: a preempted sequence resumes first under fcfs)."""
        if self.config.by_priority:
            bisect.insort_right(self.waiting, seq, key=_rank)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        """This step's work: running decodes, then new prompts, then chunks of running prefills.

        New prompts come before the next chunk of a long prompt already running, so a request
        arriving during a long prefill waits about one step for its first token, not the whole
        prefill; the long prompt's chunk (full or nothing) goes on the step after.
        """
        out = SchedulerOutput()
        if self.config.by_priority:
            self._preempt_for_waiting(out)
        num_preempted = len(out.preempted)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, prefill=False)
        if len(out.preempted) == num_preempted:     # the running ones were short of blocks: admit nobody new
            budget = self._schedule_waiting(out, budget)
        self._schedule_running(out, budget, prefill=True)
        out.blocks_to_copy, self._copies = self._copies, []
        for hook in self.fault_hooks:
            hook(out)
        return out

    def park(self, seqs: Iterable[Sequence]) -> Parked:
        """Set `seqs` (those of them running) aside and hold the whole waiting queue back, so the next
        steps see only the other running sequences (engine/faults.py steps a batch without its suspects).
        Nothing is freed: a parked sequence keeps its blocks. `restore` puts them back."""
        ids = {id(seq) for seq in seqs}
        parked = Parked([seq for seq in self.running if id(seq) in ids],
                        {id(seq): i for i, seq in enumerate(self.running)}, self.waiting)
        self.running[:] = [seq for seq in self.running if id(seq) not in ids]
        self.waiting = deque()
        return parked

    def restore(self, parked: Parked) -> None:
        """Undo `park`: the parked sequences still running rejoin the running queue in their old order
        (one admitted meanwhile goes last); the held-back waiting queue goes behind any sequence
        preempted meanwhile. A parked sequence that finished meanwhile (aborted) stays out."""
        back = [seq for seq in parked.running if seq.status is SequenceStatus.RUNNING]
        last = len(parked.order)
        self.running[:] = sorted(self.running + back, key=lambda s: parked.order.get(id(s), last))
        for seq in parked.waiting:
            self._enqueue(seq)

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefill: bool) -> int:
        """Schedule the running sequences in decode (prefill=False) or in chunked prefill (True)."""
        already = {id(s) for s in out.seqs}   # admitted from waiting earlier in this step
        for seq in sorted(self.running, key=_rank) if self.config.by_priority else list(self.running):
            if seq.is_prefill != prefill or seq.status is not SequenceStatus.RUNNING or id(seq) in already:
                continue
            beams = seq.beam_group.beams if seq.in_beam_search and not prefill else [seq]
            if len(beams) > 1 and (seq is not beams[0] or not all(b.status is SequenceStatus.RUNNING
                                                                  and not b.is_prefill for b in beams)):
                continue        # a group decodes together, when all its beams are ready, from its first beam
            n = self._chunk(seq)
            if seq.draft_token_ids and (n > budget or not self._reserve(seq, n)):
                seq.draft_token_ids, n = [], 1     # drafts never cost another row its place or its blocks
            if n * len(beams) > budget:  # a full chunk or nothing: never a budget-shaped chunk
                continue
            if not all(self._reserve_or_preempt(b, n, out, beams) for b in beams):
                if seq.status is SequenceStatus.RUNNING:
                    break       # nothing left to preempt
                continue        # seq itself was preempted
            for b in beams:
                out.seqs.append(b)
                out.num_scheduled_tokens.append(n)
                already.add(id(b))
            budget -= n * len(beams)
        return budget

    def _reserve_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput,
                            keep: list[Sequence] | None = None) -> bool:
        """Reserve blocks for `n` more tokens of `seq`, preempting the latest-arrived sequences not
        already scheduled this step (nor in `keep`, seq's beam group) while short; the last resort is seq
        itself (with its group). Under priority the victim is the worst-ranked of those and seq, so seq goes
        first when none ranks below it. False when seq had to go, or no victim is left."""
        keep_ids = {id(b) for b in keep or []}
        while not self._reserve(seq, n):
            scheduled = {id(s) for s in out.seqs}
            victims = [s for s in self.running if id(s) not in scheduled and id(s) not in keep_ids]
            own = [s for s in self.running if s is seq]
            if self.config.by_priority:
                victims = [max(victims + own, key=_rank)] if victims or own else []
            victims = victims or own
            if not victims:
                return False
            out.preempted.extend(self._preempt(victims[-1]))
            if seq.status is not SequenceStatus.RUNNING:
                return False
        return True

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Priority: while the best-ranked waiting sequence (with its beam group) lacks the KV blocks of its
        first chunk or a seat, preempt the worst-ranked running sequence ranked strictly below it. The
        preempted go back to the waiting queue behind it; nothing is scheduled yet."""
        head = next((s for s in self.waiting if s.status is SequenceStatus.WAITING and not s.waiting_for_grammar),
                    None)
        adapters = {s.adapter.key for s in self.running if s.adapter is not None}
        if head is None or not self._adapter_fits(head, adapters):   # it would stay out after the preemption
            return
        group = head.beam_group.beams if head.in_beam_search else [head]
        while not self._fits(group):
            worse = [s for s in self.running if _rank(s) > _rank(head)]
            if not worse:
                return
            out.preempted.extend(self._preempt(max(worse, key=_rank)))

    def _fits(self, group: list[Sequence]) -> bool:
        """Whether waiting `group` has the seats and the free KV blocks (after its prefix-cache hits) for its
        first chunks, as _admit_all would give them. Changes nothing but the members' block hashes."""
        seats = sum(_seats(s) for s in self.running) + sum(_seats(b) for b in group)
        if seats > self.config.max_num_seqs:
            return False
        block_size, missing, hits = self.allocator.block_size, 0, set()
        for seq in group:
            cached = self._cached_prefix(seq)
            n = min(self._remaining(seq, len(cached) * block_size), self.config.prefill_chunk_size)
            missing += num_blocks_needed(len(cached) * block_size + n, block_size) - len(cached)
            hits.update(cached)
        return missing <= self.allocator.num_free_after_attach(list(hits))

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences in queue order (FIFO, or rank order under priority) while the batch, the
        budget and the KV cache allow."""
        seats = sum(_seats(s) for s in self.running)
        adapters = {s.adapter.key for s in self.running if s.adapter is not None}
        for seq in list(self.waiting):
            if budget <= 0 or seats >= self.config.max_num_seqs:
                break
            if seq.waiting_for_grammar or seq.status is not SequenceStatus.WAITING:
                continue   # skipped until its grammar compiles (holding no blocks); or admitted with its group
            if not self._adapter_fits(seq, adapters):
                continue   # max_loras adapters run already: it waits for one of theirs to finish (vLLM's rule)
            group = seq.beam_group.beams if seq.in_beam_search else [seq]
            if seats + sum(_seats(b) for b in group) > self.config.max_num_seqs:
                break
            admitted = self._admit_all(group, budget)
            if admitted is None:
                break
            for member, n in zip(group, admitted):
                self.waiting.remove(member)
                member.status = SequenceStatus.RUNNING
                self.running.append(member)
                if n:
                    out.seqs.append(member)
                    out.num_scheduled_tokens.append(n)
            budget -= sum(admitted)
            seats += sum(_seats(b) for b in group)
            if seq.adapter is not None:
                adapters.add(seq.adapter.key)
        return budget

    def _adapter_fits(self, seq: Sequence, running_adapters: set[bytes]) -> bool:
        """Whether `seq` may join the step: the base, an adapter already running, or room for one more
        (config.max_loras distinct adapters in one step)."""
        limit = self.config.max_loras
        return (seq.adapter is None or limit is None or seq.adapter.key in running_adapters
                or len(running_adapters) < limit)

    def _admit_all(self, group: list[Sequence], budget: int) -> list[int] | None:
        """Admit every sequence of `group` (one sequence, or a preempted beam group) with its first chunk,
        within `budget` tokens; their chunk sizes, or None (nothing changes) when they do not all fit."""
        admitted: list[int] = []
        for seq in group:
            hits = self._cached_prefix(seq)
            n = min(self._remaining(seq, len(hits) * self.allocator.block_size), self.config.prefill_chunk_size)
            if sum(admitted) + n > budget or not self._admit(seq, hits, n):
                for done in group[:len(admitted)]:
                    self._release(done)
                    done.num_computed_tokens = done.num_cached_tokens = 0
                return None
            admitted.append(n)
        return admitted

    @staticmethod
    def _remaining(seq: Sequence, num_computed: int) -> int:
        """Tokens left to compute before the sequence's next sample; a forked beam leaves its last token for
        the step its whole group decodes together."""
        return seq.num_tokens - num_computed - (1 if seq.in_beam_search else 0)

    def _uses_prefix_cache(self, seq: Sequence) -> bool:
        return self.config.enable_prefix_caching and not seq.params.prompt_logprobs

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of a waiting `seq` (full blocks only, none of them
        holding its last token), or [] when it does not use the cache. Changes nothing but seq's hashes."""
        if not self._uses_prefix_cache(seq):
            return []
        num_blocks = (seq.num_tokens - 1) // self.allocator.block_size
        return self.allocator.match_prefix(self._block_hashes(seq, num_blocks))

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        if len(seq.block_hashes) >= num_blocks:   # all_token_ids copies: build it only when needed
            return seq.block_hashes[:num_blocks]
        salt = seq.adapter.key if seq.adapter is not None else None      # two adapters never share cached K/V
        images = seq.params.multimodal.images if seq.params.multimodal is not None else ()
        extras = image_block_keys(images, self.allocator.block_size) if images else None   # nor two pictures
        return extend_block_hashes(seq.block_hashes, seq.all_token_ids, self.allocator.block_size, num_blocks, salt,
                                   extras)

    def _admit(self, seq: Sequence, hits: list[int], n: int) -> bool:
        """Give a waiting `seq` the cached blocks `hits` plus new blocks for its next `n` tokens;
        False (nothing changes) when the free blocks do not cover that."""
        block_size = self.allocator.block_size
        num_hit_tokens = len(hits) * block_size
        missing = num_blocks_needed(num_hit_tokens + n, block_size) - len(hits)
        if missing > self.allocator.num_free_after_attach(hits):
            return False
        self.allocator.attach(hits)
        seq.block_table = hits + self.allocator.allocate(missing)
        seq.num_computed_tokens = seq.num_cached_tokens = num_hit_tokens
        seq.num_cached_blocks = len(hits)
        if self._uses_prefix_cache(seq):
            self.allocator.prefix_cache_stats.record(seq.num_tokens, num_hit_tokens)
        return True

    def _cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the full blocks `seq` has finished computing since the last call."""
        num_full = seq.num_computed_tokens // self.allocator.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            self.allocator.cache_block(seq.block_table[i], hashes[i])
        seq.num_cached_blocks = num_full

    def _chunk(self, seq: Sequence) -> int:
        """This step's tokens for `seq`: 1 in decode, else the next fixed-size prefill chunk."""
        if not seq.is_prefill:
            return 1 + len(seq.draft_token_ids)        # the last token, then the drafts it verifies
        return min(self._remaining(seq, seq.num_computed_tokens), self.config.prefill_chunk_size)

    def _reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` blocks for num_computed_tokens + num_new_tokens tokens; False (nothing taken) if short.

        Copy-on-write: when the block the first new token goes into is shared (a forked beam's partial
        block), seq takes a fresh block, queued to receive the shared one's contents before the forward.
        Only that block can be shared: a fork shares exactly its parent's computed blocks.
        """
        block_size = self.allocator.block_size
        missing = max(num_blocks_needed(seq.num_computed_tokens + num_new_tokens, block_size) - len(seq.block_table), 0)
        first = seq.num_computed_tokens // block_size
        shared = first < len(seq.block_table) and self.allocator.ref_count(seq.block_table[first]) > 1
        if not missing and not shared:
            return True
        blocks = self.allocator.allocate(missing + shared)
        if blocks is None:
            return False
        if shared:
            src, dst = seq.block_table[first], blocks.pop()
            self.allocator.free([src])
            seq.block_table[first] = dst
            self._copies.append((src, dst))
        seq.block_table.extend(blocks)
        return True

    def _preempt(self, seq: Sequence) -> list[Sequence]:
        """Preempt `seq` by recompute (with its whole beam group); returns the preempted sequences."""
        group = seq.beam_group.beams if seq.in_beam_search else [seq]
        for member in reversed(group) if not self.config.by_priority else group:   # kept in the group's order
            self.running.remove(member)
            self._release(member)
            member.num_computed_tokens = 0
            member.draft_token_ids = []
            member.status = SequenceStatus.WAITING
            self._enqueue(member, front=True)
        return list(group)

    def fork(self, parent: Sequence) -> Sequence:
        """A new running beam sharing all of `parent`'s blocks (reference counts +1) and copying its tokens,
        log probs and grammar state; it runs right after parent. The caller appends its own next token."""
        child = replace(parent, output_token_ids=list(parent.output_token_ids), block_table=list(parent.block_table),
                        block_hashes=list(parent.block_hashes), output_logprobs=list(parent.output_logprobs),
                        grammar=parent.grammar.fork() if parent.grammar is not None else None)
        self.allocator.share(child.block_table)
        self.running.insert(next(i for i, s in enumerate(self.running) if s is parent) + 1, child)
        return child

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
            seq.block_table = []
        seq.num_cached_blocks = 0

    def update_from_output(self, out: SchedulerOutput) -> None:
        """The step ran: every scheduled sequence now has its scheduled tokens in the KV cache, and
        the full blocks they completed join the prefix cache."""
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            seq.num_computed_tokens += n - len(seq.draft_token_ids)   # drafts count once accepted (settle_drafts)
            if self.config.enable_prefix_caching:
                self._cache_computed_blocks(seq)

    def settle_drafts(self, seq: Sequence) -> None:
        """After a step verified `seq`'s drafts and appended the tokens it accepted (and the one it chose after
        them): their K/V are computed, so every token but the new last one counts as computed; the blocks past
        the sequence's tokens (held only by rejected drafts' K/V) go back to the pool. The drafts are cleared.

            positions  c      c+1 .. c+a        c+a+1 .. c+k
            inputs     last   accepted drafts   rejected drafts (their K/V stale: released or overwritten later)
        """
        seq.draft_token_ids = []
        if seq.status is not SequenceStatus.RUNNING:
            return
        seq.num_computed_tokens = seq.num_tokens - 1
        if self.config.enable_prefix_caching:
            self._cache_computed_blocks(seq)
        keep = num_blocks_needed(seq.num_tokens, self.allocator.block_size)
        if len(seq.block_table) > keep:
            self.allocator.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence from either queue and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED


def _rank(seq: Sequence) -> tuple[int, float]:
    """Priority scheduling's order, best first: (priority, arrival time), as vLLM's."""
    return seq.params.priority, seq.arrival_time


def _seats(seq: Sequence) -> int:
    """max_num_seqs seats a sequence takes: a beam request's prompt holds them for all its future beams."""
    if seq.beam_group is not None and not seq.beam_group.started:
        return seq.params.num_beams
    return 1
