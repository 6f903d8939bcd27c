"""Tests for engine/logits_controls.py: bitmasks, logit_bias, bad words, min_tokens, allowed ids.

Hand-made logits against transformers' own processors (the oracle for each rule), bitwise batch
invariance of a controlled row, the device-side `advanced` against a rebuild, and the tiny engine end to end.
"""
from __future__ import annotations

import pytest
import torch
from transformers import MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

from lmi_handler.engine import logits_controls
from lmi_handler.engine.logits_controls import (
    LogitsControls,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    bitmask_penalties,
    bitmask_words,
    token_ids_to_bitmask,
    unpack_bitmask,
)
from lmi_handler.engine.model.kernels import cpu_kernels
from lmi_handler.engine.sampler import Sampler, SamplingMetadata
from lmi_handler.engine.sequence import FinishReason, SamplingParams, Sequence
from tests.engine.helpers import ENGINE_PROMPTS as PROMPTS
from tests.engine.helpers import make_engine, run

CPU = torch.device("cpu")
V = 70          # not a multiple of 32: the last bitmask word is partial
EOS = (2,)


def seq(prompt=(7, 8, 9), output=(), **kw) -> Sequence:
    return Sequence("r", list(prompt), SamplingParams(**kw), output_token_ids=list(output))


def controls(seqs, vocab=V) -> LogitsControls:
    return LogitsControls.from_sequences(seqs, vocab, EOS, CPU)


def processed(seqs, logits, vocab=V) -> torch.Tensor:
    return Sampler.process(logits, SamplingMetadata.from_sequences(seqs, vocab, CPU, EOS))


def random_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


# --- bitmasks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ids", [[0], [31], [32], [0, 31, 63, 69], list(range(V))])
def test_a_bitmask_built_from_ids_unpacks_to_exactly_those_ids(ids):
    mask = token_ids_to_bitmask(ids, V)
    assert mask.dtype == torch.int32 and mask.shape == (bitmask_words(V),)
    assert unpack_bitmask(mask[None], V)[0].nonzero().flatten().tolist() == ids


@pytest.mark.parametrize("vocab", [70, 96, 49152])
def test_the_byte_table_penalties_equal_the_bit_by_bit_reference(vocab):
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, bitmask_words(vocab)), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(vocab))
    bitmask[0] = 0
    bitmask[1] = -1
    expected = torch.where(unpack_bitmask(bitmask, vocab), 0.0, float("-inf"))
    assert torch.equal(bitmask_penalties(bitmask, vocab), expected)
    assert torch.equal(bitmask_penalties(bitmask[:, :1], vocab), torch.where(unpack_bitmask(bitmask[:, :1], vocab),
                                                                             0.0, float("-inf")))


def _random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(seed))
    bitmask[0] = 0      # nothing allowed
    bitmask[1] = -1     # everything allowed
    bitmask[2, ::2] = 0
    return bitmask


# vocab, bitmask words: partial last word, exact, the demo vocabulary, a bitmask narrower than the logits
# (a padded vocabulary) and one wider
BITMASK_SHAPES = [(70, 3), (96, 3), (49152, 1536), (100, 2), (64, 3)]


@pytest.mark.parametrize(("vocab", "words"), BITMASK_SHAPES)
@pytest.mark.parametrize("some_rows", [False, True])
def test_the_cpp_bitmask_kernel_equals_the_pytorch_reference_bitwise(vocab, words, some_rows):
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler: the kernel is not built here")
    logits = random_logits(7, vocab, seed=vocab)
    logits[3, 5] = float("-inf")     # an already-banned logit stays banned
    rows = torch.tensor([6, 0, 3, 4, 1]) if some_rows else None
    bitmask = _random_bitmask(5 if some_rows else 7, words, seed=words)
    expected = apply_token_bitmask_reference(logits.clone(), rows, bitmask)
    out = cpu_kernels().mask_logits_(logits.clone(), torch.empty(0, dtype=torch.int64) if rows is None else rows,
                                         bitmask)
    assert torch.equal(out, expected)
    assert torch.equal(apply_token_bitmask(logits.clone(), rows, bitmask), expected)   # the kernel is the path taken


