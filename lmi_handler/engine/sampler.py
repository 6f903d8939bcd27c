"""Vectorized logits processors and sampling with per-request seeds: SamplingMetadata, Sampler.

Owns penalties, temperature/top-k/top-p/min-p/typical-p, greedy and seeded sampling, log-probs and
top-n alternatives. Leaves the forward pass to model_runner.py, stop checks to stopping.py, text to detokenizer.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lmi_handler.engine.logits_controls import LogitsControls, apply_token_bitmask
from lmi_handler.engine.model.kernels import built_kernels, row_argmax
from lmi_handler.engine.sequence import SamplingParams, Sequence, wrap_int64

# ---------------------------------------------------------------------------------------------
# Counter-based noise. Per row: splitmix64 (Steele et al., "Fast splittable pseudorandom number
# generators") over (seed, position) in int64 ops, the (N,) part. Per (row, token): Wellons'
# lowbias32 mixer in int32 ops, the (N, V) part (int32 is ~2.5x faster than int64 on CPU; the row
# key is already well mixed). torch integer multiplication wraps; `>>` is arithmetic, so a logical
# shift right masks off the copied sign bits.
# ---------------------------------------------------------------------------------------------


def _wrap(x: int, bits: int) -> int:
    """A Python int reduced to the two's-complement value of `bits` bits with the same low bits."""
    return ((x + (1 << (bits - 1))) & ((1 << bits) - 1)) - (1 << (bits - 1))


_GAMMA64 = _wrap(0x9E3779B97F4A7C15, 64)   # splitmix64 increment (golden ratio)
_MIX64 = (_wrap(0xBF58476D1CE4E5B9, 64), _wrap(0x94D049BB133111EB, 64))
_GAMMA32 = _wrap(0x9E3779B9, 32)
_MIX32 = (_wrap(0x7FEB352D, 32), _wrap(0x846CA68B, 32))   # lowbias32 (Wellons, hash-prospector)


