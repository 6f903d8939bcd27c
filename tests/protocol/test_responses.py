"""protocol/responses.py and formatters/responses.py: a Responses body checked and turned into the chat it runs as,
the fields refused by name, the bounded store; the Response object and its stream events from hand-made engine
outputs (plain text, reasoning, tool calls, max_output_tokens, a failure)."""
from __future__ import annotations

import json

import pytest

from lmi_handler.engine.sequence import FinishReason, RequestOutput
from lmi_handler.protocol.chat_output import ChatOutputRule
from lmi_handler.protocol.encoder import Event, Wire, encode
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.plan import Kind
from lmi_handler.protocol.responses import ResponsesRequest, ResponseStore
from lmi_handler.protocol.tools import parse_tool_request
from tests.protocol.helpers import make_plan, tok

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def parse(kept: ResponseStore | None = None, **body) -> ResponsesRequest:
    return ResponsesRequest.parse({"model": "m", "input": "Hi", **body}, kept)


def refusal(**body) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as info:
        parse(**body)
    return info.value


# ---- the request ------------------------------------------------------------------------------

def test_a_string_input_is_one_user_message_after_the_instructions():
    request = parse(instructions="Be brief.", input="Hello")
    assert request.chat.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert request.context.messages == ({"role": "user", "content": "Hello"},)    # instructions are not kept


def test_input_items_become_chat_messages_calls_sharing_one_assistant_turn():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                                       "text": "in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]
    messages = parse(input=items).chat.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[0]["content"] == "Weather in Paris?"
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_function_tools_text_format_and_max_output_tokens_reach_the_chat_request():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = parse(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=7,
                    temperature=0.5, top_p=0.9)
    assert request.chat.tools.mode == "named" and request.chat.tools.name == "get_weather"
    params = request.chat.to_generation_parameters()
    assert (params.max_new_tokens, params.temperature, params.top_p) == (7, 0.5, 0.9)
    formatted = parse(text={"format": {"type": "json_schema", "name": "a", "schema": schema}}).chat
    assert formatted.to_generation_parameters().constraint[0] == "response_format"
    assert parse(text={"format": {"type": "json_object"}}).chat.to_generation_parameters().constraint is not None
    assert parse(text={"format": {"type": "text"}}).chat.to_generation_parameters().constraint is None


@pytest.mark.parametrize("body, field", [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
])
def test_a_field_this_server_does_not_serve_is_refused_naming_it(body, field):
    error = refusal(**body)
    assert (error.status_code, error.field) == (400, field)
    assert f"`{field}`" in error.message


@pytest.mark.parametrize("body, field", [
    ({"input": ""}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"store": "yes"}, "store"),
    ({"instructions": 5}, "instructions"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"tools": [{**WEATHER, "parameters": {"type": "bogus"}}], "tool_choice": "required"}, "tools[0].parameters.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"previous_response_id": 5}, "previous_response_id"),
])
def test_a_bad_value_is_refused_naming_the_field_as_the_responses_body_spells_it(body, field):
    error = refusal(**body)
    assert (error.status_code, error.field) == (400, field)


def test_previous_response_id_prepends_the_stored_conversation_and_an_unknown_one_is_a_404():
    store = ResponseStore(4)
    first = parse(store, input="Hi")
    store.put({"id": first.context.response_id}, (*first.context.messages, {"role": "assistant", "content": "Hello"}))
    follow = parse(store, input="And?", previous_response_id=first.context.response_id, instructions="New rules.")
    assert [m["content"] for m in follow.chat.messages] == ["New rules.", "Hi", "Hello", "And?"]
    with pytest.raises(RequestValidationError) as info:
        parse(store, previous_response_id="resp_unknown")
    assert (info.value.status_code, info.value.field) == (404, "previous_response_id")


def test_the_store_keeps_the_newest_responses_up_to_its_size_and_store_false_keeps_none():
    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, ())
    assert (store.get("resp_0"), len(store)) == (None, 2) and store.get("resp_2").body == {"id": "resp_2"}
    assert parse(store).context.store is store and parse(store).context.echo["store"] is True
    assert parse(store, store=False).context.store is None
    off = parse(ResponseStore(0))
    assert off.context.store is None and off.context.echo["store"] is False


# ---- the answer -------------------------------------------------------------------------------

def plan_of(request: ResponsesRequest, stream: bool, rule: ChatOutputRule | None = None):
    return make_plan(Kind.OPENAI_RESPONSES, Wire.SSE if stream else Wire.JSON, responses=request.context,
                     chat_output=rule)


def outputs(pieces: list[str], reason: FinishReason = FinishReason.EOS_TOKEN) -> list[RequestOutput]:
    text, outs = "", []
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        outs.append(RequestOutput("abc", [tok(i + 1, piece)], text, last, reason if last else None, 5, i + 1))
    return outs


