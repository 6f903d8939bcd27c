"""N-gram prompt lookup: drafts the tokens that followed the latest earlier occurrence of a row's last n tokens.

Owns the lookup over a sequence's prompt and output (vLLM's `ngram` method, llama.cpp's prompt lookup); leaves
which rows draft, and how many tokens, to speculator.py.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from lmi_handler.engine.sequence import Sequence


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens of `tokens`, for the
    longest n in [min_n, max_n] that occurs; [] when none does.

    tokens: (L,) int64, the sequence's context (prompt + output). An occurrence must end before the last token
    (it is earlier text, not the suffix itself), so at least one token follows it.
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:length - 1], n)            # (L - n, n): every earlier n-gram
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n                                    # the latest occurrence's continuation
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Prompt lookup over the prompt and the tokens so far (no model, no state between steps)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Each sequence's drafts, at most ks[i] tokens (possibly none)."""
        return [lookup(np.asarray(seq.prompt_token_ids + seq.output_token_ids, dtype=np.int64), k,
                       self.min_n, self.max_n) for seq, k in zip(seqs, ks)]

    def forget(self, seq: Sequence) -> None:
        """Nothing kept per sequence."""
