"""The chat part of the settings: the chat template, tool calls and reasoning text of the OpenAI chat route.

Owns option.chat_template, enable_auto_tool_choice, tool_call_parser and reasoning_parser and reading the
template; applying it is chat_template.py's, finding the calls protocol/tool_parsers.py's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from lmi_handler.config.base import ConfigError, Options


class ChatOptions(Options):
    """Chat: the chat template, tool calls and reasoning text."""

    chat_template: str | None = None
    """The chat template instead of the tokenizer's: a file (absolute or relative to model_dir) or the Jinja
    template itself (text with {{ or {%); read and syntax-checked at start-up (vLLM's --chat-template)."""
    enable_auto_tool_choice: bool = False
    """tool_choice "auto" (also the default when a chat request sends tools): the model decides and
    tool_call_parser finds its calls in the text (vLLM's --enable-auto-tool-choice). Off: such requests answer
    400 naming this option; "required" and a named tool always work (decoded under the tools' JSON schemas)."""
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = Field(None, validate_default=True)
    """The model family's tool-call format for tool_choice "auto" (vLLM's --tool-call-parser names): hermes
    (Qwen2.5, Qwen3, Hermes: <tool_call> blocks), llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS]),
    pythonic (Llama 3.2/4: [f(a=1)]). Required by enable_auto_tool_choice (protocol/tool_parsers.py)."""
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    """Split a reasoning model's <think>...</think> text into message.reasoning_content (streamed:
    delta.reasoning_content) and its answer into content (vLLM's --reasoning-parser names): deepseek_r1
    (DeepSeek-R1 and its distills: the output starts inside the reasoning), qwen3 (Qwen3: <think> opens it).
    Unset: the text is all content (protocol/reasoning.py)."""

    @field_validator("tool_call_parser", "reasoning_parser", mode="before")
    @classmethod
    def _parser_name(cls, value):
        text = value.strip().lower() if isinstance(value, str) else value
        return None if text in ("", "none") else text

    @field_validator("tool_call_parser")
    @classmethod
    def _auto_tools_need_a_parser(cls, value, info):
        if info.data.get("enable_auto_tool_choice") and value is None:
            raise ValueError("enable_auto_tool_choice=true needs a tool_call_parser (one of hermes, llama3_json, "
                             "mistral, pythonic): the format the model writes its calls in")
        return value

    def chat_template_text(self) -> str | None:
        """option.chat_template as template text: the file's text when it names a file, else the value itself
        (a value with {{ or {% is a template). None when unset. Raises ConfigError for a value that is neither
        a readable file nor a template, or a template whose Jinja does not parse."""
        if self.chat_template is None:
            return None
        text = self.chat_template
        if "{{" not in text and "{%" not in text:
            path = Path(text) if Path(text).is_absolute() else Path(self.model_dir) / text
            if not path.is_file():
                raise ConfigError(f"option.chat_template={text!r}: not a file (looked at {path}) and not a Jinja "
                                  "template (no {{ or {%)")
            text = path.read_text(encoding="utf-8")
        import jinja2

        try:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"option.chat_template: the Jinja template does not parse: {exc.message} "
                              f"(line {exc.lineno})") from None
        return text
