"""OpenAI's Responses API on the wire (/v1/responses, as vLLM serves it): a request checked and turned into the
chat request it runs as, and the bounded in-memory store behind `store` / `previous_response_id`.

Owns the Responses words on the request side (input items, instructions, flat function tools, text.format,
max_output_tokens) and which fields are refused; the response objects and stream events are
formatters/responses.py's, running the chat request the chat route's (service.py, formatters.py).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from lmi_handler.protocol.errors import RequestValidationError, show_value
from lmi_handler.protocol.openai import ChatCompletionRequest
from lmi_handler.protocol.params import GenerationParameters

logger = logging.getLogger(__name__)

# Request fields that change the answer and are not served: refused (400 naming them) unless neutral.
REFUSED: dict[str, tuple[Any, ...]] = {
    "background": (False,), "conversation": (), "prompt": (), "max_tool_calls": (),
    "context_management": ([],), "truncation": ("disabled",), "top_logprobs": (0,),
}
# Fields echoed in the Response object or harmless to the answer: accepted as sent.
ECHOED = ("metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
          "stream_options", "prompt_cache_options")
# `include` values that are served (no encrypted reasoning is ever produced, so asking for it changes nothing)
INCLUDABLE = ("reasoning.encrypted_content",)
# Sampling extras of the chat request (vLLM's ResponsesRequest takes these too), passed through as sent
CHAT_EXTRAS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
               "stop_token_ids", "ignore_eos", "logit_bias", "priority")
KNOWN = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
         "parallel_tool_calls", "text", "reasoning", "stream", "store", "previous_response_id", "include",
         *REFUSED, *ECHOED, *CHAT_EXTRAS)
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# The chat request's names -> the Responses request's, for errors raised while the chat request is checked
_RENAMES = (("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"), ("messages", "input"),
            ("tool_choice.function.name", "tool_choice.name"), (".function.", "."), (".function", ""))


def _bad(field: str, message: str) -> RequestValidationError:
    return RequestValidationError(field, f"Invalid parameter `{field}`: {message}")


def renamed(exc: RequestValidationError) -> RequestValidationError:
    """A chat-side error with the field (and its mention in the message) in the Responses request's names."""
    name = exc.field
    for old, new in _RENAMES:
        name = name.replace(old, new)
    if name == exc.field:
        return exc
    return RequestValidationError(name, exc.message.replace(f"`{exc.field}`", f"`{name}`"), exc.status_code)


def new_id(prefix: str) -> str:
    """An object id as OpenAI writes them: `resp_`, `msg_`, `fc_`, `rs_` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class StoredResponse:
    """A finished response kept for GET /v1/responses/{id} and for `previous_response_id`: its object and the
    conversation it closes (chat messages, instructions left out: OpenAI does not carry them over)."""

    body: dict
    messages: tuple[dict, ...]


class ResponseStore:
    """The last `capacity` stored responses by id (option.responses_store_size; 0 keeps none), oldest dropped
    first. Written by the engine's thread as responses finish, read by request threads: every access locks."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, body: dict, messages: tuple[dict, ...]) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._items[body["id"]] = StoredResponse(body, messages)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True)
class ResponsesContext:
    """What a Responses answer needs beyond the chat answer: its id, when it was made, the request fields the
    Response object echoes, the conversation so far (to store with the output) and the store (None: not kept)."""

    response_id: str
    created_at: int
    echo: dict
    messages: tuple[dict, ...]
    store: ResponseStore | None = field(default=None, compare=False, repr=False)


