"""Tests for engine/sampler.py: logits processors on hand-made logits, seeded sampling, fast paths."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from lmi_handler.engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
    exponential_log_noise,
    greedy_sample,
    mix32_,
    mix64,
)
from lmi_handler.engine.sequence import SamplingParams, Sequence

CPU = torch.device("cpu")
# A hand-made distribution: token i has probability PROBS[i].
PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]
LOGITS = torch.log(torch.tensor([PROBS]))   # (1, 5)


def seq(greedy=False, prompt=(7, 8), output=(), **kw) -> Sequence:
    return Sequence("r", list(prompt), SamplingParams(greedy=greedy, **kw), output_token_ids=list(output))


def meta_for(seqs, vocab_size) -> SamplingMetadata:
    return SamplingMetadata.from_sequences(seqs, vocab_size, CPU)


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


# --- processors, table-driven -------------------------------------------------------------------

@pytest.mark.parametrize("top_k, expected", [(1, {0}), (2, {0, 1}), (4, {0, 1, 2, 3}), (0, {0, 1, 2, 3, 4}),
                                             (99, {0, 1, 2, 3, 4})])
def test_top_k_keeps_the_k_most_likely_tokens(top_k, expected):
    assert kept(apply_top_k(LOGITS, torch.tensor([top_k]), max(top_k, 1))) == expected


@pytest.mark.parametrize("top_p, expected", [(0.3, {0}), (0.6, {0, 1}), (0.75, {0, 1, 2}), (0.9, {0, 1, 2, 3}),
                                             (0.97, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4})])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    assert kept(apply_top_p(LOGITS, torch.tensor([top_p]))) == expected


@pytest.mark.parametrize("min_p, expected", [(0.0, {0, 1, 2, 3, 4}), (0.15, {0, 1, 2, 3}), (0.25, {0, 1, 2}),
                                             (0.5, {0}), (0.9, {0})])
def test_min_p_keeps_tokens_at_least_min_p_times_the_best(min_p, expected):
    assert kept(apply_min_p(LOGITS, torch.tensor([min_p]))) == expected


# Entropy H = 1.333; |-log p - H| ranks tokens 1, 2, 0, 3, 4 with cumulative mass 0.2, 0.35, 0.85, 0.95, 1.
@pytest.mark.parametrize("typical_p, expected", [(0.1, {1}), (0.3, {1, 2}), (0.5, {0, 1, 2}), (0.9, {0, 1, 2, 3}),
                                                 (1.0, {0, 1, 2, 3, 4})])
def test_typical_p_keeps_the_most_typical_tokens(typical_p, expected):
    assert kept(apply_typical_p(LOGITS, torch.tensor([typical_p]))) == expected


def test_neutral_settings_change_nothing():
    logits = torch.randn(3, 49152) * 5
    ones = torch.ones(3)
    assert torch.equal(apply_top_p(logits, ones), logits)
    assert torch.equal(apply_typical_p(logits, ones), logits)
    assert torch.equal(apply_min_p(logits, torch.zeros(3)), logits)
    assert torch.equal(apply_top_k(logits, torch.tensor([0, 0, 0]), 5), logits)


def test_filters_match_transformers_warpers_row_by_row():
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    cases = [
        (apply_top_k, lambda v: TopKLogitsWarper(int(v)), torch.tensor([1, 7, 40, 0]), {"max_top_k": 40}),
        (apply_top_p, lambda v: TopPLogitsWarper(float(v)), torch.tensor([0.1, 0.5, 0.8, 0.95]), {}),
        (apply_min_p, lambda v: MinPLogitsWarper(float(v)), torch.tensor([0.01, 0.05, 0.2, 0.6]), {}),
        (apply_typical_p, lambda v: TypicalLogitsWarper(float(v)), torch.tensor([0.2, 0.5, 0.8, 0.95]), {}),
    ]
    for ours, theirs, values, extra in cases:
        got = ours(logits, values, **extra)
        for row, value in enumerate(values):
            if ours is apply_top_k and value == 0:
                assert torch.equal(got[row], logits[row])
                continue
            want = theirs(value)(None, logits[row : row + 1].clone())
            assert torch.equal(torch.isinf(got[row]), torch.isinf(want[0])), (ours.__name__, value)


def test_repetition_penalty_equals_transformers_processor():
    torch.manual_seed(1)
    vocab = 50
    logits = torch.randn(3, vocab) * 4
    logits[:, 5] = 0.0
    rows = [([5, 6, 7], [8, 8, 9], 1.3), ([1, 2], [], 0.7), ([3, 4, 10], [11, 3], 2.0)]
    seqs = [seq(prompt=p, output=o, repetition_penalty=r, seed=0) for p, o, r in rows]
    got = apply_penalties(logits, meta_for(seqs, vocab))
    for i, (p, o, r) in enumerate(rows):
        want = RepetitionPenaltyLogitsProcessor(penalty=r)(torch.tensor([p + o]), logits[i : i + 1].clone())
        torch.testing.assert_close(got[i], want[0], rtol=0, atol=0)


def test_presence_and_frequency_penalties_follow_vllm_formula_over_output_only():
    vocab = 10
    logits = torch.zeros(2, vocab)
    seqs = [seq(prompt=[1, 2], output=[3, 3, 3, 4], presence_penalty=0.5, frequency_penalty=0.25),
            seq(greedy=True, prompt=[3], output=[5], presence_penalty=-1.0, frequency_penalty=0.0)]
    got = apply_penalties(logits, meta_for(seqs, vocab))
    want = torch.zeros(2, vocab)
    want[0, 3] = -(0.5 + 0.25 * 3)
    want[0, 4] = -(0.5 + 0.25 * 1)
    want[1, 5] = 1.0          # prompt token 3 is not penalized: presence/frequency look at output only
    assert torch.equal(got, want)


def test_penalties_apply_to_greedy_rows():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    plain = Sampler()(logits, meta_for([seq(greedy=True, prompt=[2], output=[0])], 4))
    penalized = Sampler()(logits, meta_for([seq(greedy=True, prompt=[2], output=[0], repetition_penalty=1.5)], 4))
    assert plain.token_ids.tolist() == [0] and penalized.token_ids.tolist() == [1]
    torch.testing.assert_close(penalized.logprobs, torch.log_softmax(torch.tensor([2.0, 2.9, 0, 0]), -1)[1:2])


# --- sampling ------------------------------------------------------------------------------------

def test_top_k_one_and_tiny_temperature_equal_greedy():
    torch.manual_seed(2)
    logits = torch.randn(6, 1000) * 2
    greedy = logits.argmax(dim=-1)
    for params in ({"top_k": 1}, {"temperature": 1e-4}):
        seqs = [seq(seed=s, **params) for s in range(-3, 3)]
        for position in range(5):
            meta = meta_for(seqs, 1000)
            meta.positions += position
            assert torch.equal(Sampler()(logits, meta).token_ids, greedy), params


def test_sampled_log_prob_is_from_the_processed_distribution():
    seqs = [seq(seed=s, top_k=2, temperature=0.5) for s in range(40)]
    logits = LOGITS.repeat(40, 1)
    out = Sampler()(logits, meta_for(seqs, 5))
    processed = torch.log_softmax(torch.log(torch.tensor([0.5, 0.2])) / 0.5, -1)
    assert set(out.token_ids.tolist()) == {0, 1}
    torch.testing.assert_close(out.logprobs, processed[out.token_ids])


def test_top_tokens_come_from_the_same_distribution_best_first():
    seqs = [seq(greedy=True, top_n_tokens=3), seq(seed=5, top_k=2, top_n_tokens=2)]
    out = Sampler()(LOGITS.repeat(2, 1), meta_for(seqs, 5))
    assert out.top_ids.tolist()[0] == [0, 1, 2]
    torch.testing.assert_close(out.top_logprobs[0], torch.log(torch.tensor([0.5, 0.2, 0.15])))
    assert out.top_ids.tolist()[1][:2] == [0, 1]
    torch.testing.assert_close(out.top_logprobs[1, :2], torch.log(torch.tensor([5 / 7, 2 / 7])))
    assert out.top_logprobs[1, 2] == float("-inf")   # filtered out: the engine drops these


def test_all_greedy_fast_path_matches_the_general_path():
    torch.manual_seed(3)
    logits = torch.randn(5, 700)
    meta = meta_for([seq(greedy=True, top_n_tokens=4) for _ in range(5)], 700)
    assert meta.all_greedy and meta.no_penalties
    fast = Sampler()(logits, meta)
    meta.all_greedy = False   # force the masked path: no sampled rows, all greedy rows
    slow = Sampler()(logits, meta)
    assert torch.equal(fast.token_ids, slow.token_ids) and torch.equal(fast.top_ids, slow.top_ids)
    assert torch.equal(fast.logprobs, slow.logprobs) and torch.equal(fast.top_logprobs, slow.top_logprobs)


@pytest.fixture
def two_threads():
    """torch's reductions split a lone row only with several threads: the invariance tests need them."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _greedy_row(batch: list[Sequence], logits: torch.Tensor, row: int):
    out = Sampler()(logits, meta_for(batch, logits.shape[1]))   # top-n columns: the batch's largest n
    return int(out.token_ids[row]), out.logprobs[row], out.top_ids[row, :3], out.top_logprobs[row, :3]