@pytest.mark.parametrize(("vocab", "words"), BITMASK_SHAPES)
def test_the_pytorch_penalty_path_equals_the_reference_on_finite_logits(vocab, words, monkeypatch):
    monkeypatch.setattr(logits_controls, "built_kernels", lambda: None)   # kernels not built, or no compiler
    logits = random_logits(4, vocab, seed=vocab + 1)
    rows = torch.tensor([2, 0, 3])
    bitmask = _random_bitmask(3, words, seed=words + 1)
    assert torch.equal(apply_token_bitmask(logits.clone(), rows, bitmask),
                       apply_token_bitmask_reference(logits.clone(), rows, bitmask))


def test_ids_past_the_bitmask_width_are_masked_so_a_padded_vocabulary_stays_covered():
    mask = torch.full((1, 1), -1, dtype=torch.int32)          # 32 ids allowed, logits are 70 wide
    logits = apply_token_bitmask(torch.zeros(1, V), None, mask)
    assert torch.isfinite(logits[0, :32]).all() and torch.isinf(logits[0, 32:]).all()


def test_a_bitmask_applies_only_to_its_rows():
    logits = random_logits(3)
    out = apply_token_bitmask(logits.clone(), torch.tensor([1]), token_ids_to_bitmask([4, 5], V)[None])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [4, 5]


# --- each control against transformers' processor ------------------------------------------------------

def test_logit_bias_equals_transformers_sequence_bias():
    logits = random_logits(1)
    bias = ((3, 5.0), (10, -100.0), (69, 0.25))
    hf = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(torch.tensor([[7, 8, 9]]), logits.clone())
    assert torch.equal(processed([seq(logit_bias=bias)], logits), hf)


@pytest.mark.parametrize("context", [[7, 8, 9], [7, 1, 2], [5, 1, 2, 3], [1, 2, 3, 1]])
def test_bad_words_equal_transformers_no_bad_words_over_prompt_and_output(context):
    words = ((4,), (2, 11), (1, 2, 3, 12), (9, 13))
    logits = random_logits(1)
    hf = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=None)(torch.tensor([context]),
                                                                               logits.clone())
    split = [seq(prompt=context, bad_words=words),    # and the prefix across the prompt/output boundary
             seq(prompt=context[:2], output=context[2:], bad_words=words)]
    for s in split:
        assert torch.equal(processed([s], logits), hf)


@pytest.mark.parametrize("num_output", [0, 2, 3, 5])
def test_min_tokens_bans_eos_and_stop_ids_like_transformers_min_new_tokens(num_output):
    logits = random_logits(1)
    hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=3, min_new_tokens=3, eos_token_id=[2, 17])(
        torch.tensor([[7, 8, 9] + [5] * num_output]), logits.clone())
    ours = processed([seq(output=[5] * num_output, min_tokens=3, stop_token_ids=(17,))], logits)
    assert torch.equal(ours, hf)


def test_min_tokens_leaves_eos_alone_under_ignore_eos_but_still_bans_stop_ids():
    out = processed([seq(min_tokens=2, stop_token_ids=(17,), ignore_eos=True)], random_logits(1))
    assert torch.isfinite(out[0, 2]) and torch.isinf(out[0, 17])


def test_allowed_token_ids_keep_only_those_ids():
    out = processed([seq(allowed_token_ids=(3, 40, 69))], random_logits(1))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 40, 69]


# --- batch invariance and the steady-decode path --------------------------------------------------------

def test_a_controlled_row_is_bitwise_the_same_alone_and_beside_other_controlled_rows():
    target = seq(output=[1, 2], logit_bias=((3, 1.5),), bad_words=((2, 5), (8,)), min_tokens=4)
    others = [seq(prompt=(1,), bad_words=((9, 9, 4),)), seq(allowed_token_ids=(1, 2, 3)),
              seq(prompt=(2, 2), logit_bias=((5, -2.0), (3, 0.5)), min_tokens=1, repetition_penalty=1.3)]
    logits = random_logits(4)
    alone = processed([target], logits[1:2])
    crowd = processed([others[0], target, others[1], others[2]], logits)
    assert torch.equal(crowd[1], alone[0])


