"""protocol/tool_parsers.py: each option.tool_call_parser reads its family's recorded output, whole and split at
every token boundary of the demo tokenizer; the constrained forms of tool_choice required and named."""
from __future__ import annotations

import json

import pytest

from lmi_handler.protocol.tool_parsers import PARSERS, NamedCallStream, RequiredParser, ToolCallStream
from tests.protocol.helpers import token_pieces

# Recorded outputs in each family's format, as its documentation and chat template show them, and the calls in
# them as (name, arguments).
WEATHER = {"location": "San Francisco, CA, USA"}
RECORDED = {
    # Qwen2.5 / Qwen3 function-calling docs (hermes template: "<tool_call>\n{...}\n</tool_call>" per call)
    "hermes": [
        ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, '
         'CA, USA", "date": "2024-10-01"}}\n</tool_call>',
         "", [("get_current_temperature", WEATHER),
              ("get_temperature_date", {**WEATHER, "date": "2024-10-01"})]),
        ('I will look it up.\n\n<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
         '"San Francisco, CA, USA"}}\n</tool_call>', "I will look it up.\n\n", [("get_current_temperature", WEATHER)]),
    ],
    # Llama 3.1 prompt format docs (JSON-based tool calling), and after <|python_tag|>; calls joined by "; "
    "llama3_json": [
        ('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
         "", [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
         "", [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ],
    # Mistral-7B-Instruct-v0.3's model card (v3 tokenizer) and the v11 tokenizer's name[ARGS]{...} form
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
         '"format": "celsius"}}]', "",
         [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
        ('[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}', "",
         [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    ],
    # Llama 3.2 (zero-shot function calling) and vLLM's pythonic parser docs; Llama 4 wraps it in python tags
    "pythonic": [
        ("[get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', metric='celsius')]",
         "", [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
              ("get_weather", {"city": "Seattle", "metric": "celsius"})]),
        ("[get_user_info(user_id=7890, special='black', tags=['a', 'b'], active=True)]", "",
         [("get_user_info", {"user_id": 7890, "special": "black", "tags": ["a", "b"], "active": True})]),
        ("<|python_start|>[get_time()]<|python_end|>", "", [("get_time", {})]),
    ],
}
CASES = [(name, *case) for name, cases in RECORDED.items() for case in cases]
PLAIN = ["The weather in Paris is sunny, 21 degrees.", "[1] Paris is the capital of France.",
         "{not json} but an answer", "Use <tool> tags or [TOOL] markers in prose."]


def run(parser, pieces: list[str]) -> tuple[str, list[dict]]:
    """Feed the pieces, finish; the content sent and the calls' deltas, in order."""
    stream = ToolCallStream(parser)
    content, deltas = "", []
    for piece in pieces:
        text, calls = stream.feed(piece)
        content, deltas = content + text, deltas + calls
    text, calls = stream.finish()
    return content + text, deltas + calls


def calls_of(deltas: list[dict]) -> list[tuple[str, dict]]:
    return [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_each_parser_reads_its_familys_recorded_output_whole(parser, text, content, calls):
    got_content, deltas = run(PARSERS[parser](), [text])
    assert (got_content, calls_of(deltas)) == (content, calls)
    assert [d["index"] for d in deltas] == list(range(len(calls)))
    assert all(d["id"].startswith("call_") and d["type"] == "function" for d in deltas)
    assert len({d["id"] for d in deltas}) == len(deltas)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_each_parser_reads_the_same_output_split_at_every_token_boundary(parser, text, content, calls, tokenizer):
    pieces = token_pieces(tokenizer, text)
    assert len(pieces) > 5 and "".join(pieces) == text
    got_content, deltas = run(PARSERS[parser](), pieces)
    assert (got_content, calls_of(deltas)) == (content, calls)


@pytest.mark.parametrize("parser", sorted(PARSERS))
@pytest.mark.parametrize("text", PLAIN)
def test_text_without_calls_is_all_content_whole_or_streamed(parser, text, tokenizer):
    assert run(PARSERS[parser](), [text]) == (text, [])
    assert run(PARSERS[parser](), token_pieces(tokenizer, text)) == (text, [])


def test_content_streams_before_the_call_arrives_and_a_call_goes_out_once_complete(tokenizer):
    text = RECORDED["hermes"][1][0]
    stream = ToolCallStream(PARSERS["hermes"]())
    seen = [stream.feed(piece) for piece in token_pieces(tokenizer, text)]
    first_call = next(i for i, (_, calls) in enumerate(seen) if calls)
    assert "".join(c for c, _ in seen[:first_call]) == "I will look it up.\n\n"
    assert text[:sum(len(p) for p in token_pieces(tokenizer, text)[:first_call + 1])].endswith("</tool_call>")


def test_a_call_whose_json_is_cut_off_leaves_the_text_as_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert run(PARSERS["hermes"](), [text]) == (text, [])


def test_required_reads_the_constrained_array_element_by_element(tokenizer):
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    stream = ToolCallStream(RequiredParser())
    pieces = token_pieces(tokenizer, text)
    seen = [stream.feed(p)[1] for p in pieces] + [stream.finish()[1]]
    assert calls_of([d for calls in seen for d in calls]) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert seen.index(next(c for c in seen if c)) < len(pieces) - 5      # the first before the array ends


def test_named_streams_the_id_and_name_first_then_argument_pieces(tokenizer):
    text = '{"city": "Paris", "unit": "celsius"}'
    stream = NamedCallStream("get_weather")
    deltas = [d for p in token_pieces(tokenizer, text) for d in stream.feed(p)[1]] + stream.finish()[1]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    assert all("id" not in d and "name" not in d["function"] for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == text
    assert [c.message()["function"] for c in stream.calls] == [{"name": "get_weather", "arguments": text}]