@pytest.mark.parametrize("vocab", [700, 49152])   # 49152: the demo model's vocabulary, where the leak was seen
def test_a_greedy_rows_log_probs_are_bitwise_the_same_alone_with_greedy_and_with_sampled_neighbours(vocab, two_threads):
    """Batch invariance covers the reported log-probs too: a greedy row's chosen and top-n log-probs
    must not move in the last bits when the step holds other greedy rows or a sampled row."""
    torch.manual_seed(11)
    logits = torch.randn(4, vocab) * 6 + 20          # large logits: where logit - logsumexp loses bits
    target = seq(greedy=True, top_n_tokens=3)
    alone = _greedy_row([target], logits[:1], 0)
    crowds = ([target, seq(greedy=True), seq(greedy=True, top_n_tokens=5)],
              [seq(seed=3, temperature=0.7), target, seq(greedy=True)],
              [seq(seed=1, top_p=0.8), seq(seed=2, typical_p=0.9), seq(greedy=True), target])
    for batch in crowds:
        row = batch.index(target)
        order = [row] + [i for i in range(len(batch)) if i != row]
        crowd_logits = torch.empty(len(batch), vocab)
        crowd_logits[order] = logits[:len(batch)]            # the target's logits are logits[0] in every crowd
        got = _greedy_row(batch, crowd_logits, row)
        assert got[0] == alone[0] and torch.equal(got[2], alone[2])
        assert torch.equal(got[1], alone[1]) and torch.equal(got[3], alone[3])


