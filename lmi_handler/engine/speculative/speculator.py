"""Which rows draft each step, how many tokens, and what speculation achieved: the engine's one speculation object.

Owns the per-step decision (plain decode above disable_by_batch_size running sequences, for rows whose
acceptance stays low, for beam search and prefills), the drafts' bounds (max_new_tokens, the context, a
grammar's valid prefix), the acceptance counts (metrics) and settling each verified row; leaves drafting to a
proposer (ngram.py, draft.py) and the verify rule to verify.py and the output processor.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

from lmi_handler.config import SpeculativeConfig
from lmi_handler.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

LOW_ACCEPTANCE = 0.2       # a row accepting fewer of its drafts than this ...
LOW_ACCEPTANCE_AFTER = 16  # ... once it has drafted this many tokens ...
LOW_ACCEPTANCE_PAUSE = 16  # ... decodes plainly for this many steps, then drafts again with fresh counts


@dataclass
class SpecDecodeStats:
    """Running totals since start, vLLM's spec_decode counters: drafts (a row verifying >= 1 drafted token in
    a step), drafted tokens, accepted tokens, and accepted tokens by draft position (0 = the first drafted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying row emits per step on average: 1 + accepted / drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _RowRecord:
    drafted: int = 0
    accepted: int = 0
    paused_until: int = 0       # the step count from which it drafts again


class Speculator:
    """Drafts for the running decode rows before the scheduler runs, settles them after the step."""

    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int):
        self.config, self.proposer, self.max_model_len = config, proposer, max_model_len
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._records: weakref.WeakKeyDictionary[Sequence, _RowRecord] = weakref.WeakKeyDictionary()
        self._drafting: list[Sequence] = []
        self._step = 0

    def propose(self, running: list[Sequence]) -> None:
        """Give each running decode row that may draft this step its drafts (seq.draft_token_ids); none at all
        above disable_by_batch_size running sequences."""
        self._step += 1
        self._clear()
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        rows, ks = [], []
        for seq in running:
            k = self._room(seq)
            if k > 0:
                rows.append(seq)
                ks.append(k)
        if not rows:
            return
        for seq, drafts in zip(rows, self.proposer.propose(rows, ks)):
            drafts = self._grammar_prefix(seq, drafts[:self._room(seq)])
            if drafts:
                seq.draft_token_ids = drafts
                self._drafting.append(seq)

    def _room(self, seq: Sequence) -> int:
        """Tokens `seq` may draft this step: 0 unless a plain running decode row (no beams) not paused for low
        acceptance; at most k, and at most the tokens it may still generate less the one the step always adds."""
        if (seq.status is not SequenceStatus.RUNNING or seq.num_tokens - seq.num_computed_tokens != 1
                or seq.beam_group is not None or seq.waiting_for_grammar or seq.finish_reason is not None):
            return 0
        record = self._records.get(seq)
        if record is not None and record.paused_until > self._step:
            return 0
        limit = min(seq.params.max_new_tokens, self.max_model_len - seq.num_prompt_tokens)
        return max(0, min(self.config.num_speculative_tokens, limit - seq.num_output_tokens - 1))

    @staticmethod
    def _grammar_prefix(seq: Sequence, drafts: list[int]) -> list[int]:
        """A constrained row's drafts cut to what its grammar accepts, before any end id (eos, stop ids): the
        verify rows' masks come from the matcher advanced through the drafts before them."""
        if seq.grammar is None or not drafts:
            return drafts
        end = next((i for i, t in enumerate(drafts) if t in seq.grammar.end_ids), len(drafts))
        drafts = drafts[:end]
        return drafts[:seq.grammar.matcher.validate_tokens(drafts)] if drafts else drafts

    def settle(self, accepted: dict[int, int], scheduler) -> None:
        """After the step's tokens were appended: count each verifying row's accepted drafts (`accepted`:
        id(seq) -> how many of its drafts it kept), and settle every row that drafted (scheduler.settle_drafts:
        computed tokens, blocks of rejected drafts freed, drafts cleared)."""
        for seq in self._drafting:
            drafted = len(seq.draft_token_ids)
            kept = accepted.get(id(seq))
            if drafted and kept is not None:
                self._count(seq, drafted, kept)
            scheduler.settle_drafts(seq)
        self._drafting = []

    def _count(self, seq: Sequence, drafted: int, kept: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += drafted
        stats.num_accepted_tokens += kept
        for pos in range(kept):
            stats.accepted_per_pos[pos] += 1
        record = self._records.setdefault(seq, _RowRecord())
        record.drafted += drafted
        record.accepted += kept
        if record.drafted >= LOW_ACCEPTANCE_AFTER and record.accepted < LOW_ACCEPTANCE * record.drafted:
            self._records[seq] = _RowRecord(paused_until=self._step + 1 + LOW_ACCEPTANCE_PAUSE)

    def _clear(self) -> None:
        """Drafts of a step that never settled (it failed): dropped, nothing was counted for them."""
        for seq in self._drafting:
            seq.draft_token_ids = []
        self._drafting = []

    def forget(self, seq: Sequence) -> None:
        """A sequence left (finished or aborted): the proposer's state for it goes."""
        self.proposer.forget(seq)
