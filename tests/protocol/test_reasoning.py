"""protocol/reasoning.py and chat_output.py: recorded DeepSeek-R1 and Qwen3 outputs split into reasoning and
answer, whole and at every token boundary of the demo tokenizer; tool calls read in the answer part only."""
from __future__ import annotations

import json

import pytest

from lmi_handler.engine.sequence import FinishReason
from lmi_handler.protocol.chat_output import ChatOutputRule
from lmi_handler.protocol.reasoning import ReasoningSplitter
from lmi_handler.protocol.tools import ToolRequest
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


WEATHER_TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
AUTO = ToolRequest((WEATHER_TOOL,), "auto")
QWEN_TOOL_TURN = ('<think>\nMaybe <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call> '
                  'is wrong; the user asked for Paris.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                  '"arguments": {"city": "Paris"}}\n</tool_call>')


def whole_and_streamed(rule: ChatOutputRule, text: str, tokenizer) -> tuple[dict, dict]:
    """The message of the whole text, and the streamed deltas joined in the same shape."""
    whole = rule.parser()
    whole.parse(text)
    stream = rule.parser()
    pieces = token_pieces(tokenizer, text)
    deltas = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    joined = {"reasoning_content": "".join(d.reasoning for d in deltas) or None,
              "content": "".join(d.content for d in deltas) or None,
              "tool_calls": [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.tool_calls]}
    return whole.message(), joined


def test_tool_calls_are_read_in_the_answer_part_only_whole_and_streamed(tokenizer):
    rule = ChatOutputRule("qwen3", AUTO, "hermes")
    message, streamed = whole_and_streamed(rule, QWEN_TOOL_TURN, tokenizer)
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}]
    assert "Rome" in message["reasoning_content"] and message["content"] is None
    assert streamed["reasoning_content"] == message["reasoning_content"] and streamed["content"].strip() == ""
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in message["tool_calls"]]


def test_finish_reason_is_tool_calls_only_when_calls_were_made_and_generation_ended_by_itself():
    parser = ChatOutputRule(None, AUTO, "hermes").parser()
    parser.parse(QWEN_TOOL_TURN.split("</think>")[1])
    assert parser.finish_reason(FinishReason.EOS_TOKEN) == "tool_calls"
    assert parser.finish_reason(FinishReason.STOP_SEQUENCE) == "tool_calls"
    assert parser.finish_reason(FinishReason.LENGTH) == "length"
    plain = ChatOutputRule(None, AUTO, "hermes").parser()
    plain.parse("Paris is sunny.")
    assert plain.finish_reason(FinishReason.EOS_TOKEN) == "stop"
    assert plain.message() == {"role": "assistant", "content": "Paris is sunny."}


def test_a_legacy_functions_request_also_gets_function_call():
    parser = ChatOutputRule(None, ToolRequest((WEATHER_TOOL,), "named", "get_weather", legacy=True)).parser()
    parser.parse('{"city": "Paris"}')
    message = parser.message()
    assert message["function_call"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert message["tool_calls"][0]["function"] == message["function_call"]
