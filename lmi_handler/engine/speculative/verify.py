"""The verify rule's rows: a sequence verifying k drafts is sampled as k + 1 rows, one per position.

Owns VerifyRows (each sampling row's sequence, what it samples as, its drafts) and gathering their logits
from a step's ModelOutput. Row j of a verifying sequence samples exactly as the plain decode would at that
position if the drafts before it had been generated: its tables (penalties, logits controls, seeds keyed on
(seed, position), stop rules) are built from the sequence with drafts[:j] appended, and its grammar mask
from the matcher after drafts[:j]. The output processor then appends tokens while each equals its draft
(the longest agreeing prefix) plus the first that does not (or the one after all k): DESIGN §8.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmi_handler.engine.model_runner import ModelOutput
from lmi_handler.engine.sequence import Sequence


@dataclass
class VerifyRows:
    """A step's sampling rows when some sequence verifies drafts (rows in step order, a verifying sequence's
    1 + k rows together: position c + 1 + j is row first + j)."""

    owners: list[Sequence]             # each row's sequence (repeated over a verifying sequence's rows)
    views: list[Sequence]              # what each row samples as: its sequence with the drafts before it appended
    prefixes: list[list[int]]          # each row's drafts before it (a grammar consumes them before its mask)
    drafts: dict[int, list[int]]       # first row of each verifying sequence -> its drafts
    step_index: list[int]              # each due sequence's index in the step (ModelOutput's rows)


def expand_rows(seqs: list[Sequence], step_index: list[int]) -> VerifyRows:
    """The rows of the due sequences `seqs` (their indices in the step: `step_index`), drafts expanded."""
    owners, views, prefixes, drafts = [], [], [], {}
    for seq in seqs:
        if seq.draft_token_ids:
            drafts[len(owners)] = list(seq.draft_token_ids)
        for j in range(len(seq.draft_token_ids) + 1):
            prefix = seq.draft_token_ids[:j]
            owners.append(seq)
            prefixes.append(prefix)
            views.append(seq if not prefix else _view(seq, prefix))
    return VerifyRows(owners, views, prefixes, drafts, list(step_index))


def _view(seq: Sequence, prefix: list[int]) -> Sequence:
    """`seq` as it would stand with `prefix` generated: what a later row's sampling tables are built from."""
    return Sequence(seq.request_id, seq.prompt_token_ids, seq.params, output_token_ids=seq.output_token_ids + prefix,
                    grammar=seq.grammar, adapter=seq.adapter)


def gather_logits(model_out: ModelOutput, rows: VerifyRows) -> torch.Tensor:
    """(len(rows.owners), vocab) float32: each row's logits, a verifying sequence's draft rows (the runner's
    chunk logits for it) before its last row."""
    pieces, first = [], 0
    for index in rows.step_index:
        drafts = rows.drafts.get(first, ())
        if drafts:
            pieces.append(model_out.chunk_logits[index])                 # (k, vocab): positions c .. c+k-1
        pieces.append(model_out.logits[index:index + 1])                 # (1, vocab): position c+k
        first += 1 + len(drafts)
    return torch.cat(pieces)
