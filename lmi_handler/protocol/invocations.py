"""The /invocations request (LMI text or chat form) and the LMI Token / Details response objects.

Parses and validates bytes into an InvocationRequest; turning outputs into bytes is formatters/' job.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from lmi_handler.engine.sequence import FinishReason, TokenOutput
from lmi_handler.protocol.dialects import (
    ROUTE_CHAT,
    ROUTE_GENERATE,
    ROUTE_INVOCATIONS,
    ROUTE_RESPONSES,
    Dialect,
    dialect_of,
)
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.openai import ChatCompletionRequest, CompletionRequest
from lmi_handler.protocol.params import GenerationParameters
from lmi_handler.protocol.plan import DecodeToken
from lmi_handler.protocol.responses import ResponsesContext, ResponsesRequest, ResponseStore

logger = logging.getLogger(__name__)

_TOP_LEVEL = {"inputs", "parameters", "stream", "messages", "adapters"}
# Deeper JSON is refused by a rule, not by wherever the parser's recursion limit happens to fall
# (json.loads fails near 1000 levels minus the caller's stack depth). Real bodies nest under 10.
MAX_JSON_DEPTH = 512


@dataclass
class InvocationRequest:
    """An /invocations body: LMI {"inputs", "parameters", "stream"} or chat {"messages", ...}.

    `inputs` is a string (rolling batch) or a list of strings (dynamic batch); None for chat and completions
    (their prompts are `completion.prompts`: text or token ids).
    `chat` holds the parsed chat form (LMI chat completions schema = OpenAI's) when `messages`
    was given; its sampling fields are already folded into `parameters`.
    """

    inputs: str | list[str] | None
    parameters: GenerationParameters
    stream: bool = False
    messages: list[dict] | None = None
    chat: ChatCompletionRequest | None = None
    completion: CompletionRequest | None = None
    route: str = ROUTE_INVOCATIONS
    adapters: str | list[str] | None = None     # LMI: the LoRA adapter(s) answering (a list: one per input)
    responses: ResponsesContext | None = None   # /v1/responses: run as `chat`, answered as a Response

    @property
    def model(self) -> str | None:
        """The `model` an OpenAI-style body names (chat, completions, batch lines; None when it names none)."""
        openai = self.chat or self.completion
        return openai.model if openai is not None else None

    @classmethod
    def parse(cls, body: bytes | str | dict, content_type: str | None = None, route: str | None = None,
              responses_store: ResponseStore | None = None) -> "InvocationRequest":
        """Validate a request body. A text/plain `content_type` makes the whole body the input (LMI).

        `route` (the front end passes the HTTP path) selects the OpenAI chat or completions
        schema for /v1/chat/completions and /v1/completions, the Responses one for /v1/responses (its
        previous_response_id looked up in `responses_store`); TGI /generate takes the LMI text
        schema (no `messages`); anything else is /invocations.

        A body with `messages` is a chat request, whatever else it holds (LMI checks messages
        first). Raises RequestValidationError: field "body" for undecodable/non-JSON/non-object
        bodies, "inputs" for a missing or bad input, else the parameter's name.
        """
        if dialect_of(route) is Dialect.OPENAI:
            return cls.parse_openai(load_json(body), route, responses_store=responses_store)
        if content_type and content_type.split(";")[0].strip().lower() == "text/plain":
            return cls(_check_inputs(_decode(body)), GenerationParameters(), route=route or ROUTE_INVOCATIONS)
        data = load_json(body)
        stream = _check_stream(data.get("stream"))
        adapters = _check_adapters(data.get("adapters"), data.get("inputs"))
        if route == ROUTE_GENERATE and "messages" in data:
            raise RequestValidationError("messages", "Invalid field `messages`: /generate takes TGI's "
                                         '{"inputs", "parameters"}; chat goes to /v1/chat/completions')
        if "messages" in data:
            if "parameters" in data:
                raise RequestValidationError("parameters", "Invalid field `parameters`: a chat request (with "
                                             "`messages`) takes OpenAI fields at the top level (max_tokens, "
                                             "temperature, top_p, stop, seed, ...)")
            chat = ChatCompletionRequest.parse({k: v for k, v in data.items() if k != "adapters"})
            return cls(None, chat.to_generation_parameters(), stream, chat.messages, chat, adapters=adapters)
        unknown = sorted(set(data) - _TOP_LEVEL)
        if unknown:
            logger.warning("ignoring unknown request fields: %s", ", ".join(unknown))
        if data.get("inputs") is None:
            raise RequestValidationError("inputs", 'Missing field `inputs`: the request needs "inputs" '
                                         '(a string, or a list of strings in dynamic batch) or "messages"')
        return cls(_check_inputs(data["inputs"]), GenerationParameters.parse(data.get("parameters")), stream,
                   route=route or ROUTE_INVOCATIONS, adapters=adapters)

    @classmethod
    def parse_openai(cls, data: Any, route: str, responses_store: ResponseStore | None = None,
                     **generation: Any) -> "InvocationRequest":
        """An OpenAI chat (route /v1/chat/completions), Responses (/v1/responses: run as the chat it becomes)
        or completions body, already a dict.

        `generation` goes to to_generation_parameters (batch files: greedy_when_unset=True,
        defaults, default_max_new_tokens for chat). Raises RequestValidationError naming the field.
        """
        if route == ROUTE_RESPONSES:
            responses = ResponsesRequest.parse(data, responses_store)
            chat = responses.chat
            return cls(None, responses.parameters, responses.stream, chat.messages, chat, route=route,
                       responses=responses.context)
        if route == ROUTE_CHAT:
            chat = ChatCompletionRequest.parse(data)
            return cls(None, chat.to_generation_parameters(**generation), chat.stream, chat.messages, chat,
                       route=route)
        completion = CompletionRequest.parse(data)    # its prompts (text or token ids): completion.prompts
        return cls(None, completion.to_generation_parameters(**generation), completion.stream,
                   completion=completion, route=route)


def _decode(body: bytes | str | dict) -> str:
    if isinstance(body, (bytes, bytearray)):
        try:
            return bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestValidationError("body", f"Request body is not valid UTF-8: {exc}") from None
    if isinstance(body, str):
        return body
    raise RequestValidationError("body", "Request body must be text, not a JSON object, with text/plain")


def load_json(body: bytes | str | dict) -> dict:
    """A request body as a JSON object (a dict passes as it is). Raises RequestValidationError("body") for
    bytes that are not UTF-8, not JSON, not an object, or nested past MAX_JSON_DEPTH."""
    if isinstance(body, dict):
        return body
    text = _decode(body)
    if not text.strip():
        raise RequestValidationError("body", "Request body is empty: send a JSON object")  # every route's
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON, 4300+ digit integers, absurd nesting
        raise RequestValidationError("body", f"Request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise RequestValidationError.out_of_range("body", data, "a JSON object")
    _check_depth(data)
    return data


def _check_depth(data: dict) -> None:
    """Raise RequestValidationError("body") for JSON nested deeper than MAX_JSON_DEPTH (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestValidationError("body", f"Request body is nested deeper than {MAX_JSON_DEPTH} "
                                         "levels (JSON this deep is refused)")
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _check_inputs(inputs: Any) -> str | list[str]:
    allowed = "a non-empty string or a non-empty list of non-empty strings"
    if isinstance(inputs, str) and inputs:
        return inputs
    if isinstance(inputs, list) and inputs and all(isinstance(s, str) and s for s in inputs):
        return inputs
    raise RequestValidationError.out_of_range("inputs", inputs, allowed)


def _check_adapters(adapters: Any, inputs: Any) -> str | list[str] | None:
    """LMI `adapters`: one adapter name, or (a dynamic batch's list of inputs) one name per input."""
    if adapters is None:
        return None
    if isinstance(adapters, str) and adapters:
        return adapters
    count = len(inputs) if isinstance(inputs, list) else None
    if isinstance(adapters, list) and count == len(adapters) and all(isinstance(a, str) and a for a in adapters):
        return adapters
    allowed = "a non-empty adapter name" + (f", or a list of {count} names (one per input)" if count else "")
    raise RequestValidationError.out_of_range("adapters", adapters, allowed)


def _check_stream(stream: Any) -> bool:
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise RequestValidationError.out_of_range("stream", stream, "true or false")
    return stream


# ---- Token and Details --------------------------------------------------------------------

def _finite(value: float | None) -> float | None:
    """JSON has no NaN/Infinity: a non-finite log prob is reported as null."""
    return value if value is not None and math.isfinite(value) else None


def _token(token_id: int, text: str, log_prob: float | None, special: bool, tgi_compat: bool) -> dict:
    if tgi_compat:  # TGI Token: {id, text, logprob, special}
        return {"id": token_id, "text": text, "logprob": _finite(log_prob), "special": special}
    return {"id": token_id, "text": text, "log_prob": _finite(log_prob), "special_token": special}


def top_tokens_to_dicts(t: TokenOutput, decode_token: DecodeToken | None = None,
                        tgi_compat: bool = False) -> list[dict]:
    """A token's alternatives, best first; texts need `decode_token` ("" without it)."""
    return [_token(tid, decode_token(tid) if decode_token else "", lp, t.special_token and tid == t.id, tgi_compat)
            for tid, lp in t.top_tokens or ()]


def token_to_dict(t: TokenOutput, decode_token: DecodeToken | None = None, tgi_compat: bool = False,
                  with_top_tokens: bool = True) -> dict:
    """LMI Token {id, text, log_prob, special_token}, plus "top_tokens" when the token has them.

    tgi_compat: TGI's names {id, text, logprob, special}; TGI sends top tokens beside the
    token (per stream line / in details), so they are not nested here. details.tokens leaves
    them out too (with_top_tokens=False): details carries them once, as "top_tokens".
    """
    out = _token(t.id, t.text, t.log_prob, t.special_token, tgi_compat)
    if t.top_tokens and with_top_tokens and not tgi_compat:
        out["top_tokens"] = top_tokens_to_dicts(t, decode_token)
    return out


def prefill_to_dicts(prompt_tokens: list[TokenOutput], tgi_compat: bool = False) -> list[dict]:
    """details.prefill: the prompt tokens; the first has log_prob null (nothing before it)."""
    key = "logprob" if tgi_compat else "log_prob"
    return [{"id": t.id, "text": t.text, key: None if i == 0 else _finite(t.log_prob)}
            for i, t in enumerate(prompt_tokens)]


def build_details(*, finish_reason: FinishReason | None, tokens: list[TokenOutput], inputs: str,
                  prompt_tokens: list[TokenOutput] | None = None, include_tokens: bool = True,
                  tgi_compat: bool = False, decode_token: DecodeToken | None = None) -> dict:
    """LMI Details: {finish_reason, generated_tokens, inputs, tokens?, prefill?, top_tokens?}.

    generated_tokens counts `tokens` (the tokens sent to the client), so it equals the number
    of streamed lines. Streaming leaves the tokens out (include_tokens=False, as LMI does).
    tgi_compat adds "prefill": [] when none was asked (TGI's Details always has it).
    best_of_sequences is added by formatters.render_best_of for n / best_of requests.
    """
    details: dict[str, Any] = {"finish_reason": None if finish_reason is None else FinishReason(finish_reason).value,
                               "generated_tokens": len(tokens), "inputs": inputs}
    if include_tokens:
        details["tokens"] = [token_to_dict(t, decode_token, tgi_compat, with_top_tokens=False) for t in tokens]
    if prompt_tokens is not None:
        details["prefill"] = prefill_to_dicts(prompt_tokens, tgi_compat)
    elif tgi_compat and include_tokens:
        details["prefill"] = []
    if include_tokens and any(t.top_tokens for t in tokens):
        details["top_tokens"] = [top_tokens_to_dicts(t, decode_token, tgi_compat) for t in tokens]
    return details
