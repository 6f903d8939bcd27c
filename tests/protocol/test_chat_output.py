"""protocol/chat_output.py: generated text -> reasoning_content, content and tool_calls, whole and streamed
(tool calls read in the answer part only), and the chat formatters that send them (message, deltas,
finish_reason "tool_calls")."""
from __future__ import annotations

import json

from lmi_handler.engine.sequence import FinishReason, RequestOutput, TokenOutput
from lmi_handler.protocol.chat_output import ChatOutputRule
from lmi_handler.protocol.encoder import Wire
from lmi_handler.protocol.plan import Kind
from lmi_handler.protocol.tools import ToolRequest
from tests.protocol.helpers import lines_of, make_plan, run, token_pieces

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


def outputs(pieces: list[str], reason: FinishReason) -> list[RequestOutput]:
    """One engine step per piece, the last finished with `reason`."""
    text, outs = "", []
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        outs.append(RequestOutput("abc", [TokenOutput(i, piece, -0.5, False)], text, last, reason if last else None,
                                  4, i + 1))
    return outs


NAMED_RULE = ChatOutputRule(None, ToolRequest((WEATHER_TOOL,), "named", "get_weather"))


def test_a_named_tool_answer_is_a_tool_call_message_with_finish_reason_tool_calls():
    plan = make_plan(Kind.OPENAI_CHAT, chat_output=NAMED_RULE)
    (body,) = [json.loads(text) for text in run(plan, outputs(['{"city": ', '"Paris"}'], FinishReason.EOS_TOKEN))
               if text]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and call["type"] == "function"


def test_a_streamed_named_tool_sends_openais_tool_call_deltas_and_ends_with_tool_calls():
    plan = make_plan(Kind.OPENAI_CHAT, Wire.SSE, chat_output=NAMED_RULE)
    chunks = [c for text in run(plan, outputs(['{"city": ', '"Paris"}'], FinishReason.EOS_TOKEN))
              for c in lines_of(text, sse=True)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert deltas[1]["tool_calls"] == [{"index": 0, "function": {"arguments": '"Paris"}'}}]
    assert all(d["content"] is None for d in deltas)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "tool_calls"]


def test_a_stream_sends_nothing_while_the_parser_holds_text_back_then_the_reasoning_and_answer():
    plan = make_plan(Kind.OPENAI_CHAT, Wire.SSE, chat_output=ChatOutputRule("qwen3"))
    sent = run(plan, outputs(["<th", "ink>Hm", "m</th", "ink>Hi"], FinishReason.LENGTH))
    assert sent[0] == ""                                      # "<th" may be <think>: held back
    deltas = [c["choices"][0]["delta"] for text in sent for c in lines_of(text, sse=True)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm"
    assert "".join(d["content"] or "" for d in deltas) == "Hi"
    assert lines_of(sent[-1], sse=True)[-1]["choices"][0]["finish_reason"] == "length"
