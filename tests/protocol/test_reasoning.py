"""protocol/reasoning.py: recorded DeepSeek-R1 and Qwen3 outputs split into reasoning and answer, whole and at
every token boundary of the demo tokenizer."""
from __future__ import annotations

import pytest

from lmi_handler.protocol.reasoning import ReasoningSplitter
from tests.protocol.helpers import token_pieces

# DeepSeek-R1's template opens <think> in the prompt: its output starts inside the reasoning (R1's model card:
# "<think>\n" is enforced at the start). Qwen3 writes <think> itself (Qwen3's model card, thinking mode).
R1_REASONING = "Okay, so I need to find 1 + 1. Adding one and one gives two.\n"
R1_ANSWER = "\n\nThe sum of 1 and 1 is **2**."
QWEN_REASONING = "\nOkay, the user said hello. I should greet them back.\n"
QWEN_ANSWER = "\n\nHello! How can I help you today?"
RECORDED = [
    ("deepseek_r1", R1_REASONING + "</think>" + R1_ANSWER, R1_REASONING, R1_ANSWER),
    ("deepseek_r1", "<think>\n" + R1_REASONING + "</think>" + R1_ANSWER, "\n" + R1_REASONING, R1_ANSWER),
    ("deepseek_r1", R1_REASONING, R1_REASONING, ""),                       # cut before </think>: all reasoning
    ("qwen3", "<think>" + QWEN_REASONING + "</think>" + QWEN_ANSWER, QWEN_REASONING, QWEN_ANSWER),
    ("qwen3", "<think>\n\n</think>\n\n" + QWEN_ANSWER.strip(), "\n\n", "\n\n" + QWEN_ANSWER.strip()),
    ("qwen3", QWEN_ANSWER.strip(), "", QWEN_ANSWER.strip()),             # enable_thinking=false: no tags at all
]


def split(parser: str, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(parser)
    parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    return "".join(r for r, _ in parts), "".join(a for _, a in parts)


@pytest.mark.parametrize(("parser", "text", "reasoning", "answer"), RECORDED)
def test_reasoning_parser_splits_recorded_output_whole(parser, text, reasoning, answer):
    assert split(parser, [text]) == (reasoning, answer)


@pytest.mark.parametrize(("parser", "text", "reasoning", "answer"), RECORDED)
def test_reasoning_parser_splits_the_same_output_streamed_at_every_token_boundary(parser, text, reasoning, answer,
                                                                                 tokenizer):
    pieces = token_pieces(tokenizer, text)
    assert len(pieces) > 5
    assert split(parser, pieces) == (reasoning, answer)


def test_reasoning_streams_before_the_answer_starts(tokenizer):
    splitter = ReasoningSplitter("qwen3")
    parts = [splitter.feed(p) for p in token_pieces(tokenizer, RECORDED[3][1])]
    first_answer = next(i for i, (_, a) in enumerate(parts) if a)
    assert "".join(r for r, _ in parts[:first_answer]) == QWEN_REASONING


def test_an_unknown_reasoning_parser_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningSplitter("o1")