def test_advanced_controls_equal_controls_rebuilt_from_the_grown_sequences():
    seqs = [seq(output=[1], bad_words=((1, 2, 3),), min_tokens=2), seq(prompt=(4,), bad_words=((6, 7),))]
    meta = SamplingMetadata.from_sequences(seqs, V, CPU, EOS)
    new = torch.tensor([2, 6])
    for s, t in zip(seqs, new.tolist()):
        s.output_token_ids.append(t)
    logits = random_logits(2)
    rebuilt = Sampler.process(logits, SamplingMetadata.from_sequences(seqs, V, CPU, EOS))
    assert torch.equal(Sampler.process(logits, meta.advanced(new)), rebuilt)
    assert torch.isinf(rebuilt[0, 3]) and torch.isinf(rebuilt[1, 7])


def test_no_control_builds_no_tables():
    assert controls([seq(), seq(temperature=0.5)]) is None


# --- the tiny engine end to end ---------------------------------------------------------------------------

def hf_greedy(hf, prompt, max_new_tokens, **kw):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_greedy_with_each_control_equals_hf_generate_in_a_batch(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    plain = hf_greedy(hf, PROMPTS[0], 10, eos_token_id=None)
    bias = ((plain[1], -50.0), (plain[3] + 1, 3.0))
    words = ((plain[0], plain[1]), (plain[4],))
    cases = [
        (SamplingParams(max_new_tokens=10, ignore_eos=True, logit_bias=bias),
         dict(eos_token_id=None, sequence_bias={(t,): b for t, b in bias})),
        (SamplingParams(max_new_tokens=10, ignore_eos=True, bad_words=words),
         dict(eos_token_id=None, bad_words_ids=[list(w) for w in words])),
        (SamplingParams(max_new_tokens=10, min_tokens=6, stop_token_ids=(plain[2],)),
         dict(eos_token_id=[2, plain[2]], min_new_tokens=6)),
    ]
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    ours, _ = run(engine, [PROMPTS[0]] * 3 + [PROMPTS[1]], [c[0] for c in cases] + [SamplingParams(max_new_tokens=4)])
    for i, (_, hf_kw) in enumerate(cases):
        assert ours[f"r{i}"] == hf_greedy(hf, PROMPTS[0], 10, **hf_kw), i
    assert ours["r0"] != plain and ours["r1"] != plain


def test_seeded_sampling_with_controls_is_the_same_alone_and_in_a_batch(tiny_model_dir, tiny_tokenizer):
    target = SamplingParams(greedy=False, seed=5, max_new_tokens=12, ignore_eos=True, logit_bias=((7, 2.0),),
                            bad_words=((7, 7),), allowed_token_ids=tuple(range(3, 200)))
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    alone, _ = run(engine, [PROMPTS[2]], [target])
    crowd, _ = run(engine, [PROMPTS[0], PROMPTS[2], PROMPTS[1]],
                   [SamplingParams(greedy=False, seed=1, max_new_tokens=5, min_tokens=3), target,
                    SamplingParams(max_new_tokens=8, logit_bias=((9, 1.0),))])
    assert crowd["r1"] == alone["r0"]
    tokens = alone["r0"]
    assert all(3 <= t < 200 for t in tokens)
    assert not any(a == 7 and b == 7 for a, b in zip(tokens, tokens[1:]))


def test_a_stop_string_cannot_end_before_min_tokens(tiny_model_dir, tiny_tokenizer):
    engine = make_engine(tiny_model_dir, tiny_tokenizer)
    free, results = run(engine, [PROMPTS[1]], [SamplingParams(max_new_tokens=8, ignore_eos=True)])
    text = results["r0"][-1].generated_text
    first = tiny_tokenizer.decode(free["r0"][:1])
    stop = first[-1] if first else text[:1]
    assert stop, "the tiny model's first token must have text"
    _, early = run(engine, [PROMPTS[1]], [SamplingParams(max_new_tokens=8, ignore_eos=True, stop_sequences=(stop,))])
    _, late = run(engine, [PROMPTS[1]], [SamplingParams(max_new_tokens=8, ignore_eos=True, stop_sequences=(stop,),
                                                        min_tokens=3)])
    assert early["r0"][-1].finish_reason is FinishReason.STOP_SEQUENCE and len(early["r0"][-1].generated_text) < len(first)
    late_final = late["r0"][-1]
    # the stop string still ends it (greedy: the same text comes again), no earlier than min_tokens allows
    assert late_final.finish_reason is FinishReason.STOP_SEQUENCE and late_final.num_generated_tokens >= 3
    assert late_final.generated_text.startswith(first)
