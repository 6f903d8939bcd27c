"""chat_template.py and option.chat_template: chat_template_kwargs, tools, add_generation_prompt and
continue_final_message reach the template; a template error is the client's 400 with the template's message.
On a real server with its own template (slow): also option.reasoning_parser and tool_choice auto."""
from __future__ import annotations

import json

import pytest

from lmi_handler.chat_template import ChatTemplate
from lmi_handler.config import ConfigError, Settings
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.openai import ChatCompletionRequest

QWEN3_STYLE = "tests/chat_templates/qwen3_style.jinja"
ASK = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def qwen3_style(tokenizer) -> ChatTemplate:
    """The demo tokenizer with the Qwen3-style test template, read as option.chat_template reads a file."""
    from tests.helpers import REPO

    settings = Settings.from_properties({"chat_template": QWEN3_STYLE, "model_dir": str(REPO)}, environ={})
    return ChatTemplate(tokenizer, settings.chat_template_text())


def render(template: ChatTemplate, **fields) -> str:
    return template.render(ChatCompletionRequest.parse({"messages": ASK, **fields}))


def test_enable_thinking_false_reaches_a_qwen3_style_template(qwen3_style):
    off = render(qwen3_style, chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n[enable_thinking=False]<think>\n\n</think>\n\n")
    on = render(qwen3_style, chat_template_kwargs={"enable_thinking": True})
    assert on.endswith("<|im_start|>assistant\n[enable_thinking=True]")
    assert render(qwen3_style).endswith("<|im_start|>assistant\n")


def test_the_tools_and_a_tool_turn_reach_the_template(qwen3_style):
    tools = [{"type": "function", "function": {"name": "get_weather"}}, {"type": "function",
                                                                         "function": {"name": "get_time"}}]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    text = render(qwen3_style, tools=tools, tool_choice="none", messages=history)
    assert text.startswith("<|im_start|>system\nTools: get_weather, get_time<|im_end|>\n")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text   # an object
    assert "<|im_start|>tool\n21 C<|im_end|>" in text


def test_add_generation_prompt_and_continue_final_message_take_vllms_meaning(tokenizer):
    own = ChatTemplate(tokenizer)          # the demo model's own (ChatML) template
    assert render(own).endswith("<|im_start|>assistant\n")
    assert render(own, add_generation_prompt=False).endswith("Hi there<|im_end|>\n")
    text = render(own, messages=[*ASK, {"role": "assistant", "content": "Hello, I am"}], add_generation_prompt=False,
                  continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello, I am")


def test_a_template_error_is_a_400_naming_messages_with_the_templates_message(qwen3_style):
    with pytest.raises(RequestValidationError) as info:
        render(qwen3_style, chat_template_kwargs={"fail": "on purpose"})
    assert (info.value.status_code, info.value.field) == (400, "messages")
    assert "the test template was asked to fail: on purpose" in info.value.message


def test_option_chat_template_takes_a_file_or_the_template_itself_and_checks_it_at_start_up(tmp_path):
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert Settings.from_properties({"chat_template": inline}, environ={}).chat_template_text() == inline
    (tmp_path / "t.jinja").write_text(inline)
    settings = Settings.from_properties({"chat_template": "t.jinja", "model_dir": str(tmp_path)}, environ={})
    assert settings.chat_template_text() == inline
    with pytest.raises(ConfigError, match="option.chat_template='missing.jinja': not a file"):
        Settings.from_properties({"chat_template": "missing.jinja", "model_dir": str(tmp_path)},
                                 environ={}).chat_template_text()
    with pytest.raises(ConfigError, match="does not parse.*line 1"):
        Settings.from_properties({"chat_template": "{% for m in messages %}"}, environ={}).chat_template_text()


# ---- a real server with option.chat_template, a reasoning parser and tool_choice auto ------------------

@pytest.fixture(scope="module")
def thinking_server(model_dir, tmp_path_factory):
    from tests.helpers import REPO, serve

    yield from serve(tmp_path_factory, "thinking", num_threads="1", enable_auto_tool_choice="true",
                     tool_call_parser="hermes", reasoning_parser="deepseek_r1",
                     chat_template=str(REPO / QWEN3_STYLE))


@pytest.fixture(scope="module")
def thinking_sdk(thinking_server):
    import openai

    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_option_chat_template_serves_chat_template_kwargs_and_its_errors_answer_400(thinking_sdk):
    import openai

    def prompt_tokens(**extra) -> int:
        return thinking_sdk.chat.completions.create(model="model", messages=ASK, max_tokens=1,
                                                    extra_body=extra).usage.prompt_tokens

    plain, off = prompt_tokens(), prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert off > plain + 4            # "[enable_thinking=False]<think>\n\n</think>\n\n" in the prompt
    with pytest.raises(openai.BadRequestError) as info:
        prompt_tokens(chat_template_kwargs={"fail": "now"})
    assert info.value.body["param"] == "messages"
    assert "the test template was asked to fail: now" in info.value.body["message"]


@pytest.mark.slow
def test_reasoning_content_streamed_and_not_agree(thinking_sdk):
    """deepseek_r1: the output starts inside the reasoning; 8 tokens never reach </think>, so it is all reasoning."""
    fields = {"model": "model", "messages": ASK, "temperature": 0, "max_tokens": 8}
    message = thinking_sdk.chat.completions.create(**fields).choices[0].message
    assert message.reasoning_content and message.content is None
    reasoning = ""
    for chunk in thinking_sdk.chat.completions.create(**fields, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        assert not delta.content
    assert reasoning == message.reasoning_content


HERMES_TURN = r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_finds_the_calls_the_model_writes_in_its_format(thinking_sdk, stream):
    """The demo model writes no tool calls of its own, so a regex makes it write Hermes' format; a constrained
    output is all answer (no reasoning), and the hermes parser reads the call out of it."""
    from tests.helpers import TOOLS, WEATHER_QUESTION

    reply = thinking_sdk.chat.completions.create(
        model="model", messages=WEATHER_QUESTION, tools=TOOLS, temperature=0, max_tokens=40, stream=stream,
        extra_body={"structured_outputs": {"regex": HERMES_TURN}})
    if not stream:
        choice = reply.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Let me check.\n")
        assert "reasoning_content" not in choice.message.model_extra      # a constrained output has none
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
        return
    content, calls, reason = "", [], None
    for chunk in reply:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [(c.function.name, json.loads(c.function.arguments)) for c in delta.tool_calls or []]
        reason = chunk.choices[0].finish_reason or reason
    assert (content, calls, reason) == ("Let me check.\n", [("get_weather", {"city": "Paris"})], "tool_calls")