def _srl(x: torch.Tensor, shift: int, bits: int) -> torch.Tensor:
    """Logical shift right of an int64 (bits=64) or int32 (bits=32) tensor, 0 < shift < bits."""
    return (x >> shift) & ((1 << (bits - shift)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on an int64 tensor, any shape; bit-identical to the uint64 reference."""
    z = (z ^ _srl(z, 30, 64)) * _MIX64[0]
    z = (z ^ _srl(z, 27, 64)) * _MIX64[1]
    return z ^ _srl(z, 31, 64)


def mix32_(z: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int32 tensor, in place; bit-identical to the uint32 reference."""
    z.bitwise_xor_(_srl(z, 16, 32)).mul_(_MIX32[0])
    z.bitwise_xor_(_srl(z, 15, 32)).mul_(_MIX32[1])
    return z.bitwise_xor_(_srl(z, 16, 32))


def exponential_log_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log(E) with E ~ Exp(1) for each (row, token id), from a hash of (seed, position, token id).

    seeds, positions: (N,) int64 (any int64 values). Returns (N, vocab_size) float32, finite.
    The value for (row, token) depends only on that row's seed and position, never on the batch.
    Uniforms use 23 bits: u = (k + 0.5) / 2**23 lies strictly inside (0, 1) and is exact in float32,
    so E = -log(u) > 0 and log(E) is finite.
    """
    row_key = mix64(mix64(seeds + _GAMMA64) + positions * _GAMMA64)                   # (N,) int64
    row_key = (row_key >> 32).to(torch.int32)                                        # high half, (N,) int32
    token_key = torch.arange(1, vocab_size + 1, dtype=torch.int32, device=seeds.device) * _GAMMA32
    bits = mix32_(row_key[:, None] + token_key[None, :])                             # (N, V) int32
    u = (_srl(bits, 9, 32).to(torch.float32) + 0.5) * (2.0 ** -23)                   # (N, V) in (0, 1)
    return u.log_().neg_().log_()


# ---------------------------------------------------------------------------------------------
# Batch metadata
# ---------------------------------------------------------------------------------------------


@dataclass
class SamplingMetadata:
    """Per-row sampling knobs of one step as device tensors (B = rows of the logits).

    Greedy rows carry neutral sampling knobs (temperature 1.0, top_k 0, top_p 1.0, min_p 0.0,
    typical_p 1.0): only penalties apply to them. Token-id tensors are padded with vocab_size,
    an id no real token has. The fields after `no_penalties` are host-side facts that let the
    sampler skip work without a host-device sync; left at their defaults, the sampler computes
    them from the tensors (with a sync).
    """

    greedy: torch.Tensor               # (B,) bool
    temperature: torch.Tensor          # (B,) float32, 1.0 on greedy rows
    top_k: torch.Tensor                # (B,) int64, LMI schema: 0 = off
    top_p: torch.Tensor                # (B,) float32, 1.0 = off
    min_p: torch.Tensor                # (B,) float32, 0.0 = off
    typical_p: torch.Tensor            # (B,) float32, 1.0 = off
    repetition_penalty: torch.Tensor   # (B,) float32, 1.0 = off
    presence_penalty: torch.Tensor     # (B,) float32, 0.0 = off
    frequency_penalty: torch.Tensor    # (B,) float32, 0.0 = off
    seeds: torch.Tensor                # (B,) int64, any value (negative ok)
    positions: torch.Tensor            # (B,) int64, output index of the token being sampled
    prompt_token_ids: torch.Tensor | None   # (B, Lp) int64 padded with vocab_size
    output_token_ids: torch.Tensor | None   # (B, Lo) int64 padded with vocab_size
    max_top_n: int                     # max top_n_tokens over rows, 0 = none
    all_greedy: bool
    no_penalties: bool
    sampled_rows: torch.Tensor | None = None   # (Ns,) int64 row indices of sampled rows
    greedy_rows: torch.Tensor | None = None    # (Ng,) int64 row indices of greedy rows
    max_top_k: int | None = None               # max top_k over sampled rows (0 = no row uses it)
    use_top_p: bool = True                     # some sampled row has top_p < 1
    use_min_p: bool = True                     # some sampled row has min_p > 0
    use_typical_p: bool = True                 # some sampled row has typical_p < 1
    controls: LogitsControls | None = None     # logit_bias, bad words, min_tokens, allowed ids (None = no row)
    # this step's grammar masks (engine/grammar.py), set per step: rows (Ng,) int64, bitmask (Ng, W) int32
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], vocab_size: int, device: torch.device,
                       eos_token_ids: tuple[int, ...] = ()) -> "SamplingMetadata":
        """Build the step's metadata from the sequences, in batch order.

        Reads seq.params (a seed of None counts as 0: the engine fills seeds of sampled rows at
        admission), seq.prompt_token_ids and seq.output_token_ids. Token-id tensors are built only
        when some row has a penalty that reads them. Knobs travel to `device` in one float and one
        int transfer. `eos_token_ids` are the model's, for min_tokens (banned until then unless ignore_eos).
        """
        params = [s.params for s in seqs]
        knobs = [_knobs(p) for p in params]                   # (temperature, top_k, top_p, min_p, typical_p)
        floats = torch.tensor([[k[0], k[2], k[3], k[4], p.repetition_penalty, p.presence_penalty,
                                p.frequency_penalty] for k, p in zip(knobs, params)], dtype=torch.float32)
        ints = torch.tensor([[k[1], wrap_int64(p.seed or 0), s.num_output_tokens, int(p.greedy)]
                             for k, p, s in zip(knobs, params, seqs)], dtype=torch.int64)
        floats = floats.reshape(len(seqs), 7).T.contiguous().to(device, non_blocking=True)   # (7, B)
        ints = ints.reshape(len(seqs), 4).T.contiguous().to(device, non_blocking=True)       # (4, B)
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_out = use_rep or any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        sampled = [k for k, p in zip(knobs, params) if not p.greedy]
        is_greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool)
        rows = torch.arange(len(seqs), dtype=torch.int64)
        return cls(
            greedy=ints[3].bool(), temperature=floats[0], top_k=ints[0], top_p=floats[1], min_p=floats[2],
            typical_p=floats[3], repetition_penalty=floats[4], presence_penalty=floats[5],
            frequency_penalty=floats[6], seeds=ints[1], positions=ints[2],
            prompt_token_ids=_pad([s.prompt_token_ids for s in seqs], vocab_size, device) if use_rep else None,
            output_token_ids=_pad([s.output_token_ids for s in seqs], vocab_size, device) if use_out else None,
            max_top_n=max((p.top_n_tokens for p in params), default=0),
            all_greedy=not sampled, no_penalties=not use_out,
            sampled_rows=rows[~is_greedy].to(device, non_blocking=True),
            greedy_rows=rows[is_greedy].to(device, non_blocking=True),
            max_top_k=max((k[1] for k in sampled), default=0),
            use_top_p=any(k[2] < 1.0 for k in sampled), use_min_p=any(k[3] > 0.0 for k in sampled),
            use_typical_p=any(k[4] < 1.0 for k in sampled),
            controls=LogitsControls.from_sequences(seqs, vocab_size, eos_token_ids, device),
        )

    def advanced(self, token_ids: torch.Tensor) -> "SamplingMetadata":
        """The next step's metadata for the same rows, once each row i gained token_ids[i] (B,) int64.

        Positions move by one and the output-token table (when a penalty reads it) gains the new
        column, on the device: no host work and no transfer. Equal in effect to from_sequences on the
        grown sequences (the table's padding then sits mid-row; only token counts are read from it).
        """
        outputs = self.output_token_ids
        if outputs is not None:
            outputs = torch.cat([outputs, token_ids[:, None]], dim=1)
        controls = self.controls.advanced(token_ids) if self.controls is not None else None
        return replace(self, positions=self.positions + 1, output_token_ids=outputs, controls=controls,
                       grammar_rows=None, grammar_bitmask=None)


def _knobs(p: SamplingParams) -> tuple[float, int, float, float, float]:
    """(temperature, top_k, top_p, min_p, typical_p); neutral on greedy rows, so only penalties touch them."""
    if p.greedy:
        return (1.0, 0, 1.0, 0.0, 1.0)
    return (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p)


def _pad(token_lists: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """(B, max(1, longest)) int64 on device, padded with pad_id."""
    width = max(1, max((len(t) for t in token_lists), default=0))
    out = torch.full((len(token_lists), width), pad_id, dtype=torch.int64)
    for i, t in enumerate(token_lists):   # host-side list packing, not tensor math
        out[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
    return out.to(device, non_blocking=True)


@dataclass
class SamplerOutput:
    """The sampled tokens of one step, rows in batch order.

    `logprobs` and the top-n alternatives come from the distribution the token was picked from:
    log_softmax of the penalized logits for greedy rows; for sampled rows the processed
    distribution (after penalties, temperature and the filters). Filtered-out alternatives can
    appear in top_ids with log-prob -inf when a row keeps fewer than max_top_n tokens: drop those
    before they reach JSON.
    """

    token_ids: torch.Tensor            # (B,) int64
    logprobs: torch.Tensor             # (B,) float32
    top_ids: torch.Tensor | None       # (B, max_top_n) int64, best first
    top_logprobs: torch.Tensor | None  # (B, max_top_n) float32


# ---------------------------------------------------------------------------------------------
# Logits processors: each is one tensor op over the rows it gets; (N, V) float32 in and out.
# ---------------------------------------------------------------------------------------------


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, L) int64 padded with vocab_size -> (N, V) float32 occurrence counts (vLLM bin counts)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition, presence and frequency penalties over all rows (greedy rows too), vLLM definition.

    Repetition over tokens seen in prompt OR output: logit > 0 -> logit / p, else logit * p
    (same as transformers' RepetitionPenaltyLogitsProcessor). Presence and frequency over output
    tokens only: logit -= presence * (count > 0) + frequency * count.
    """
    vocab_size = logits.shape[1]
    if meta.output_token_ids is None:
        return logits
    out_counts = _token_counts(meta.output_token_ids, vocab_size)                    # (B, V)
    out_seen = out_counts > 0
    seen = out_seen
    if meta.prompt_token_ids is not None:
        seen = seen | (_token_counts(meta.prompt_token_ids, vocab_size) > 0)
    penalty = torch.where(seen, meta.repetition_penalty[:, None], 1.0)               # (B, V)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - meta.frequency_penalty[:, None] * out_counts - meta.presence_penalty[:, None] * out_seen


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k largest logits (ties at the cut are kept); LMI schema: top_k 0 = off.

    top_k: (N,) int64. Uses torch.topk with the batch's largest k, not a full sort.
    """
    k_cap = min(max_top_k, logits.shape[1])
    kth = torch.topk(logits, k_cap, dim=-1).values.gather(1, (top_k.clamp(1, k_cap) - 1)[:, None])  # (N, 1)
    kth = torch.where(top_k[:, None] > 0, kth, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


TOP_P_FIRST_K = 64  # candidates tried first; real distributions put a top_p's mass in far fewer tokens


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability mass is >= top_p.

    top_p: (N,) float32 in (0, 1]; 1.0 = off (exactly: rounding never drops a token). A token is kept
    when the mass of the tokens ranked strictly above it is < top_p, so the top token always stays.
    Only the best k tokens are sorted (torch.topk), k = 64, 256, ... until they hold top_p's mass in
    every row: each token past them has at least that mass above it and is dropped, so the result
    equals a full sort's at a fraction of the cost for a 49k vocabulary.
    """
    probs = torch.softmax(logits, dim=-1)
    active = top_p < 1.0                                                              # (N,) bool
    k = min(TOP_P_FIRST_K, logits.shape[1])
    while True:
        probs_sorted, order = torch.topk(probs, k, dim=-1)                            # (N, k) descending
        cum = torch.cumsum(probs_sorted, dim=-1)
        # host sync, the step's only one besides the copy of its results, and only when a row uses top_p
        # (usually once: 64 candidates hold the mass): is k large enough for every filtering row? A full
        # sort instead would cost ~40x more for a 49k vocabulary.
        if k == logits.shape[1] or bool(((cum[:, -1] >= top_p) | ~active).all()):
            break
        k = min(k * 4, logits.shape[1])
    drop_sorted = ((cum - probs_sorted) >= top_p[:, None]) & active[:, None]          # (N, k)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, ~drop_sorted)
    keep |= ~active[:, None]
    return logits.masked_fill(~keep, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with p >= min_p * p_max, computed as logit - max_logit >= log(min_p); 0.0 = off."""
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]   # log(0) = -inf keeps all
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling with transformers' TypicalLogitsWarper semantics, per-row mass.

    Ranks tokens by |-log p - H| (H = entropy), keeps the best-ranked until their mass reaches
    typical_p (at least one token). typical_p: (N,) float32; 1.0 = off.
    """
    logp = torch.log_softmax(logits, dim=-1)
    entropy = row_entropy(logp)[:, None]
    scores_sorted, order = torch.sort((-logp - entropy).abs(), dim=-1)
    cum = torch.softmax(logits.gather(1, order), dim=-1).cumsum(dim=-1)
    last = (cum < typical_p[:, None]).sum(dim=1).clamp(max=logits.shape[1] - 1)       # (N,)
    drop_sorted = scores_sorted > scores_sorted.gather(1, last[:, None])
    drop_sorted[:, 0] = False
    drop_sorted &= typical_p[:, None] < 1.0
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


# ---------------------------------------------------------------------------------------------
# The sampler
# ---------------------------------------------------------------------------------------------


def _rows(meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled_rows, greedy_rows) int64 index tensors."""
    if meta.sampled_rows is not None and meta.greedy_rows is not None:
        return meta.sampled_rows, meta.greedy_rows
    # host-device sync: only when the metadata was built without from_sequences
    return meta.greedy.logical_not().nonzero().flatten(), meta.greedy.nonzero().flatten()


class Sampler:
    """Pick one token per row from (B, V) float32 logits. Stateless; no Python loop over rows.

    Order (transformers' generate order for the warpers): penalties on all rows; then on sampled
    rows only temperature, top_k, top_p, min_p, typical_p; then the exponential race
    argmax(p / E), E ~ Exp(1) from exponential_log_noise, so a seeded row's token depends only on
    its seed, its output position and its own logits. Greedy rows take argmax of the penalized logits.

    `ops`: a kernel backend whose log_softmax, greedy and seeded_sample do the picking (the Triton backend,
    engine/model/backends/triton/sampling.py: one program per row, the same hash of (seed, position, token),
    so a row's token is the one torch's ops pick, on the device without a host sync); None: TorchPick, torch's
    ops (and the C++ kernels on CPU). Chosen here, once. The processors before the pick are torch's either way.
    """

    def __init__(self, ops=None):
        self.ops = ops
        pick = TorchPick if ops is None else ops
        self._greedy, self._log_softmax, self._seeded_sample = pick.greedy, pick.log_softmax, pick.seeded_sample

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        return self.pick(self.process(logits, meta), meta)

    @staticmethod
    def process(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The processors every row gets, before any sampling knob: the grammar mask, the logits controls
        (allowed ids, bad words, min_tokens, logit_bias), then the penalties. (B, V) float32 in and out;
        the input is left as it is (a copy is edited when a mask or control applies)."""
        if meta.grammar_bitmask is not None or meta.controls is not None:
            logits = logits.clone()
            if meta.grammar_bitmask is not None:
                apply_token_bitmask(logits, meta.grammar_rows, meta.grammar_bitmask)
            if meta.controls is not None:
                meta.controls.apply(logits, meta.positions)
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        return logits

    def pick(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Choose each row's token from processed logits (Sampler.process): greedy rows by argmax, sampled
        rows by temperature, the filters and the seeded exponential race."""
        if meta.all_greedy:
            return greedy_sample(logits, meta.max_top_n, self.ops)     # (the C++ one-call pick on CPU)
        sampled_rows, greedy_rows = _rows(meta)
        if greedy_rows.numel() == 0:
            token_ids, logprobs = self._sample(logits, meta, None)
        else:
            token_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            logprobs = torch.empty_like(logits)
            s_ids, s_logprobs = self._sample(logits.index_select(0, sampled_rows), meta, sampled_rows)
            g_logits = logits.index_select(0, greedy_rows)
            g_ids, g_logprobs = self._greedy(g_logits), self._log_softmax(g_logits)
            token_ids.index_copy_(0, sampled_rows, s_ids).index_copy_(0, greedy_rows, g_ids)
            logprobs.index_copy_(0, sampled_rows, s_logprobs)
            logprobs.index_copy_(0, greedy_rows, g_logprobs)
        return _output(token_ids, logprobs, meta.max_top_n)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata,
                rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Process and draw for the sampled rows. logits: (Ns, V); rows: their batch indices (None = all).

        Returns ((Ns,) int64 token ids, (Ns, V) float32 log-probs of the processed distribution).
        """
        def take(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t.index_select(0, rows)

        logits = logits / take(meta.temperature)[:, None]
        max_top_k = meta.max_top_k if meta.max_top_k is not None else int(meta.top_k.max())  # sync if unknown
        if max_top_k > 0:
            logits = apply_top_k(logits, take(meta.top_k), max_top_k)
        if meta.use_top_p:
            logits = apply_top_p(logits, take(meta.top_p))
        if meta.use_min_p:
            logits = apply_min_p(logits, take(meta.min_p))
        if meta.use_typical_p:
            logits = apply_typical_p(logits, take(meta.typical_p))
        logprobs = self._log_softmax(logits)
        return self._seeded_sample(logprobs, take(meta.seeds), take(meta.positions)), logprobs


class TorchPick:
    """The pick in torch's ops, on any device: Sampler's ops when no kernel backend gives them."""

    @staticmethod
    def greedy(logits: torch.Tensor) -> torch.Tensor:
        """(N, V) float32 -> (N,) int64 argmax, the first of ties (row_argmax)."""
        return row_argmax(logits)

    @staticmethod
    def log_softmax(logits: torch.Tensor) -> torch.Tensor:
        """(N, V) float32 -> (N, V) float32, row-wise (its bits depend on the row alone)."""
        return torch.log_softmax(logits, dim=-1)

    @staticmethod
    def seeded_sample(logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The exponential race argmax(p / E) in log space, E from exponential_log_noise keyed on each row's
        (seed, position): (N, V) float32 log-probs, (N,) int64 seeds and positions -> (N,) int64 ids."""
        return row_argmax(logprobs - exponential_log_noise(seeds, positions, logprobs.shape[1]))


def greedy_sample(logits: torch.Tensor, max_top_n: int, ops=None) -> SamplerOutput:
    """All-greedy batch: argmax of the logits (row_argmax: torch.argmax's indices, a C++ pass on CPU);
    log-probs from the same log_softmax the mixed path uses.

    logits: (B, V) float32. `logit - logsumexp` would be cheaper but is neither the mixed path's value
    (a greedy row's log-prob would move when a sampled row joins the step) nor row-invariant
    (torch.logsumexp splits a lone row's reduction over threads): see `row_sum`. On CPU with the kernels built,
    the argmax, the log_softmax (torch's own kernel, called from C++) and the chosen ids' log-probs come from one
    call (vmath.h greedy_pick: the same values; a batch-1 step spent more on these ops' dispatch than on them).
    `ops` (a kernel backend, Sampler's): its greedy and log_softmax instead.
    """
    if ops is not None:
        return _output(ops.greedy(logits), ops.log_softmax(logits), max_top_n)
    module = built_kernels()
    if module is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.shape[1] > 0:
        token_ids, logprobs, chosen = module.greedy_pick(logits)
        return _output(token_ids, logprobs, max_top_n, chosen)
    return _output(row_argmax(logits), torch.log_softmax(logits, dim=-1), max_top_n)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """(N, V) float32 -> (N,) float32 sums whose bits depend only on the row (batch-invariant).

    torch's sum/nansum/logsumexp split a reduction over threads when there are few rows, so a row
    alone and the same row in a batch round differently (measured on CPU with 2 threads); a last-dim
    cumsum is one sequential scan per row on CPU (CUDA's is a parallel scan, still per row). Its
    accumulation order differs from a float32 `sum`, so values agree with `sum` to rounding only.
    (log_softmax and softmax over the last dim are row-wise already, measured.)
    """
    return x.cumsum(dim=-1)[:, -1]


def row_entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy -sum(p log p) of each row of log-probs: (N, V) float32 -> (N,) float32, in nats.

    Filtered tokens (log-prob -inf) add 0. Batch-invariant through row_sum (typical_p's threshold).
    """
    return -row_sum(torch.where(logp == float("-inf"), 0.0, logp * logp.exp()))


def _output(token_ids: torch.Tensor, logprobs: torch.Tensor, max_top_n: int,
            chosen: torch.Tensor | None = None) -> SamplerOutput:
    """Gather the chosen log-probs (unless given, (B,) float32) and the top-n alternatives from (B, V) float32
    log-probs."""
    if chosen is None:
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    if max_top_n == 0:
        return SamplerOutput(token_ids, chosen, None, None)
    top = torch.topk(logprobs, min(max_top_n, logprobs.shape[1]), dim=-1)
    return SamplerOutput(token_ids, chosen, top.indices, top.values)