def test_a_sampled_rows_log_probs_under_typical_p_are_bitwise_the_same_alone_and_in_a_batch(two_threads):
    """typical_p's entropy is a row reduction: it must not depend on the number of rows either."""
    torch.manual_seed(12)
    vocab = 49152
    logits = torch.randn(3, vocab) * 4
    target = seq(seed=9, typical_p=0.8, top_n_tokens=2)
    alone = Sampler()(logits[:1], meta_for([target], vocab))
    crowd = Sampler()(logits, meta_for([target, seq(seed=1, typical_p=0.5), seq(greedy=True)], vocab))
    assert int(crowd.token_ids[0]) == int(alone.token_ids[0])
    assert torch.equal(crowd.logprobs[0], alone.logprobs[0]) and torch.equal(crowd.top_logprobs[0], alone.top_logprobs[0])


def test_row_sum_and_row_entropy_are_bitwise_the_same_for_a_row_alone_and_in_a_batch(two_threads):
    """typical_p's threshold rests on the entropy: a lone row's must not differ from its batched bits.
    (torch's nansum, which it replaced, fails this check here: a lone row is split over threads.)"""
    from lmi_handler.engine.sampler import row_entropy, row_sum

    x = torch.randn(8, 49152, generator=torch.Generator().manual_seed(13)) * 4
    logp = torch.log_softmax(x, dim=-1)
    logp[:, ::7] = float("-inf")                                         # filtered tokens
    for fn, arg in ((row_sum, x), (row_entropy, logp)):
        full = fn(arg)
        assert all(torch.equal(fn(arg[i:i + 1])[0], full[i]) for i in range(8))
    torch.testing.assert_close(row_sum(x), x.double().sum(-1).float(), rtol=1e-4, atol=1e-3)
    p = logp.double().exp()
    expected = -(torch.where(p > 0, p * logp.double(), 0.0)).sum(-1).float()
    torch.testing.assert_close(row_entropy(logp), expected, rtol=1e-5, atol=1e-5)


