"""protocol/tools.py through ChatCompletionRequest: tools and tool_choice checked (bad ones answer 400 naming the
field), the legacy functions mapped to them, and the JSON-schema constraint of required and named."""
from __future__ import annotations

import json

import jsonschema
import pytest

from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.openai import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city"]}}
TIME = {"name": "get_time"}        # no parameters: takes none
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.parse({"messages": MESSAGES, **fields})


def refused(**fields) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as info:
        chat(**fields).to_generation_parameters()
    assert info.value.status_code == 400 and f"`{info.value.field}`" in info.value.message
    return info.value


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"tools": [{"type": "function", "function": {**WEATHER, "parameters": "an object"}}]},
     "tools[0].function.parameters", "JSON Schema object"),
    ({"tools": [{"type": "function", "function": {**WEATHER, "parameters": {"type": "banana"}}}]},
     "tools[0].function.parameters.type", "not a valid JSON Schema"),
    ({"tools": [TOOLS[1], {"type": "function", "function": {**WEATHER, "parameters": {"required": "city"}}}]},
     "tools[1].function.parameters.required", "not a valid JSON Schema"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name",
     "non-empty string"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", '"type": "function"'),
    ({"tools": {"type": "function"}}, "tools", "a list"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "given twice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
     "tool_choice.function.name", "'get_stock'"),
    ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice.function.name",
     "none were sent"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", '"required"'),
    ({"tools": TOOLS, "functions": [WEATHER]}, "functions", "not both"),
    ({"functions": [WEATHER], "function_call": {"name": "get_stock"}}, "function_call.name", "'get_stock'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "one structured-output constraint"),
])
def test_bad_tools_answer_400_naming_the_field(fields, field, words):
    error = refused(**fields)
    assert error.field == field and words in error.message


def test_completions_still_refuse_tools_as_not_implemented():
    with pytest.raises(RequestValidationError) as info:
        CompletionRequest.parse({"prompt": "Hi", "tools": TOOLS})
    assert info.value.field == "tools" and "not supported" in info.value.message


def test_tool_choice_defaults_to_auto_with_tools_and_none_without():
    assert chat(tools=TOOLS).tools.mode == "auto"
    assert chat().tools is None and chat(tools=[], tool_choice="none").tools is None
    assert chat(tools=TOOLS, tool_choice="none").tools.mode == "none"


def test_auto_and_none_leave_the_output_unconstrained():
    for choice in ("auto", "none"):
        assert chat(tools=TOOLS, tool_choice=choice).to_generation_parameters().constraint is None


def constraint_schema(request: ChatCompletionRequest) -> dict:
    field, spec = request.to_generation_parameters().constraint
    assert field == "tool_choice"
    return json.loads(spec.value)


def test_a_named_tool_decodes_under_its_parameters_schema():
    schema = constraint_schema(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert schema == WEATHER["parameters"]
    schema = constraint_schema(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    jsonschema.validate({}, schema)


def test_required_decodes_under_an_array_of_calls_to_the_tools():
    schema = constraint_schema(chat(tools=TOOLS, tool_choice="required"))
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_stock", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = constraint_schema(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, one)


def test_legacy_functions_and_function_call_map_to_tools_and_tool_choice():
    request = chat(functions=[WEATHER], function_call={"name": "get_weather"})
    assert (request.tools.mode, request.tools.name, request.tools.legacy) == ("named", "get_weather", True)
    assert request.tools.template_tools() == [{"type": "function", "function": WEATHER}]
    assert chat(functions=[WEATHER], function_call="none").tools.mode == "none"
    assert chat(functions=[WEATHER]).tools.mode == "auto"


def test_a_tool_turn_in_the_history_reaches_the_template_with_argument_objects():
    request = chat(messages=[
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "function", "name": "get_time", "content": "noon"}])
    messages = request.text_messages()
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["content"] == "" and messages[2]["content"] == "21 C"
    assert messages[3] == {"role": "tool", "name": "get_time", "content": "noon"}


@pytest.mark.parametrize(("fields", "field"), [
    ({"continue_final_message": True}, "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
])
def test_bad_template_controls_answer_400_naming_the_field(fields, field):
    assert refused(**fields).field == field
