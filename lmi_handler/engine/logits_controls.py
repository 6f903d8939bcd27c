"""Per-request logits controls as batch tensor ops: logit_bias, bad words, min_tokens, allowed ids, token bitmasks.

Owns LogitsControls (a step's control tables, built from its rows' SamplingParams and advanced on the device
in steady decode) and the bitmask ops grammars share; leaves penalties and sampling to sampler.py and the
grammar matchers that fill bitmasks to grammar.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lmi_handler.engine.model.kernels import built_kernels
from lmi_handler.engine.sequence import Sequence
from lmi_handler.engine.stopping import row_stop_ids

NEG_INF = float("-inf")


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: 32 token ids per word, bit j of word w = token 32 * w + j (1 = allowed)."""
    return (vocab_size + 31) // 32


def token_ids_to_bitmask(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """(bitmask_words(vocab_size),) int32 on CPU with the bits of `token_ids` set (ids must be < vocab_size)."""
    bits = torch.zeros(bitmask_words(vocab_size) * 32, dtype=torch.bool)
    bits[torch.tensor(token_ids, dtype=torch.int64)] = True
    weights = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int64)   # int32 bit 31 is the sign
    return (bits.view(-1, 32).long() * weights).sum(dim=1).to(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, W) int32 bitmask rows -> (N, vocab_size) bool, True = allowed. Ids past 32 * W are not allowed.

    Pure PyTorch (the reference and the one path): a shift and an `and` per bit, on bitmask's device.
    """
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).view(bitmask.shape[0], -1).bool()   # (N, 32 W)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(bits.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


_BYTE_PENALTIES: dict[torch.device, torch.Tensor] = {}


def bitmask_penalties(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, W) int32 bitmask -> (N, vocab_size) float32: 0.0 where allowed, -inf elsewhere (ids past 32 * W too).

    A lookup of 8 values per mask byte (little-endian words: byte k of word w holds ids 32 w + 8 k ..), about
    twice as fast on CPU as unpacking bit by bit and masked_fill (measured: 9 vs 30 ms of one thread's CPU time
    for 64 rows of the demo vocabulary). unpack_bitmask is the reference it is tested against.
    """
    table = _BYTE_PENALTIES.get(bitmask.device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1                     # (256, 8)
        table = torch.where(bits.bool(), 0.0, NEG_INF).to(bitmask.device, non_blocking=True)
        _BYTE_PENALTIES[bitmask.device] = table
    penalties = table[bitmask.view(torch.uint8).int()].view(bitmask.shape[0], -1)     # (N, 32 W)
    if penalties.shape[1] >= vocab_size:
        return penalties[:, :vocab_size]
    pad = torch.full((penalties.shape[0], vocab_size - penalties.shape[1]), NEG_INF, device=penalties.device)
    return torch.cat([penalties, pad], dim=1)


def apply_token_bitmask_reference(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> torch.Tensor:
    """apply_token_bitmask in pure PyTorch, the definition the fast paths are tested against: every token the
    bitmask does not allow (ids past 32 * W included) set to -inf, the others untouched. Returns logits."""
    banned = ~unpack_bitmask(bitmask, logits.shape[1])
    if rows is None:
        return logits.masked_fill_(banned, NEG_INF)
    logits[rows] = logits[rows].masked_fill(banned, NEG_INF)
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token the bitmask does not allow, in place, over the rows given; allowed ones keep
    their value.

    logits: (B, V) float32; rows: (N,) int64 row indices (None = every row, N = B); bitmask: (N, W) int32 on
    logits' device. The mask covers the full logits width: ids past the bitmask (a padded vocabulary) are masked.
    Returns logits.

    On CPU, once the engine's C++ kernels are built (kernels.built_kernels; bitmask.h), -inf is written
    straight from the bits (no (N, V) float mask: measured 1.8 vs 14 ms of one thread's CPU time for 64 random rows of the demo vocabulary
    on the loaded 2-core host); otherwise the byte-lookup penalties are added (x + 0.0 = x, x + -inf =
    -inf: the same values for finite logits). apply_token_bitmask_reference is the reference for both.
    """
    module = built_kernels()
    if module is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 \
            and logits.stride(1) == 1:
        empty = torch.empty(0, dtype=torch.int64)
        return module.mask_logits_(logits, empty if rows is None else rows.cpu(), bitmask.contiguous())
    penalties = bitmask_penalties(bitmask, logits.shape[1])
    if rows is None:
        return logits.add_(penalties)
    logits.index_add_(0, rows, penalties)
    return logits


@dataclass
class LogitsControls:
    """The step's logits controls as device tensors, B = rows of the step's logits.

    Sparse per-row entries: one `index_put_(accumulate=True)` adds every logit_bias value and a -inf for each
    active ban, so no Python touches a row per step. A bad word's last id is banned when its prefix ends the
    row's context (`recent`, the last W context tokens, right-aligned, -1 before the context starts); a
    min_tokens ban (eos ids unless ignore_eos, and stop_token_ids) is active while the row's output position
    is below its min_tokens. allowed_token_ids rows carry a static bitmask.
    """

    bias_rows: torch.Tensor      # (Nb,) int64
    bias_ids: torch.Tensor       # (Nb,) int64
    bias_values: torch.Tensor    # (Nb,) float32
    ban_rows: torch.Tensor       # (E,) int64: bad-word entries
    ban_ids: torch.Tensor        # (E,) int64: the id each entry bans
    ban_prefix: torch.Tensor     # (E, W) int64: the ids before it, right-aligned (padding ignored)
    ban_care: torch.Tensor       # (E, W) bool: which prefix columns are real
    recent: torch.Tensor | None  # (B, W) int64: each row's last W context tokens; None when W == 0
    min_rows: torch.Tensor       # (M,) int64: min_tokens entries
    min_ids: torch.Tensor        # (M,) int64
    min_counts: torch.Tensor     # (M,) int64: the row's min_tokens
    allowed_rows: torch.Tensor | None    # (A,) int64 rows with allowed_token_ids
    allowed_bitmask: torch.Tensor | None  # (A, W) int32

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], vocab_size: int, eos_token_ids: tuple[int, ...],
                       device: torch.device) -> "LogitsControls | None":
        """The controls of these rows, in batch order; None when no row uses any (the sampler skips them)."""
        params = [s.params for s in seqs]
        if not any(p.logit_bias or p.bad_words or p.min_tokens or p.allowed_token_ids is not None for p in params):
            return None
        bias = [(r, t, v) for r, p in enumerate(params) for t, v in p.logit_bias]
        bans = [(r, word) for r, p in enumerate(params) for word in p.bad_words]
        width = max((len(word) - 1 for _, word in bans), default=0)
        mins = [(r, t, p.min_tokens) for r, (p, s) in enumerate(zip(params, seqs)) if p.min_tokens
                for t, _ in row_stop_ids(s, eos_token_ids)]
        prefix = [[-1] * (width - len(w) + 1) + list(w[:-1]) for _, w in bans]
        allowed = [r for r, p in enumerate(params) if p.allowed_token_ids is not None]

        def ints(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        prefix_t = torch.tensor(prefix, dtype=torch.int64).reshape(len(bans), width)
        return cls(
            bias_rows=ints([b[0] for b in bias]), bias_ids=ints([b[1] for b in bias]),
            bias_values=torch.tensor([b[2] for b in bias], dtype=torch.float32).to(device, non_blocking=True),
            ban_rows=ints([r for r, _ in bans]), ban_ids=ints([w[-1] for _, w in bans]),
            ban_prefix=prefix_t.to(device, non_blocking=True),
            ban_care=(prefix_t >= 0).to(device, non_blocking=True),
            recent=_recent(seqs, width, device) if width else None,
            min_rows=ints([m[0] for m in mins]), min_ids=ints([m[1] for m in mins]),
            min_counts=ints([m[2] for m in mins]),
            allowed_rows=ints(allowed) if allowed else None,
            allowed_bitmask=torch.stack([token_ids_to_bitmask(list(params[r].allowed_token_ids), vocab_size)
                                         for r in allowed]).to(device, non_blocking=True) if allowed else None)

    def advanced(self, token_ids: torch.Tensor) -> "LogitsControls":
        """The same rows one step later, each row i having gained token_ids[i] ((B,) int64): device work only."""
        if self.recent is None:
            return self
        return replace(self, recent=torch.cat([self.recent[:, 1:], token_ids[:, None]], dim=1))

    def apply(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply every control to (B, V) float32 logits (or log-probs, for beam rows), in place; returns logits.

        positions: (B,) int64 output index of the token being chosen (min_tokens compares it). Order (vLLM's):
        allowed_token_ids, bad words, min_tokens, logit_bias; the bans and the biases are one accumulate.
        """
        if self.allowed_rows is not None:
            apply_token_bitmask(logits, self.allowed_rows, self.allowed_bitmask)
        values = [self.bias_values]
        if self.ban_rows.numel():
            if self.recent is None:
                matched = torch.ones_like(self.ban_rows, dtype=torch.bool)
            else:
                matched = ((self.recent.index_select(0, self.ban_rows) == self.ban_prefix) | ~self.ban_care).all(dim=1)
            values.append(torch.where(matched, NEG_INF, 0.0))
        if self.min_rows.numel():
            active = positions.index_select(0, self.min_rows) < self.min_counts
            values.append(torch.where(active, NEG_INF, 0.0))
        rows = torch.cat([self.bias_rows, self.ban_rows, self.min_rows])
        if rows.numel():
            ids = torch.cat([self.bias_ids, self.ban_ids, self.min_ids])
            # adding 0.0 leaves a logit as it is, -inf bans it; each (row, id) sum depends on its own row only
            logits.index_put_((rows, ids), torch.cat(values), accumulate=True)
        return logits


def _recent(seqs: list[Sequence], width: int, device: torch.device) -> torch.Tensor:
    """(B, width) int64: each row's last `width` context tokens, right-aligned, -1 where the context is shorter."""
    rows = []
    for seq in seqs:   # host-side packing of a few ids per row, only when the composition changes
        tail = (seq.prompt_token_ids + seq.output_token_ids)[-width:]
        rows.append([-1] * (width - len(tail)) + tail)
    return torch.tensor(rows, dtype=torch.int64).reshape(len(seqs), width).to(device, non_blocking=True)
