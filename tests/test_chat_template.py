"""chat_template.py and option.chat_template: chat_template_kwargs, tools, add_generation_prompt and
continue_final_message reach the template; a template error is the client's 400 with the template's message."""
from __future__ import annotations

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
