"""server/responses.py: /v1/responses through the `openai` package's client.responses and OpenAI's Agents SDK on
the demo model: plain, streamed, a function tool and its output sent back, previous_response_id, GET by id, the
404 and the 400s naming the field.

The server runs tool_choice auto (hermes) so that an agent's turn after its tool call (the SDK resets tool_choice
to the default) is served; the demo model writes no calls of its own, so the tool turns name their tool and
decode under its schema.
"""
from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest

from tests.helpers import serve

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}},
                          "required": ["city"], "additionalProperties": False}}
NAMED = {"type": "function", "name": "get_weather"}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def responses_server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, "responses", num_threads="1", enable_auto_tool_choice="true",
                     tool_call_parser="hermes", responses_store_size="4")


@pytest.fixture(scope="module")
def sdk(responses_server):
    return openai.OpenAI(base_url=responses_server.url + "/v1", api_key="unused", max_retries=0)


def create(sdk, **fields):
    return sdk.responses.create(**{"model": "model", "input": "Name three colors.", "temperature": 0,
                                   "max_output_tokens": 16, **fields})


def test_a_plain_response_answers_text_with_its_usage(sdk):
    reply = create(sdk, instructions="Answer briefly.")
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == "model"
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant" and reply.output_text
    assert reply.usage.output_tokens <= 16 and reply.usage.input_tokens > 0
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.status == ("incomplete" if reply.usage.output_tokens == 16 else "completed")
    assert reply.instructions == "Answer briefly." and reply.max_output_tokens == 16


def test_a_streamed_response_sends_the_event_sequence_and_its_deltas_join_to_the_whole_answers_text(sdk):
    whole = create(sdk)
    events = list(create(sdk, stream=True))
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text         # greedy: the same text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_function_tool_call_and_its_output_sent_back_get_an_answer(sdk):
    call_reply = create(sdk, input=QUESTION, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=30)
    (call,) = call_reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "London", "Tokyo") and call_reply.status == "completed"
    history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = create(sdk, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=12)
    assert answer.output_text and [item.type for item in answer.output] == ["message"]


def test_a_streamed_tool_call_arrives_as_a_function_call_item(sdk):
    events = list(create(sdk, input=QUESTION, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=30,
                         stream=True))
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"] in ("Paris", "London", "Tokyo")
    assert events[-1].type == "response.completed" and events[-1].response.output[0].type == "function_call"


def test_previous_response_id_continues_the_stored_conversation_get_returns_it_and_delete_drops_it(sdk):
    first = create(sdk, input="My name is Ada.", max_output_tokens=8)
    assert sdk.responses.retrieve(first.id).output_text == first.output_text
    follow = create(sdk, input="What is my name?", previous_response_id=first.id, max_output_tokens=8)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens   # the history came first
    sdk.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(follow.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(follow.id)
    unstored = create(sdk, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as info:
        sdk.responses.retrieve(unstored.id)
    assert info.value.body["param"] == "response_id"


def test_an_unknown_id_is_a_404_in_openais_error_shape(sdk, responses_server):
    with pytest.raises(openai.NotFoundError) as info:
        create(sdk, previous_response_id="resp_unknown")
    assert info.value.body["param"] == "previous_response_id" and info.value.body["type"] == "invalid_request_error"
    answer = httpx.get(responses_server.url + "/v1/responses/resp_unknown")
    assert answer.status_code == 404
    assert answer.json() == {"error": {"message": "Response with id 'resp_unknown' not found",
                                       "type": "invalid_request_error", "param": "response_id", "code": 404}}


def test_the_store_keeps_only_the_newest_responses_of_its_size(sdk):
    ids = [create(sdk, input=f"Count to {i}.", max_output_tokens=1).id for i in range(5)]  # responses_store_size=4
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(ids[0])
    assert sdk.responses.retrieve(ids[-1]).id == ids[-1]


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice.type"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"temperature": 5}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice.name"),
    ({"input": "word " * 10000}, "input"),
])
def test_a_refused_field_or_bad_value_is_a_400_naming_it(sdk, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(sdk, **fields)
    assert info.value.body["param"] == param, info.value.body


def test_the_route_is_counted_in_metrics_and_takes_the_deadline_header_as_the_chat_route_does(sdk, responses_server):
    from tests.server.helpers import metric

    create(sdk, max_output_tokens=1)
    with httpx.Client(base_url=responses_server.url, timeout=60) as http:
        assert metric(http, 'lmi_http_requests_total{code="200",route="/v1/responses"}') >= 1
        late = http.post("/v1/responses", json={"model": "model", "input": "Hi"}, headers={"X-Request-Timeout": "-1"})
    assert late.status_code == 400 and late.json()["error"]["type"] == "invalid_request_error"


def test_text_format_json_schema_answers_json_that_validates(sdk):
    import jsonschema

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    reply = create(sdk, input="Pick a color.", max_output_tokens=20,
                   text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), schema)


def test_the_agents_sdk_drives_a_tool_loop_against_the_server(responses_server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny and 21 C in {city}"

    client = openai.AsyncOpenAI(base_url=responses_server.url + "/v1", api_key="unused", max_retries=0)
    # a named tool_choice makes the demo model call; the SDK then resets it (reset_tool_choice) and the next
    # turn, tool_choice auto, answers in text: one round trip of the loop
    agent = Agent(name="weather", instructions="Answer in one short sentence.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="model", openai_client=client),
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=24))
    result = Runner.run_sync(agent, QUESTION, max_turns=4)
    assert asked and asked[0] in ("Paris", "London", "Tokyo")
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


@pytest.fixture(scope="module")
def thinking_sdk(model_dir, tmp_path_factory):
    """deepseek_r1 on a Qwen3-style template: the output starts inside the reasoning (the test template of
    tests/test_chat_template.py)."""
    from tests.helpers import REPO

    for server in serve(tmp_path_factory, "responses-thinking", num_threads="1", reasoning_parser="deepseek_r1",
                        chat_template=str(REPO / "tests" / "chat_templates" / "qwen3_style.jinja")):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_reasoning_parsers_text_answers_as_a_reasoning_item_streamed_and_not(thinking_sdk):
    """8 tokens never reach </think>: all of it is reasoning, in a reasoning item, and the message is empty."""
    fields = {"model": "model", "input": "Why is the sky blue?", "temperature": 0, "max_output_tokens": 8}
    reply = thinking_sdk.responses.create(**fields)
    reasoning = reply.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text and reply.output_text == ""
    events = list(thinking_sdk.responses.create(**fields, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning"]