def _run(seqs: list[Sequence], row: int, steps: int, vocab: int) -> list[int]:
    """Tokens of seqs[row] over `steps` decode steps; each step's logits depend only on the step."""
    tokens = []
    for step in range(steps):
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(step)).repeat(len(seqs), 1)
        out = Sampler()(logits, meta_for(seqs, vocab))
        tokens.append(int(out.token_ids[row]))
        for s, t in zip(seqs, out.token_ids.tolist()):
            s.output_token_ids.append(t)
    return tokens


def test_same_seed_gives_same_tokens_alone_and_in_a_mixed_batch():
    vocab, steps = 200, 40
    params = {"seed": 1234, "temperature": 0.9, "top_p": 0.95, "repetition_penalty": 1.1}
    alone = _run([seq(**params)], 0, steps, vocab)
    batch = [seq(greedy=True), seq(seed=7, top_k=5, min_p=0.05), seq(**params), seq(greedy=True, frequency_penalty=1),
             seq(seed=-9, typical_p=0.7, top_n_tokens=3)]
    assert _run(batch, 2, steps, vocab) == alone
    assert len(set(alone)) > 5


def test_different_seeds_give_different_tokens():
    vocab, steps = 200, 20
    runs = {tuple(_run([seq(seed=s)], 0, steps, vocab)) for s in range(10)}
    assert len(runs) == 10


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1, -123456789])
def test_negative_and_extreme_seeds_sample_validly_and_repeat(seed):
    vocab = 100
    first = _run([seq(seed=seed)], 0, 10, vocab)
    assert first == _run([seq(seed=seed)], 0, 10, vocab)
    assert all(0 <= t < vocab for t in first)


def test_seed_beyond_int64_wraps_instead_of_failing():
    meta = meta_for([seq(seed=2**64 + 5), seq(seed=None)], 10)
    assert meta.seeds.tolist() == [5, 0]


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_over_many_seeds_follow_the_softmax():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 - 10000
    noise = exponential_log_noise(seeds, torch.zeros(n, dtype=torch.int64), 8)
    tokens = (torch.log(probs)[None, :] - noise).argmax(dim=-1)
    assert _chi_square(tokens, probs) < 24.3   # 7 degrees of freedom, p = 0.001


def test_draws_over_many_positions_of_one_seed_follow_the_softmax():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
    n = 20000
    meta = meta_for([seq(seed=-42) for _ in range(n)], 8)
    meta.positions = torch.arange(n, dtype=torch.int64)
    tokens = Sampler()(torch.log(probs).repeat(n, 1), meta).token_ids
    assert _chi_square(tokens, probs) < 24.3