def events_of(plan, outs: list[RequestOutput]) -> list[dict]:
    """The events as the client reads them: `event: <type>` then its data, sequence numbers in order."""
    from lmi_handler.protocol.formatters import StreamAnswer
    from lmi_handler.protocol.sequences import members

    stream = StreamAnswer(plan, members("abc", plan.prompts[0].params, plan.sequences, 0))
    events = []
    for out in outs:
        for block in filter(None, encode(stream.events({"abc": out}), Wire.SSE).split("\n\n")):
            name, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def whole(plan, outs: list[RequestOutput]) -> dict:
    from tests.protocol.helpers import run

    return json.loads(run(plan, outs)[-1])


def test_a_streamed_response_sends_the_documented_events_and_its_deltas_join_to_the_text():
    store = ResponseStore(8)
    request = parse(store)
    events = events_of(plan_of(request, stream=True), outputs(["Hel", "lo", " you"]))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == "Hello you"
    assert final["status"] == "completed" and final["usage"] == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    stored = store.get(final["id"])
    assert stored.body == final and stored.messages[-1] == {"role": "assistant", "content": "Hello you"}


def test_the_whole_response_has_the_streamed_ones_items_and_stops_incomplete_at_max_output_tokens():
    request = parse(ResponseStore(8))
    body = whole(plan_of(request, stream=False), outputs(["Hel", "lo"], FinishReason.LENGTH))
    assert body["object"] == "response" and body["id"] == request.context.response_id
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(i["type"], i["status"], i["content"][0]["text"]) for i in body["output"]] == [
        ("message", "incomplete", "Hello")]
    streamed = events_of(plan_of(parse(), stream=True), outputs(["Hel", "lo"], FinishReason.LENGTH))
    assert streamed[-1]["type"] == "response.incomplete"
    assert streamed[-1]["response"]["output"][0]["content"] == body["output"][0]["content"]


def test_reasoning_becomes_a_reasoning_item_before_the_message():
    rule = ChatOutputRule(reasoning_parser="deepseek_r1")
    pieces = ["Let me ", "think.</th", "ink>The ", "answer."]
    body = whole(plan_of(parse(), stream=False, rule=rule), outputs(pieces))
    assert [(i["type"], i["content"][0]["text"]) for i in body["output"]] == [
        ("reasoning", "Let me think."), ("message", "The answer.")]
    events = events_of(plan_of(parse(), stream=True, rule=rule), outputs(pieces))
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, answer) == ("Let me think.", "The answer.")
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]


def test_tool_calls_become_function_call_items_and_are_stored_as_the_assistants_calls():
    tools = parse_tool_request({"tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                            if k != "type"}}],
                                "tool_choice": "required"})
    rule = ChatOutputRule(tools=tools)
    pieces = ['[{"name": "get_weather", ', '"parameters": {"city": "Paris"}}]']
    store = ResponseStore(8)
    body = whole(plan_of(parse(store), stream=False, rule=rule), outputs(pieces))
    (call,) = body["output"]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "get_weather",
                                                                           {"city": "Paris"})
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_") and call["status"] == "completed"
    assert store.get(body["id"]).messages[-1]["tool_calls"][0]["id"] == call["call_id"]
    events = events_of(plan_of(parse(), stream=True, rule=rule), outputs(pieces))
    assert [e["type"] for e in events[2:]] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[-2]["item"]["arguments"] == call["arguments"]


def test_a_failed_response_says_failed_with_its_error_and_is_not_stored():
    store = ResponseStore(8)
    request = parse(store)
    outs = outputs(["Hi"])[:1]
    outs[0] = RequestOutput("abc", [tok(1, "Hi")], "Hi", False, None, 5, 1)
    outs.append(RequestOutput("abc", [], "Hi", True, FinishReason.ERROR, 5, 1, error="engine failed"))
    events = events_of(plan_of(request, stream=True), outs)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "engine failed"}
    assert len(store) == 0


def test_an_event_is_named_under_sse_and_plain_in_jsonlines():
    event = Event("response.created", {"type": "response.created"})
    assert encode([event], Wire.SSE) == 'event: response.created\ndata: {"type": "response.created"}\n\n'
    assert encode([event], Wire.JSONLINES) == '{"type": "response.created"}\n'


def test_a_named_tool_choices_arguments_stream_in_pieces_into_one_function_call_item():
    tools = parse_tool_request({"tools": [{"type": "function", "function": {"name": "get_weather"}}],
                                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    rule = ChatOutputRule(tools=tools)
    pieces = ['{"city": ', '"Paris"', "}"]
    events = events_of(plan_of(parse(), stream=True, rule=rule), outputs(pieces))
    assert [e["type"] for e in events[2:]] == [
        "response.output_item.added", *["response.function_call_arguments.delta"] * 3,
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    joined = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    (item,) = events[-1]["response"]["output"]
    assert joined == item["arguments"] == '{"city": "Paris"}' and item["name"] == "get_weather"
    body = whole(plan_of(parse(), stream=False, rule=rule), outputs(pieces))
    assert [(i["type"], i["arguments"]) for i in body["output"]] == [("function_call", '{"city": "Paris"}')]
