"""A chat answer's parts: generated text -> reasoning (reasoning.py), then tool calls (tool_parsers.py) in the
answer part, then content; as a whole message or as streamed deltas, with OpenAI's finish_reason "tool_calls".

Owns how the parsers chain and the message / delta fields they fill; which parsers a request gets is decided
once by the service (ChatOutputRule on the plan), the rest of the response is formatters/'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lmi_handler.engine.sequence import FinishReason
from lmi_handler.protocol.openai import to_openai_finish_reason
from lmi_handler.protocol.reasoning import ReasoningSplitter
from lmi_handler.protocol.tool_parsers import PARSERS, NamedCallStream, RequiredParser, ToolCall, ToolCallStream
from lmi_handler.protocol.tools import ToolRequest


@dataclass(frozen=True)
class ChatOutputRule:
    """What to look for in a chat answer: the reasoning parser (option.reasoning_parser; None when the output
    is constrained, which leaves no room for reasoning), the request's tools and, for tool_choice auto, the
    parser of the model's call format (option.tool_call_parser)."""

    reasoning_parser: str | None = None
    tools: ToolRequest | None = field(default=None, compare=False)
    tool_call_parser: str | None = None

    def parser(self) -> "ChatOutputParser":
        return ChatOutputParser(self)


@dataclass
class ChatDelta:
    """One step's new parts: reasoning text, content text, OpenAI tool-call deltas."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """One choice's text through the rule's parsers: feed() each new piece of text, the last with final=True."""

    def __init__(self, rule: ChatOutputRule):
        self.rule = rule
        self.reasoning = ReasoningSplitter(rule.reasoning_parser) if rule.reasoning_parser else None
        self.tools = _tool_stream(rule)
        self.reasoning_text = self.content_text = ""

    def parse(self, text: str) -> ChatDelta:
        """A whole answer at once (the non-streamed message)."""
        return self.feed(text, final=True)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        """The parts of the next piece of text that can go out now; `final` on the last piece (it flushes
        whatever was held back). One ChatOutputParser reads one choice's text, in order."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            more = self.reasoning.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        calls: list[dict] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                more_content, more_calls = self.tools.finish()
                content, calls = content + more_content, calls + more_calls
        self.reasoning_text += reasoning
        self.content_text += content
        return ChatDelta(reasoning, content, calls)

    def message(self) -> dict:
        """The assistant message once finished: content (null when empty or only whitespace beside reasoning or
        tool calls, as OpenAI answers a tool call), `reasoning_content` with a reasoning parser, `tool_calls` when any were found, and for
        a legacy `functions` request the first call as `function_call` too."""
        calls = self.tool_calls
        empty = not self.content_text.strip() and (calls or self.reasoning_text)
        message: dict = {"role": "assistant", "content": None if empty else self.content_text}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning_text or None
        if calls:
            message["tool_calls"] = [call.message() for call in calls]
            if self.rule.tools is not None and self.rule.tools.legacy:
                message["function_call"] = calls[0].message()["function"]
        return message

    def finish_reason(self, reason: FinishReason | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when calls were made and generation ended by itself (eos or a
        stop; cut at max_tokens stays "length"); otherwise the plain mapping."""
        word = to_openai_finish_reason(reason)
        return "tool_calls" if word == "stop" and self.tool_calls else word


def _tool_stream(rule: ChatOutputRule) -> ToolCallStream | NamedCallStream | None:
    tools = rule.tools
    if tools is None or tools.mode == "none":
        return None
    if tools.mode == "named":
        return NamedCallStream(tools.name)
    if tools.mode == "required":
        return ToolCallStream(RequiredParser())
    return ToolCallStream(PARSERS[rule.tool_call_parser]())