def _splitmix64_finalizer(z: int) -> int:
    """Reference splitmix64 mixer on Python ints (uint64)."""
    mask = (1 << 64) - 1
    z &= mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def _lowbias32(z: int) -> int:
    """Reference lowbias32 mixer on Python ints (uint32)."""
    mask = (1 << 32) - 1
    z &= mask
    z = ((z ^ (z >> 16)) * 0x7FEB352D) & mask
    z = ((z ^ (z >> 15)) * 0x846CA68B) & mask
    return z ^ (z >> 16)


def test_tensor_mixers_are_bit_identical_to_the_unsigned_references():
    values = [0, 1, -1, 2**63 - 1, -(2**63), 0x9E3779B97F4A7C15 - 2**64, 123456789, -987654321]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [_splitmix64_finalizer(v) for v in values]
    values32 = [0, 1, -1, 2**31 - 1, -(2**31), 123456789, -987654321]
    got32 = mix32_(torch.tensor(values32, dtype=torch.int32)).tolist()
    assert [g & ((1 << 32) - 1) for g in got32] == [_lowbias32(v) for v in values32]


def test_noise_rows_have_no_repeated_values_across_the_vocabulary():
    noise = exponential_log_noise(torch.tensor([0, -1]), torch.tensor([0, 7]), 49152)
    assert torch.isfinite(noise).all()
    assert all(len(row.unique()) > 49152 - 400 for row in noise)   # 23-bit uniforms: few birthday collisions


# --- metadata ------------------------------------------------------------------------------------

def test_metadata_gives_greedy_rows_neutral_knobs_and_pads_with_vocab_size():
    seqs = [seq(greedy=True, temperature=0.3, top_k=3, prompt=[1, 2, 3], output=[4]),
            seq(temperature=0.5, top_k=2, top_p=0.9, seed=-3, prompt=[5], output=[6, 7, 8], repetition_penalty=1.2)]
    meta = meta_for(seqs, 50)
    assert meta.greedy.tolist() == [True, False]
    assert meta.temperature.tolist() == [1.0, 0.5] and meta.top_k.tolist() == [0, 2]
    assert meta.positions.tolist() == [1, 3] and meta.seeds.tolist() == [0, -3]
    assert meta.prompt_token_ids.tolist() == [[1, 2, 3], [5, 50, 50]]
    assert meta.output_token_ids.tolist() == [[4, 50, 50], [6, 7, 8]]
    assert (meta.max_top_k, meta.use_top_p, meta.use_min_p, meta.use_typical_p) == (2, True, False, False)
    assert not meta.all_greedy and not meta.no_penalties


def test_metadata_skips_token_tensors_without_penalties():
    meta = meta_for([seq(greedy=True), seq(seed=1)], 50)
    assert meta.prompt_token_ids is None and meta.output_token_ids is None and meta.no_penalties
    meta = meta_for([seq(greedy=True, presence_penalty=0.5)], 50)
    assert meta.prompt_token_ids is None and meta.output_token_ids is not None and meta.all_greedy


def test_greedy_sample_reports_log_softmax_of_the_chosen_token():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = greedy_sample(logits, 0)
    assert out.token_ids.tolist() == [1] and out.top_ids is None
    assert math.isclose(float(out.logprobs[0]), float(torch.log_softmax(logits, -1)[0, 1]), rel_tol=1e-6)