@dataclass
class ResponsesRequest:
    """A checked /v1/responses body: the chat request it runs as, that chat's parameters, and its context."""

    chat: ChatCompletionRequest
    parameters: GenerationParameters
    context: ResponsesContext
    stream: bool

    @classmethod
    def parse(cls, data: Any, store: ResponseStore | None) -> "ResponsesRequest":
        """Check a Responses body (a dict) against this server: the refused fields, the input items, the tools,
        text.format; `previous_response_id` is looked up in `store`. Raises RequestValidationError naming the
        field (404 for a previous_response_id the store does not hold)."""
        if not isinstance(data, dict):
            raise RequestValidationError.out_of_range("body", data, "a JSON object")
        given = {key: value for key, value in data.items() if value is not None}
        _refuse(given)
        unknown = sorted(set(given) - set(KNOWN))
        if unknown:
            logger.warning("ignoring unsupported /v1/responses fields: %s", ", ".join(unknown))
        previous = _previous(given.get("previous_response_id"), store)
        conversation = (*(previous.messages if previous else ()), *input_messages(given.get("input")))
        instructions = _string(given, "instructions")
        system = ({"role": "system", "content": instructions},) if instructions else ()
        chat_body = {"messages": [*system, *conversation], "max_completion_tokens": given.get("max_output_tokens"),
                     **{k: given[k] for k in ("model", "temperature", "top_p", "stream", *CHAT_EXTRAS) if k in given},
                     **_tool_fields(given), **_text_format(given.get("text")), **_reasoning(given.get("reasoning"))}
        try:
            chat = ChatCompletionRequest.parse(chat_body)
            parameters = chat.to_generation_parameters()
        except RequestValidationError as exc:
            raise renamed(exc) from None
        keep = given.get("store", True)
        if not isinstance(keep, bool):
            raise RequestValidationError.out_of_range("store", keep, "true or false")
        kept = store if keep and store is not None and store.capacity > 0 else None
        context = ResponsesContext(new_id("resp"), int(time.time()), _echo(given, kept is not None), conversation,
                                   kept)
        return cls(chat, parameters, context, chat.stream)


def _refuse(given: dict[str, Any]) -> None:
    for name, neutral in REFUSED.items():
        if name in given and given[name] not in neutral and given[name] not in ({}, []):
            allowed = f"leave it out or send {show_value(neutral[0])}" if neutral else "leave it out"
            raise _bad(name, f"not supported by this server ({allowed}), got {show_value(given[name])}")
    include = given.get("include", [])
    if not isinstance(include, list):
        raise RequestValidationError.out_of_range("include", include, "a list of strings")
    for i, value in enumerate(include):
        if value not in INCLUDABLE:
            raise _bad(f"include[{i}]", f"{show_value(value)} is not served here (served: "
                       f"{', '.join(INCLUDABLE)})")


def _string(given: dict[str, Any], name: str) -> str | None:
    value = given.get(name)
    if value is not None and not isinstance(value, str):
        raise RequestValidationError.out_of_range(name, value, "a string")
    return value


def _previous(response_id: Any, store: ResponseStore | None) -> StoredResponse | None:
    if response_id is None:
        return None
    if not isinstance(response_id, str):
        raise RequestValidationError.out_of_range("previous_response_id", response_id, "a response id (a string)")
    found = store.get(response_id) if store is not None else None
    if found is None:
        why = "" if store is not None and store.capacity else " (this server keeps none: option.responses_store_size=0)"
        raise RequestValidationError("previous_response_id", f"Response with id '{response_id}' not found{why}",
                                     status_code=404)
    return found


# ---- input items -> chat messages -----------------------------------------------------------

