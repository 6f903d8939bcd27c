"""When a sequence stops: eos / stop token ids and max_new_tokens as batch tensor ops, stop strings on text.

Owns the stop-reason codes, the per-row stop-id table and StopStringMatcher (holds back text that may
start a stop string). Leaves sampling to sampler.py, token text to detokenizer.py, finishing to engine.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmi_handler.engine.model.kernels.build import built_kernels
from lmi_handler.engine.sequence import FinishReason, Sequence

# Codes returned by token_stop_reasons, (B,) int8.
STOP_NONE = 0      # go on
STOP_EOS = 1       # a model eos id (LMI finish_reason eos_token)
STOP_LENGTH = 2    # max_new_tokens reached (LMI finish_reason length)
STOP_TOKEN = 3     # a user stop_token_ids entry (LMI finish_reason stop_sequence)
STOP_ERROR = 4     # host side only: the grammar rejected the token (seq.error says why)

FINISH_REASONS: dict[int, FinishReason] = {
    STOP_EOS: FinishReason.EOS_TOKEN,
    STOP_LENGTH: FinishReason.LENGTH,
    STOP_TOKEN: FinishReason.STOP_SEQUENCE,
    STOP_ERROR: FinishReason.ERROR,
}


def build_stop_ids(seqs: list[Sequence], eos_token_ids: tuple[int, ...],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's stop-token set as a padded table.

    A row stops on the model's eos ids unless params.ignore_eos, and always on params.stop_token_ids
    (vLLM: stop_token_ids are honoured even with ignore_eos). An id that is both an eos id and a user
    stop id counts as eos. Returns (stop_ids (B, S) int64 padded with -1, is_eos (B, S) bool), S >= 1.
    """
    rows = [row_stop_ids(s, eos_token_ids) for s in seqs]
    width = max(1, max((len(r) for r in rows), default=0))
    rows = [row + [(-1, False)] * (width - len(row)) for row in rows]   # pad on the host, one tensor each
    stop_ids = torch.tensor([[tok for tok, _ in row] for row in rows], dtype=torch.int64).reshape(len(seqs), width)
    is_eos = torch.tensor([[eos for _, eos in row] for row in rows], dtype=torch.bool).reshape(len(seqs), width)
    return stop_ids.to(device, non_blocking=True), is_eos.to(device, non_blocking=True)


def row_stop_ids(seq: Sequence, eos_token_ids: tuple[int, ...]) -> list[tuple[int, bool]]:
    """[(token id, is eos)] for one sequence, eos ids first, no duplicates."""
    eos = () if seq.params.ignore_eos else tuple(dict.fromkeys(eos_token_ids))
    user = [t for t in dict.fromkeys(seq.params.stop_token_ids) if t not in eos]
    return [(t, True) for t in eos] + [(t, False) for t in user]


def token_stop_reasons(token_ids: torch.Tensor, stop_ids: torch.Tensor, num_output_tokens: torch.Tensor,
                       max_new_tokens: torch.Tensor, is_eos: torch.Tensor | None = None) -> torch.Tensor:
    """Why each row stops after the token just sampled, as tensor ops (no loop over rows).

    token_ids: (B,) int64 just sampled; stop_ids: (B, S) int64 padded with -1 (build_stop_ids);
    num_output_tokens: (B,) int64 counting the new token; max_new_tokens: (B,) int64;
    is_eos: (B, S) bool from build_stop_ids, or None to report every stop id as STOP_EOS.
    Returns (B,) int8: STOP_NONE, STOP_EOS, STOP_TOKEN or STOP_LENGTH. A stop token wins over length.
    On CPU with the C++ kernels built, their stop_reasons (vmath.h) gives the same codes in one call (a batch
    of a few rows spent more on these ops' dispatch than on their arithmetic); token_stop_reasons_reference
    is this function's tensor-op form, kept for other devices and as the test's reference.
    """
    module = built_kernels()
    if module is not None and token_ids.device.type == "cpu":
        return module.stop_reasons(token_ids, stop_ids, num_output_tokens, max_new_tokens, is_eos)
    return token_stop_reasons_reference(token_ids, stop_ids, num_output_tokens, max_new_tokens, is_eos)


def token_stop_reasons_reference(token_ids: torch.Tensor, stop_ids: torch.Tensor, num_output_tokens: torch.Tensor,
                                 max_new_tokens: torch.Tensor, is_eos: torch.Tensor | None = None) -> torch.Tensor:
    """token_stop_reasons as tensor ops (no loop over rows): any device."""
    hits = stop_ids == token_ids[:, None]                                             # (B, S) bool
    reasons = torch.where(num_output_tokens >= max_new_tokens, STOP_LENGTH, STOP_NONE)
    if is_eos is None:
        reasons = torch.where(hits.any(dim=1), STOP_EOS, reasons)
    else:
        reasons = torch.where((hits & ~is_eos).any(dim=1), STOP_TOKEN, reasons)
        reasons = torch.where((hits & is_eos).any(dim=1), STOP_EOS, reasons)
    return reasons.to(torch.int8)