@pytest.mark.parametrize("top_n", [0, 3])
@pytest.mark.parametrize("rows,vocab,threads", [(5, 1000, 2), (67, 4099, 1), (67, 4099, 2), (67, 4099, 3)])
def test_greedy_sample_s_one_kernel_call_gives_the_tensor_ops_values(top_n, rows, vocab, threads):
    """On CPU an all-greedy batch takes its ids, log_softmax and chosen log-probs from one C++ call
    (vmath.h greedy_pick: each thread its own rows, torch's log_softmax kernel on them): bitwise torch.argmax,
    torch.log_softmax over the whole batch and their gather, ties and -inf logits included, whatever the
    number of threads the rows are split over."""
    from lmi_handler.engine.model.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the C++ kernels are not built here")
    torch.manual_seed(5)
    logits = torch.randn(rows, vocab) * 4
    logits[1, 10] = logits[1, 20] = 50.0                    # a tie: the first index
    logits[2, :500] = float("-inf")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = greedy_sample(logits, top_n)
    finally:
        torch.set_num_threads(before)
    logprobs = torch.log_softmax(logits, dim=-1)
    ids = torch.argmax(logits, dim=-1)
    assert torch.equal(out.token_ids, ids) and out.token_ids[1] == 10
    assert torch.equal(out.logprobs, logprobs.gather(1, ids[:, None]).squeeze(1))
    if top_n:
        top = torch.topk(logprobs, top_n, dim=-1)
        assert torch.equal(out.top_ids, top.indices) and torch.equal(out.top_logprobs, top.values)
    else:
        assert out.top_ids is None


def test_greedy_rows_in_a_mixed_batch_take_the_argmax_and_its_log_softmax():
    torch.manual_seed(4)
    logits = torch.randn(4, 300)
    seqs = [seq(greedy=True), seq(seed=1, top_p=0.5), seq(greedy=True, top_n_tokens=2), seq(seed=2, top_k=3)]
    out = Sampler()(logits, meta_for(seqs, 300))
    logprobs = torch.log_softmax(logits, -1)
    assert out.token_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    torch.testing.assert_close(out.logprobs[[0, 2]], logprobs[[0, 2]].max(-1).values)
    torch.testing.assert_close(out.top_logprobs[2], logprobs[2].topk(2).values)


def test_metadata_without_host_side_facts_gives_the_same_tokens():
    torch.manual_seed(5)
    logits = torch.randn(3, 300)
    meta = meta_for([seq(greedy=True), seq(seed=3, top_k=4), seq(seed=-3, min_p=0.1)], 300)
    bare = dataclasses.replace(meta, sampled_rows=None, greedy_rows=None, max_top_k=None)
    assert torch.equal(Sampler()(logits, meta).token_ids, Sampler()(logits, bare).token_ids)


def _top_p_by_full_sort(logits, top_p):
    """The textbook nucleus filter (full sort): the reference apply_top_p's top-k search must equal."""
    probs_sorted, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    drop_sorted = ((torch.cumsum(probs_sorted, dim=-1) - probs_sorted) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted), float("-inf"))


@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])
def test_top_p_partial_sort_keeps_exactly_what_a_full_sort_keeps(scale):
    generator = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(6, 5000, generator=generator) * scale
    top_p = torch.tensor([1.0, 0.999, 0.9, 0.5, 0.1, 0.01])
    assert torch.equal(torch.isinf(apply_top_p(logits, top_p)), torch.isinf(_top_p_by_full_sort(logits, top_p)))


def test_advanced_metadata_samples_exactly_like_metadata_rebuilt_from_the_grown_sequences():
    vocab = 50
    seqs = [seq(greedy=False, prompt=(3, 4, 4), output=(7,), seed=5, repetition_penalty=1.3, frequency_penalty=0.4),
            seq(greedy=True, prompt=(1, 2), output=(), presence_penalty=0.7),
            seq(greedy=False, prompt=(9,), output=(9, 9, 2), seed=-8, temperature=0.8, top_p=0.9)]
    meta = meta_for(seqs, vocab)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        tokens = Sampler()(logits, meta).token_ids
        for s, t in zip(seqs, tokens.tolist()):
            s.output_token_ids.append(t)
        meta, rebuilt = meta.advanced(tokens), meta_for(seqs, vocab)
        assert torch.equal(meta.positions, rebuilt.positions)
        a, b = Sampler()(logits, meta), Sampler()(logits, rebuilt)
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logprobs, b.logprobs)