def input_messages(items: Any) -> list[dict]:
    """`input` as chat messages: a string is one user message; a list holds message items ({role, content}),
    function_call items (an assistant message's tool_calls; consecutive ones share the message) and
    function_call_output items (tool messages); reasoning items are dropped (chat templates leave earlier
    reasoning out). Raises RequestValidationError naming `input[i]...` for anything else."""
    if isinstance(items, str) and items:
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestValidationError.out_of_range("input", items, "a non-empty string or a non-empty list of "
                                                  "message, function_call and function_call_output items")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, f"must be an item object, got {show_value(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text_field(item, "call_id", where), "type": "function",
                    "function": {"name": _text_field(item, "name", where),
                                 "arguments": _text_field(item, "arguments", where, empty=True)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", where),
                             "content": _content_text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise _bad(f"{where}.type", f"{show_value(kind)} items are not served here (served: message, "
                       "function_call, function_call_output, reasoning)")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise _bad(f"{where}.role", f"must be one of {', '.join(MESSAGE_ROLES)}, got {show_value(role)}")
    return {"role": role, "content": _content_text(item.get("content"), f"{where}.content")}


def _content_text(content: Any, where: str) -> str:
    """A content string, or a list of text parts joined (input_text, output_text, refusal); images, files
    and audio are refused: the served models read text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestValidationError.out_of_range(where, content, "a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _bad(f"{where}[{j}].type", f"{show_value(kind)} parts are not served here (text only: "
                       f"{', '.join(TEXT_PARTS)})")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise RequestValidationError.out_of_range(f"{where}[{j}].text", text, "a string")
        texts.append(text)
    return "".join(texts)


def _text_field(item: dict, name: str, where: str, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not (value or empty):
        raise RequestValidationError.out_of_range(f"{where}.{name}", value, "a non-empty string")
    return value


# ---- tools, text.format, reasoning -> the chat request's fields -------------------------------

def _tool_fields(given: dict[str, Any]) -> dict[str, Any]:
    """Responses' flat function tools {type, name, description?, parameters?, strict?} and tool_choice as the
    chat request's; built-in tools (web_search, file_search, ...) are refused naming `tools[i].type`."""
    out: dict[str, Any] = {}
    tools = given.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestValidationError.out_of_range("tools", tools, "a list of function tools")
        out["tools"] = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    choice = given.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind != "function":
            raise _bad("tool_choice.type", f"{show_value(kind)} is not served here: send \"none\", \"auto\", "
                       "\"required\" or {\"type\": \"function\", \"name\": ...}")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    if "parallel_tool_calls" in given:
        out["parallel_tool_calls"] = given["parallel_tool_calls"]
    return out


def _chat_tool(tool: Any, where: str) -> Any:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise _bad(f"{where}.type", f"{show_value(kind)}: built-in tools are not served here, only function "
                   "tools {\"type\": \"function\", \"name\", \"parameters\"?}")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _text_format(text: Any) -> dict[str, Any]:
    """text.format as the chat request's response_format: text (none), json_object, or json_schema with the
    schema's fields at the top of the format object (Responses' form)."""
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise RequestValidationError.out_of_range("text", text, 'an object {"format": {"type": ...}}')
    fmt = text.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise RequestValidationError.out_of_range("text.format", fmt, 'an object {"type": "text" | "json_object" '
                                                  '| "json_schema", ...}')
    if fmt.get("type") != "json_schema":
        return {"response_format": fmt}
    inner = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"response_format": {"type": "json_schema", "json_schema": inner}}


def _reasoning(reasoning: Any) -> dict[str, Any]:
    """reasoning.effort reaches the chat template as `reasoning_effort` (vLLM's way; templates without it
    ignore it); the reasoning text itself comes from option.reasoning_parser."""
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise RequestValidationError.out_of_range("reasoning", reasoning, 'an object {"effort"?, "summary"?}')
    effort = reasoning.get("effort")
    if effort is None:
        return {}
    if not isinstance(effort, str):
        raise RequestValidationError.out_of_range("reasoning.effort", effort, "a string")
    return {"chat_template_kwargs": {"reasoning_effort": effort}}


def _echo(given: dict[str, Any], stored: bool) -> dict:
    """The request fields a Response object repeats, with OpenAI's defaults for those left out."""
    choice = given.get("tool_choice", "auto" if given.get("tools") else "none")
    return {"instructions": given.get("instructions"), "max_output_tokens": given.get("max_output_tokens"),
            "metadata": given.get("metadata", {}), "parallel_tool_calls": given.get("parallel_tool_calls", True),
            "previous_response_id": given.get("previous_response_id"), "reasoning": given.get("reasoning"),
            "temperature": given.get("temperature"), "text": given.get("text", {"format": {"type": "text"}}),
            "tool_choice": choice, "tools": given.get("tools", []), "top_p": given.get("top_p"),
            "truncation": "disabled", "user": given.get("user"), "store": stored, "background": False}