@dataclass
class StopTable:
    """The per-row token stop rules of a batch, on the device: built once per batch composition.

    stop_ids / is_eos as build_stop_ids returns them; max_new_tokens is each row's length limit,
    params.max_new_tokens capped by the context (max_model_len - num_prompt_tokens).
    """

    stop_ids: torch.Tensor         # (B, S) int64, padded with -1
    is_eos: torch.Tensor           # (B, S) bool
    max_new_tokens: torch.Tensor   # (B,) int64

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], eos_token_ids: tuple[int, ...], max_model_len: int,
                       device: torch.device) -> "StopTable":
        stop_ids, is_eos = build_stop_ids(seqs, eos_token_ids, device)
        max_new = torch.tensor([min(s.params.max_new_tokens, max_model_len - s.num_prompt_tokens) for s in seqs],
                               dtype=torch.int64).to(device, non_blocking=True)
        return cls(stop_ids, is_eos, max_new)

    def reasons(self, token_ids: torch.Tensor, num_output_tokens: torch.Tensor) -> torch.Tensor:
        """(B,) int8 stop codes for the tokens just sampled; num_output_tokens (B,) int64 counts them."""
        return token_stop_reasons(token_ids, self.stop_ids, num_output_tokens, self.max_new_tokens, self.is_eos)


class StopStringMatcher:
    """Holds back text that may be the start of a stop string; releases text per token.

    Feed one generated token's text per add(); release() hands back the texts of the tokens whose
    fate is decided, one entry per token, in order. Invariants: ''.join(all released entries) ==
    self.text, and the number of entries == the number of add() calls once all are released.
    A match is the first stop string to complete as text arrives (earliest end; at equal ends the one
    starting first). Text from the stop string on is cut, or from its end on with include_stop_str_in_output.
    """

    def __init__(self, stop_sequences: tuple[str, ...], include_stop_str_in_output: bool):
        self.stops = tuple(s for s in dict.fromkeys(stop_sequences) if s)   # "" would match everywhere
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stops), default=0)
        self.matched = False
        self._released = ""            # text of the released tokens
        self._pending: list[str] = []  # texts of added tokens not yet released
        self._pending_text = ""        # ''.join(self._pending)

    @property
    def text(self) -> str:
        """Released text so far; final as soon as a stop string matched or after release(final=True)."""
        return self._released + (self._pending_text if self.matched else "")

    def add(self, text: str, search: bool = True) -> bool:
        """Append one generated token's text (may be ""). Returns True when a stop string matched.

        search=False appends without looking for a match ending in this text (vLLM min_tokens: no stop
        string ends before min_tokens tokens); a later search still finds one that started there.
        After a match the output is final: later add() calls only count tokens (their text is "").
        """
        if self.matched:
            self._pending.append("")
            return False
        search_from = max(0, len(self._pending_text) - self._max_stop_len + 1)
        self._pending.append(text)
        self._pending_text += text
        if not search:
            return False
        cut = self._find_stop(search_from)
        if cut is None:
            return False
        self._cut_pending(cut)
        self.matched = True
        return True

    def release(self, final: bool = False) -> list[str]:
        """Texts of the tokens newly decided since the last release, one entry per token, in order.

        A token is decided once no stop string can still start at or before its end, on a match, or
        when final=True (the sequence finished for another reason: everything held is released).
        """
        count = len(self._pending) if final or self.matched else self._count_safe_tokens()
        out, self._pending = self._pending[:count], self._pending[count:]
        self._pending_text = "".join(self._pending)
        self._released += "".join(out)
        return out

    def _find_stop(self, search_from: int) -> int | None:
        """Cut offset in the pending text of the first stop string to complete, or None.

        Only matches ending inside the newest token are new; earlier ones were found before. No match
        can start in released text: release() keeps every possible stop-string start pending.
        """
        best: tuple[int, int] | None = None   # (end, start)
        for stop in self.stops:
            start = self._pending_text.find(stop, search_from)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        if best is None:
            return None
        return best[0] if self.include_stop_str_in_output else best[1]

    def _cut_pending(self, cut: int) -> None:
        """Clip each pending token's text to the pending text before `cut` (later tokens get "")."""
        clipped, offset = [], 0
        for piece in self._pending:
            clipped.append(piece[: max(0, cut - offset)])
            offset += len(piece)
        self._pending = clipped
        self._pending_text = "".join(clipped)

    def _count_safe_tokens(self) -> int:
        """How many leading pending tokens end at or before the earliest possible stop-string start.

        The earliest start is that of the longest suffix of the pending text that is a proper prefix of
        a stop string (any future match must start there or later).
        """
        hold_from = len(self._pending_text) - self._longest_partial_suffix()
        count, end = 0, 0
        for piece in self._pending:
            end += len(piece)
            if end > hold_from:
                break
            count += 1
        return count

    def _longest_partial_suffix(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop string."""
        tail = self._pending_text
        longest = min(len(tail), self._max_stop_len - 1)
        for size in range(longest, 0, -1):
            suffix = tail[-size:]
            if any(stop.startswith(suffix) for stop in self.stops):
                return size
        return 0
