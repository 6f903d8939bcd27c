"""Tests for engine/detokenizer.py with the real SmolLM2 tokenizer: multi-byte text, spaces, special tokens."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_handler.engine.detokenizer import IncrementalDetokenizer

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
MULTIBYTE_TEXTS = [
    "我很好😀。我很好😀。我很好😀。我很好😀。",                      # C01 (TGI#333)
    "日本語のテキスト、한국어 텍스트, 中文：你好！",
    "Family: 👨‍👩‍👧‍👦, flags 🇯🇵🇫🇷, skin 👍🏽, math 𝔸𝔹ℂ",
    "Ünïcödé àçcénts — “quotes” … ½ € ™",
    "emoji at the end 🎉🎉",
    "Ελληνικά και русский и العربية",
]


def stream(tokenizer, ids: list[int], skip_special_tokens: bool = True, prompt: str = PROMPT) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), skip_special_tokens)
    return [detok.decode_next(token_id) for token_id in ids]


def assert_clean(pieces: list[str]) -> None:
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")   # raises on a lone surrogate


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_text_streams_whole_characters_and_joins_to_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)   # the case is real: tokens split chars
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert_clean(pieces)


def test_each_cjk_character_and_emoji_arrives_intact_in_one_piece(tokenizer):
    text = MULTIBYTE_TEXTS[0]
    pieces = stream(tokenizer, tokenizer.encode(text))
    assert [p for p in pieces if p] == ["我", "很", "好", "😀", "。"] * 4


def test_leading_spaces_are_preserved(tokenizer):
    text = "  two spaces, then\n\n  indented code    and tabs\t\tend"
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids, prompt="Hi")
    assert "".join(pieces) == text
    assert pieces[0].startswith(" ")
    assert stream(tokenizer, tokenizer.encode(" hello world"))[:2] == [" hello", " world"]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(tokenizer, skip):
    ids = tokenizer.encode("<|im_start|>assistant\nHi!<|im_end|>")
    pieces = stream(tokenizer, ids, skip_special_tokens=skip)
    assert pieces == [tokenizer.decode([i], skip_special_tokens=skip) for i in ids]
    assert (pieces[0], pieces[-1]) == (("", "") if skip else ("<|im_start|>", "<|im_end|>"))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_is_special_covers_every_token_decode_skips(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    for token_id in range(40):
        skipped = tokenizer.decode([token_id], skip_special_tokens=True) == ""
        assert detok.is_special(token_id) == skipped, token_id
    assert detok.is_special(tokenizer.eos_token_id)


def test_prompt_tokens_get_per_token_texts_by_the_same_rules(tokenizer):
    ids = tokenizer.encode(PROMPT + "我很好😀")
    for skip in (True, False):
        texts = IncrementalDetokenizer(tokenizer, ids, skip).decode_prompt_tokens()
        assert len(texts) == len(ids)
        assert "".join(texts) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert_clean(texts)


def test_output_cut_mid_character_holds_back_the_partial_bytes(tokenizer):
    """The documented exception: a trailing incomplete character is never emitted (full decode shows U+FFFD)."""
    ids = tokenizer.encode("ok 😀")
    cut = ids[:-1]
    assert tokenizer.decode(cut) == "ok \ufffd"
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.decode_next(i) for i in cut]
    assert "".join(pieces) == "ok"          # " " shares its token with the emoji's first bytes
    assert detok.flush() == " "             # complete characters held with them come back at the end
    assert detok.flush() == ""
    assert_clean(pieces)


def test_invalid_bytes_followed_by_text_decode_like_full_decode(tokenizer):
    broken = tokenizer.encode("😀")[:1] + tokenizer.encode(" fine")
    pieces = stream(tokenizer, broken)
    assert "".join(pieces) == tokenizer.decode(broken)


def stream_and_flush(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    return [detok.decode_next(token_id) for token_id in ids], detok.flush()


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_any_text_round_trips_token_by_token(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces, tail = stream_and_flush(tokenizer, ids)
    full = tokenizer.decode(ids)   # lossy for a few code points this vocabulary cannot spell (U+FFFD)
    if not full.endswith("\ufffd"):
        assert "".join(pieces) == full and tail == ""
    assert "".join(pieces) + tail == full.rstrip("\ufffd")
    if "\ufffd" not in full:
        assert_clean(pieces)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(min_value=17, max_value=49151), max_size=30))
def test_random_token_ids_join_to_full_decode_up_to_a_held_tail(tokenizer, ids):
    pieces, tail = stream_and_flush(tokenizer, ids)
    full = tokenizer.decode(ids)
    assert full.startswith("".join(pieces))
    assert "".join(pieces) + tail == full.rstrip("\ufffd")
