"""A draft model: a smaller checkpoint (same tokenizer) drafting greedily, batched over the step's drafting rows.

Owns the draft's ModelRunner, its own paged KV cache and block pool, and a shadow Sequence per target sequence
(the draft's view: its computed tokens and block table); leaves which rows draft and how many tokens to
speculator.py. Drafts need not be good for the output to be right (verify.py decides what is kept): only fast.
"""
from __future__ import annotations

import weakref
from pathlib import Path

from lmi_handler.engine.kv_cache import BlockAllocator, num_blocks_needed
from lmi_handler.engine.model.kernels import row_argmax
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import SamplingParams, Sequence, SequenceStatus


class DraftModelProposer:
    """Drafts k tokens per row with k forwards of the draft model (the first also computes the tokens the draft
    has not seen yet: the prompt on a row's first step, then the tokens accepted since)."""

    def __init__(self, runner):
        self.runner = runner
        self.allocator = BlockAllocator(runner.num_blocks, runner.block_size)
        self._shadows: weakref.WeakKeyDictionary[Sequence, Sequence] = weakref.WeakKeyDictionary()

    @classmethod
    def load(cls, path: Path, target, config) -> "DraftModelProposer":
        """The draft checkpoint at `path` on the target runner's device, dtype, quantization and block size, with
        as many KV blocks as the target (every sequence drafting holds at most its own length in them)."""
        from lmi_handler.engine.model_runner import ModelRunner

        runner = ModelRunner(path, target.dtype, target.device, block_size=target.block_size,
                             num_blocks=target.num_blocks, huge_pages=config.huge_pages, quantize=target.quantize,
                             kernel_backend=config.kernel_backend)
        return cls(runner)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Each sequence's drafts, ks[i] greedy tokens of the draft model (none for a row whose draft KV blocks
        run out)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        shadows = [self._sync(seq) for seq in seqs]
        rows = [i for i, (shadow, k) in enumerate(zip(shadows, ks)) if self._reserve(shadow, k)]
        for step in range(max((ks[i] for i in rows), default=0)):
            rows = [i for i in rows if ks[i] > step]
            batch = [shadows[i] for i in rows]
            counts = [s.num_tokens - s.num_computed_tokens for s in batch]
            out = self.runner.execute(self.runner.prepare(SchedulerOutput(batch, counts)))
            # host sync: the drafted ids feed the next forward's input and the verify step
            tokens = row_argmax(out.logits).tolist()
            for i, shadow, n, token in zip(rows, batch, counts, tokens):
                shadow.num_computed_tokens += n
                shadow.output_token_ids.append(token)
                drafts[i].append(token)
        return drafts

    def _sync(self, seq: Sequence) -> Sequence:
        """`seq`'s shadow with seq's tokens: what the draft computed of them stays (up to the first token its
        own drafts got wrong), the rest is computed by the next forward."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = self._shadows[seq] = Sequence(seq.request_id, seq.prompt_token_ids, SamplingParams(),
                                                   status=SequenceStatus.RUNNING)
        same = 0
        for ours, theirs in zip(shadow.output_token_ids, seq.output_token_ids):
            if ours != theirs:
                break
            same += 1
        shadow.output_token_ids = list(seq.output_token_ids)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, seq.num_prompt_tokens + same,
                                         shadow.num_tokens - 1)
        return shadow

    def _reserve(self, shadow: Sequence, k: int) -> bool:
        """Blocks for the shadow's tokens and its k - 1 drafts fed back; False (nothing taken) when short."""
        missing = num_blocks_needed(shadow.num_tokens + k - 1, self.allocator.block_size) - len(shadow.block_table)
        if missing <= 0:
            return True
        blocks = self.allocator.allocate(missing)
        if blocks is None:
            return False
        shadow.block_table.extend(blocks)
        return True

    def forget(self, seq: Sequence) -> None:
        """Free `seq`'s shadow and its draft KV blocks (the sequence finished, or left)."""
        shadow = self._shadows.pop(seq, None)
        if shadow is not None and shadow.block_table:
            self.allocator.free(shadow.block_table)
            shadow.block_table = []
