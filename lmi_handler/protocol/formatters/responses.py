"""The Responses API's answers: a finished Response object, or the stream of its events (response.created ...
response.completed), built from the engine's outputs of one chat-planned sequence.

Owns the output items (reasoning, message, function_call), their ids, the event sequence with its
sequence_number, the Response's status and usage, and storing the finished response; the request side is
responses.py's, finding reasoning and tool calls in the text chat_output.py's, the bytes the encoder's.
"""
from __future__ import annotations

from typing import Any

from lmi_handler.engine.sequence import FinishReason, RequestOutput
from lmi_handler.protocol.chat_output import ChatOutputRule
from lmi_handler.protocol.encoder import Event
from lmi_handler.protocol.formatters.base import Formatter, error_message, is_error
from lmi_handler.protocol.plan import Prompt, RequestPlan
from lmi_handler.protocol.responses import ResponsesContext, new_id

# The last event's type by the Response's status (OpenAI's stream ends with one of them)
FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


def _status(out: RequestOutput) -> str:
    if is_error(out):
        return "failed"
    return "incomplete" if out.finish_reason == FinishReason.LENGTH else "completed"


class OutputItems:
    """A response's output items as its text arrives: feed() each piece (reasoning, then the answer, then
    tool calls, as the rule's parsers find them), finish() once. Both return the stream events of what they
    added (dicts without sequence_number); `items` holds the finished items in output order.

    A message item opens only once its text has more than whitespace (so whitespace before a tool call makes
    no empty message); a response with no item at all gets one message with whatever text there was.
    """

    def __init__(self, rule: ChatOutputRule | None):
        self.parser = rule.parser() if rule is not None else None
        self.items: list[dict] = []
        self.open: dict | None = None       # the reasoning or message item being written
        self.text = ""                      # the open item's text so far
        self.pending = ""                   # answer text held back while it is only whitespace
        self.calls: list[dict] = []         # the calls as a chat assistant message's tool_calls

    def feed(self, text: str, final: bool = False) -> list[dict]:
        if self.parser is None:
            reasoning, content, calls = "", text, []
        else:
            parts = self.parser.feed(text, final=final)
            reasoning, content, calls = parts.reasoning, parts.content, parts.tool_calls
        events: list[dict] = []
        if reasoning:
            events += self._write("reasoning", reasoning)
        self.pending += content
        if self.pending.strip() or (self.open is not None and self.open["type"] == "message"):
            events += self._write("message", self.pending)
            self.pending = ""
        for call in calls:
            events += self._call(call)
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the open item (`status`: the item's, completed or incomplete) and, when the response made no
        item, add one message with the held-back text."""
        events = []
        if not self.items and self.open is None:
            events += self._write("message", self.pending)
        return events + self._close(status)

    @property
    def message_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "message" for part in item["content"])

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed") + self._open(kind)
        if text:
            self.text += text
            delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            events.append({"type": delta, **self._where(), "delta": text,
                           **({"logprobs": []} if kind == "message" else {})})
        return events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}

    def _open(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            self.open = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                         "status": "in_progress"}
        else:
            self.open = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                         "content": []}
        self.text = ""
        return [{"type": "response.output_item.added", "output_index": len(self.items), "item": _copy(self.open)},
                {"type": "response.content_part.added", **self._where(), "part": self._part("")}]

    def _part(self, text: str) -> dict:
        if self.open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _close(self, status: str) -> list[dict]:
        if self.open is None:
            return []
        item, events = self.open, []
        if item["type"] == "function_call":
            where = {"item_id": item["id"], "output_index": len(self.items)}
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": self.text})
            item.update(arguments=self.text, status=status)
            self.calls.append({"id": item["call_id"], "type": "function",
                               "function": {"name": item["name"], "arguments": self.text}})
        else:
            part = self._part(self.text)
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            events += [{"type": done, **self._where(), "text": self.text,
                        **({"logprobs": []} if item["type"] == "message" else {})},
                       {"type": "response.content_part.done", **self._where(), "part": part}]
            item.update(content=[part], status=status)
        events.append({"type": "response.output_item.done", "output_index": len(self.items), "item": _copy(item)})
        self.items.append(item)
        self.open = None
        return events

    def _call(self, delta: dict) -> list[dict]:
        """A tool-call delta (chat_output's): one with an id starts a function_call item, the others add to its
        arguments (a named tool_choice streams them in pieces; the parsers of `required` and `auto` send each
        call whole). The item closes when the next one starts or the response ends."""
        events = []
        function = delta.get("function") or {}
        if "id" in delta:
            events += self._close("completed")
            self.open = {"id": new_id("fc"), "type": "function_call", "call_id": delta["id"],
                         "name": function["name"], "arguments": "", "status": "in_progress"}
            self.text = ""
            events.append({"type": "response.output_item.added", "output_index": len(self.items),
                           "item": _copy(self.open)})
        arguments = function.get("arguments") or ""
        if arguments and self.open is not None and self.open["type"] == "function_call":
            self.text += arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": self.open["id"],
                           "output_index": len(self.items), "delta": arguments})
        return events

    def assistant_message(self) -> dict:
        """The output as the chat message the next turn's prompt holds (previous_response_id)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.message_text or None}
        if self.calls:
            message["tool_calls"] = self.calls
        return message


def _copy(item: dict) -> dict:
    return {**item, "content": list(item["content"])} if "content" in item else dict(item)


class _ResponsesFormatter(Formatter):
    """One response (Responses has no `n`: one sequence): the outputs seen so far and its output items."""

    def __init__(self, plan: RequestPlan, prompt: Prompt, seed: int | None = None, details: bool | None = None):
        super().__init__(plan, prompt, seed, details)
        self.context: ResponsesContext = plan.responses
        self.output = OutputItems(plan.chat_output)
        self.index = 0

    def response(self, status: str, output: list[dict]) -> dict:
        """The Response object: `status` in_progress | completed | incomplete | failed."""
        out, context = self.last, self.context
        body = {"id": context.response_id, "object": "response", "created_at": context.created_at,
                "status": status, "model": self.plan.model_name, "output": output, "error": None,
                "incomplete_details": None, "usage": None, **context.echo}
        if status == "failed":
            body["error"] = {"code": "server_error", "message": error_message(out)}
        elif status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if status != "in_progress":
            body["usage"] = usage(out.num_prompt_tokens, out.num_generated_tokens or len(self.tokens))
        return body

    def finished_response(self) -> dict:
        """The finished Response (kept in the store when it completed or stopped at max_output_tokens)."""
        status = _status(self.last)
        body = self.response(status, self.output.items)
        if self.context.store is not None and status != "failed":
            self.context.store.put(body, (*self.context.messages, self.output.assistant_message()))
        return body


class ResponsesDocument(_ResponsesFormatter):
    """A whole (not streamed) Response object."""

    def document(self) -> dict:
        status = _status(self.last)
        if status != "failed":
            self.output.feed(self.last.generated_text, final=True)
            self.output.finish(status)
        return self.finished_response()


class ResponsesStream(_ResponsesFormatter):
    """A streamed Response: response.created and response.in_progress first, then each item's added, delta and
    done events as the text arrives, then response.completed (incomplete, failed); every event numbered by
    sequence_number from 0 and sent as a named SSE event."""

    def __init__(self, plan: RequestPlan, prompt: Prompt, seed: int | None = None, details: bool | None = None):
        super().__init__(plan, prompt, seed, details)
        self.sequence_number = 0

    def events(self, out: RequestOutput) -> list[Event]:
        first = self.last is None
        self.add(out)
        events: list[dict] = []
        if first:
            start = self.response("in_progress", [])
            events += [{"type": "response.created", "response": start},
                       {"type": "response.in_progress", "response": start}]
        status = _status(out) if out.finished or out.error is not None else "in_progress"
        if status != "failed":
            events += self.output.feed("".join(t.text for t in out.new_tokens), final=out.finished)
        if status != "in_progress":
            if status != "failed":
                events += self.output.finish(status)
            events.append({"type": FINAL_EVENTS[status], "response": self.finished_response()})
        return [self._numbered(event) for event in events]

    def _numbered(self, event: dict) -> Event:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return Event(event["type"], event)


def usage(input_tokens: int, output_tokens: int) -> dict:
    """Responses usage: input and output tokens (no prompt cache, reasoning tokens not counted apart)."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}
