"""Tests for engine/stopping.py: stop-id and length checks as tensor ops, stop strings across tokens."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_handler.engine.detokenizer import IncrementalDetokenizer
from lmi_handler.engine.sequence import FinishReason, SamplingParams, Sequence
from lmi_handler.engine.stopping import (
    FINISH_REASONS,
    STOP_EOS,
    STOP_ERROR,
    STOP_LENGTH,
    STOP_NONE,
    STOP_TOKEN,
    StopStringMatcher,
    build_stop_ids,
    token_stop_reasons,
    token_stop_reasons_reference,
)

CPU = torch.device("cpu")
EOS = (2,)


def kernel_stop_reasons(*args):
    """The C++ kernels' stop_reasons (vmath.h), built if need be: token_stop_reasons' CPU path."""
    from lmi_handler.engine.model.kernels import cpu_kernels

    module = cpu_kernels()
    if module is None:
        pytest.skip("the C++ kernels are not built here")
    return module.stop_reasons(*args)


# token_stop_reasons itself, its tensor-op form and the kernel it calls on CPU: all three give the same codes
IMPLS = pytest.mark.parametrize("reasons", [token_stop_reasons, token_stop_reasons_reference, kernel_stop_reasons],
                                ids=["dispatch", "reference", "kernel"])


def seq(**kw) -> Sequence:
    return Sequence("r", [1, 5], SamplingParams(**kw))


# --- token ids and length ------------------------------------------------------------------------

def test_build_stop_ids_pads_dedupes_and_marks_eos():
    seqs = [seq(), seq(stop_token_ids=(7, 7, 2, 9)), seq(ignore_eos=True), seq(ignore_eos=True, stop_token_ids=(2,))]
    stop_ids, is_eos = build_stop_ids(seqs, EOS, CPU)
    assert stop_ids.tolist() == [[2, -1, -1], [2, 7, 9], [-1, -1, -1], [2, -1, -1]]
    assert is_eos.tolist() == [[True, False, False], [True, False, False], [False] * 3, [False] * 3]


def test_build_stop_ids_of_an_empty_batch_has_one_column():
    stop_ids, is_eos = build_stop_ids([], EOS, CPU)
    assert stop_ids.shape == (0, 1) and is_eos.shape == (0, 1)


@pytest.mark.parametrize("params, token, num_out, max_new, expected", [
    ({}, 5, 1, 30, STOP_NONE),
    ({}, 2, 1, 30, STOP_EOS),
    ({}, 5, 30, 30, STOP_LENGTH),
    ({}, 2, 30, 30, STOP_EOS),                                # a stop token wins over length
    ({"stop_token_ids": (7,)}, 7, 3, 30, STOP_TOKEN),
    ({"stop_token_ids": (7,)}, 7, 30, 30, STOP_TOKEN),
    ({"ignore_eos": True}, 2, 3, 30, STOP_NONE),
    ({"ignore_eos": True, "stop_token_ids": (2,)}, 2, 3, 30, STOP_TOKEN),
    ({"stop_token_ids": (2,)}, 2, 3, 30, STOP_EOS),           # eos listed again by the user stays eos
    ({}, 5, 31, 30, STOP_LENGTH),
])
@IMPLS
def test_token_stop_reasons_table(params, token, num_out, max_new, expected, reasons):
    stop_ids, is_eos = build_stop_ids([seq(**params)], EOS, CPU)
    got = reasons(torch.tensor([token]), stop_ids, torch.tensor([num_out]), torch.tensor([max_new]), is_eos)
    assert got.dtype == torch.int8 and got.tolist() == [expected]


@IMPLS
def test_token_stop_reasons_is_batched_and_reports_eos_without_is_eos(reasons):
    seqs = [seq(), seq(stop_token_ids=(7,)), seq(max_new_tokens=3), seq(ignore_eos=True)]
    stop_ids, is_eos = build_stop_ids(seqs, EOS, CPU)
    args = (torch.tensor([2, 7, 4, 2]), stop_ids, torch.tensor([1, 1, 3, 1]), torch.tensor([30, 30, 3, 30]))
    assert reasons(*args, is_eos).tolist() == [STOP_EOS, STOP_TOKEN, STOP_LENGTH, STOP_NONE]
    assert reasons(*args).tolist() == [STOP_EOS, STOP_EOS, STOP_LENGTH, STOP_NONE]


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.lists(st.integers(-1, 6), min_size=1, max_size=4), st.integers(0, 6),
                               st.integers(0, 5), st.integers(0, 5), st.integers(0, 2**16)), min_size=1, max_size=9),
       width=st.integers(1, 4))
def test_the_kernel_gives_the_reference_codes(rows, width):
    """Random stop tables, tokens, counts and eos marks: the C++ stop_reasons equals the tensor ops, with is_eos
    and without."""
    ids = torch.tensor([(r[0] * width)[:width] for r in rows], dtype=torch.int64)
    eos = torch.tensor([[bool(r[4] >> j & 1) for j in range(width)] for r in rows])
    args = (torch.tensor([r[1] for r in rows]), ids, torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows]))
    assert torch.equal(kernel_stop_reasons(*args, eos), token_stop_reasons_reference(*args, eos))
    assert torch.equal(kernel_stop_reasons(*args), token_stop_reasons_reference(*args))


def test_reason_codes_map_to_lmi_finish_reasons():
    assert FINISH_REASONS == {STOP_EOS: FinishReason.EOS_TOKEN, STOP_LENGTH: FinishReason.LENGTH,
                              STOP_TOKEN: FinishReason.STOP_SEQUENCE, STOP_ERROR: FinishReason.ERROR}


# --- stop strings --------------------------------------------------------------------------------

def feed(matcher: StopStringMatcher, pieces: list[str]) -> list[list[str]]:
    """add() each piece then release(); returns the per-step released lists."""
    steps = []
    for piece in pieces:
        matcher.add(piece)
        steps.append(matcher.release())
    return steps


def test_stop_string_split_across_tokens_is_never_released_in_part():
    m = StopStringMatcher(("STOP",), False)
    assert [m.add(p) or m.release() for p in ["Hello ", "ST", "O"]] == [["Hello "], [], []]
    assert m.add("P") is True and m.matched
    assert m.text == "Hello "
    assert m.release() == ["", "", ""]


def test_stop_string_starting_mid_token_keeps_the_text_before_it():
    m = StopStringMatcher(("XYZ",), False)
    assert feed(m, ["abc", "deXY", "Zgh"]) == [["abc"], [], ["de", ""]]
    assert m.text == "abcde"


def test_include_stop_str_in_output_keeps_the_stop_and_cuts_after_it():
    m = StopStringMatcher(("XYZ",), True)
    assert feed(m, ["abc", "deXY", "Zgh"]) == [["abc"], [], ["deXY", "Z"]]
    assert m.text == "abcdeXYZ"


def test_overlapping_prefixes_release_what_can_no_longer_match():
    m = StopStringMatcher(("aab",), False)
    assert feed(m, ["a", "a", "a", "b"]) == [[], [], ["a"], ["", "", ""]]
    assert m.text == "a"


def test_of_several_stop_strings_the_first_to_complete_wins():
    m = StopStringMatcher(("world", "wor"), False)
    assert feed(m, ["hello ", "w", "o", "rld"]) == [["hello "], [], [], ["", "", ""]]
    assert m.text == "hello "
    m = StopStringMatcher(("yz", "xyz"), True)   # equal ends: the one starting first
    assert feed(m, ["axyzb"]) == [["axyz"]]


def test_a_token_straddling_a_possible_stop_start_is_held_whole():
    m = StopStringMatcher(("wor",), False)
    assert feed(m, ["hello w", "o", "rld"]) == [[], [], ["hello ", "", ""]]


def test_stop_string_inside_one_token():
    m = StopStringMatcher(("\n\n",), False)
    assert feed(m, ["one", ".\n\nTwo"]) == [["one"], ["."]]


def test_final_release_hands_back_held_text():
    m = StopStringMatcher(("STOP",), False)
    assert feed(m, ["x", "ST"]) == [["x"], []]
    assert m.release(final=True) == ["ST"]
    assert m.text == "xST" and not m.matched


def test_without_stop_strings_every_token_is_released_at_once():
    m = StopStringMatcher((), False)
    assert feed(m, ["a", "", "b"]) == [["a"], [""], ["b"]]
    m = StopStringMatcher(("",), False)   # an empty stop string is ignored
    assert feed(m, ["a"]) == [["a"]]


def test_tokens_added_after_a_match_count_with_empty_text():
    m = StopStringMatcher(("b",), False)
    assert m.add("ab") is True
    assert m.add("cd") is False
    assert m.release() == ["a", ""]
    assert m.text == "a"


def test_empty_token_text_while_holding_is_released_in_order():
    m = StopStringMatcher(("abc",), False)
    assert feed(m, ["a", "", "x"]) == [[], [], ["a", "", "x"]]


def _expected_text(full: str, stops: tuple[str, ...], include: bool) -> tuple[str, bool]:
    """Reference: scan end positions; the first stop string to complete (longest at equal end) cuts."""
    stops = tuple(s for s in stops if s)
    for end in range(1, len(full) + 1):
        hits = [s for s in stops if full[:end].endswith(s)]
        if hits:
            start = end - max(len(s) for s in hits)
            return full[: end if include else start], True
    return full, False


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.text(alphabet="ab c", max_size=4), max_size=12),
       stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3).map(tuple),
       include=st.booleans())
def test_released_text_is_per_token_prefix_safe_and_matches_reference(pieces, stops, include):
    m = StopStringMatcher(stops, include)
    expected, should_match = _expected_text("".join(pieces), stops, include)
    released: list[str] = []
    for i, piece in enumerate(pieces):
        m.add(piece)
        released += m.release()
        sent = "".join(released)
        assert expected.startswith(sent)                    # never a fragment of a stop string (C04)
        if not m.matched and len(released) <= i:            # held only while a stop may start in it
            held = "".join(pieces[len(released): i + 1])
            first = pieces[len(released)]
            assert any(s.startswith(held[j:]) for s in m.stops for j in range(len(first)))
    released += m.release(final=True)
    assert len(released) == len(pieces)
    assert "".join(released) == m.text == expected
    assert m.matched == should_match


def test_c04_stop_sequence_spanning_four_tokens_is_never_streamed(tokenizer):
    """C04 (vllm#3574): a stop string over tokens 3..6 must not leak TOK[3] before it matches."""
    text = " D E F G H I J K L M N O P"
    ids = tokenizer.encode(text)
    texts = [tokenizer.decode([i]) for i in ids]
    stop = "".join(texts[3:7])
    full = tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Here is the English alphabet: A B C"))
    m = StopStringMatcher((stop,), False)
    streamed = []
    for token_id in ids:
        matched = m.add(detok.decode_next(token_id))
        streamed += m.release()
        assert stop[: len(texts[3])] not in "".join(streamed)
        if matched:
            break
    assert "".join(streamed) == full[: full.find(stop)] == "".join(texts[:3])
    assert len(streamed) == 7
