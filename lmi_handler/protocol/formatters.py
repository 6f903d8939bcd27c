"""Output formatters: each step's RequestOutput -> the text sent to the client (json, jsonlines, sse, chat).

Owns the byte shapes of DESIGN §3 (LMI schema, tgi_compat) and OpenAI responses; which formatter a
request gets (option.output_formatter, stream, tgi_compat) is resolved by the handler.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import Any

from lmi_handler.engine.sequence import FinishReason, RequestOutput, TokenOutput
from lmi_handler.protocol import openai
from lmi_handler.protocol.invocations import DecodeToken, build_details, token_to_dict, top_tokens_to_dicts

logger = logging.getLogger(__name__)

CONTENT_TYPES = {"json": "application/json", "jsonlines": "application/jsonlines", "sse": "text/event-stream"}
SSE_DONE = "data: [DONE]\n\n"
GENERATION_ERROR_CODE = 424  # DJL: a failure inside the handler answers 424
# LMI schema: the token line sent when generation ends with no token to carry the final fields.
SENTINEL_TOKEN = TokenOutput(id=-1, text="", log_prob=-1.0, special_token=True)


@dataclass
class ResponseContext:
    """What a request's formatter needs besides the engine outputs; built once by the handler.

    output_formatter: "json" | "jsonlines" | "sse" (see resolve_output_formatter).
    chat / completion: answer in OpenAI chat.completion / text_completion shapes instead;
    they stream (stream=True) as SSE chunks ending in [DONE] unless output_formatter is
    "jsonlines" (LMI's jsonlines_chat: the same chunks, one JSON per line, no [DONE]).
    created: unix seconds. decode_token gives texts for top-token alternatives.
    """

    stream: bool
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    prompt_text: str
    output_formatter: str = "json"
    tgi_compat: bool = False
    chat: bool = False
    model_name: str = ""
    request_id: str = ""
    created: int = 0
    decode_token: DecodeToken | None = None
    completion: bool = False
    logprobs: bool = False
    include_usage: bool = False


def resolve_output_formatter(name: str | None, stream: bool, tgi_compat: bool) -> str:
    """LMI's choice: a known option.output_formatter wins; else streaming is jsonlines (sse under
    tgi_compat) and non-streaming json. Unknown names are logged and fall back to the default."""
    if name in CONTENT_TYPES:
        return name
    if name:
        logger.warning("unsupported output_formatter %r: using the default", name)
    if stream:
        return "sse" if tgi_compat else "jsonlines"
    return "json"


def dumps(obj: Any) -> str:
    """JSON text as LMI writes it: UTF-8 characters kept, not \\u-escaped."""
    return json.dumps(obj, ensure_ascii=False)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


def error_body(message: str, code: int) -> str:
    """LMI error document {"error": message, "code": code} (validation errors before inference)."""
    return dumps({"error": message, "code": code})


def dynamic_batch_body(texts: list[str]) -> str:
    """LMI dynamic batch answer: [{"generated_text": ...}, ...] in input order."""
    return dumps([{"generated_text": text} for text in texts])


def dynamic_batch_stream_line(texts: list[str]) -> str:
    """LMI dynamic batch streaming: one {"outputs": [...]} line per step."""
    return dumps({"outputs": texts}) + "\n"


def _is_error(out: RequestOutput) -> bool:
    return out.error is not None or out.finish_reason == FinishReason.ERROR


def _error_message(out: RequestOutput) -> str:
    return out.error or "generation failed"


class Formatter:
    """One per request: turns each step's output into text; "" means nothing to send this step.

    Keeps the tokens sent so far (details, usage) and the prompt tokens (decoder_input_details).
    """

    content_type = "application/json"

    def __init__(self, ctx: ResponseContext):
        self.ctx = ctx
        self.tokens: list[TokenOutput] = []
        self.prompt_tokens: list[TokenOutput] | None = None

    def format(self, out: RequestOutput) -> str:
        self.tokens.extend(out.new_tokens)
        if out.prompt_tokens is not None:
            self.prompt_tokens = out.prompt_tokens
        return self._format(out)

    def _format(self, out: RequestOutput) -> str:
        raise NotImplementedError

    def generated_text(self, out: RequestOutput) -> str:
        return (self.ctx.prompt_text if self.ctx.return_full_text else "") + out.generated_text

    def details(self, out: RequestOutput, include_tokens: bool) -> dict:
        reason = FinishReason.ERROR if _is_error(out) else out.finish_reason
        prompt_tokens = self.prompt_tokens if self.ctx.decoder_input_details else None
        return build_details(finish_reason=reason, tokens=self.tokens, inputs=self.ctx.prompt_text,
                             prompt_tokens=prompt_tokens, include_tokens=include_tokens,
                             tgi_compat=self.ctx.tgi_compat, decode_token=self.ctx.decode_token)


class JsonFormatter(Formatter):
    """LMI json: nothing until finished, then {"generated_text", "details"?}; tgi_compat wraps it in [ ].

    On error: LMI's shape {"generated_text": <partial>, "details": {"finish_reason": "error", ...}}
    plus "error": message; under tgi_compat TGI's error object {"error", "error_type"} (unwrapped,
    as TGI clients parse error bodies as an object).
    """

    def _format(self, out: RequestOutput) -> str:
        if not out.finished:
            return ""
        if _is_error(out) and self.ctx.tgi_compat:
            return dumps({"error": _error_message(out), "error_type": "generation"})
        doc: dict[str, Any] = {"generated_text": self.generated_text(out)}
        if self.ctx.details or _is_error(out):
            doc["details"] = self.details(out, include_tokens=True)
        if _is_error(out):
            doc["error"] = _error_message(out)
        return dumps([doc] if self.ctx.tgi_compat else doc)


class JsonLinesFormatter(Formatter):
    """LMI jsonlines: one {"token": Token} line per generated token, as they arrive.

    Only the last line carries "generated_text" and "details" (if asked; always on error, with
    finish_reason "error" and an "error" message). When the final output brings no new token
    (e.g. a stop string made of held-back tokens, or an error), the final fields ride on LMI's
    sentinel token {"id": -1, "text": ""}; details.generated_tokens counts real tokens only.
    """

    content_type = CONTENT_TYPES["jsonlines"]

    def _format(self, out: RequestOutput) -> str:
        tokens = list(out.new_tokens)
        if out.finished and not tokens:
            tokens = [SENTINEL_TOKEN]
        first_index = len(self.tokens) - len(out.new_tokens)
        lines = [self._line(t, first_index + i + 1) for i, t in enumerate(tokens)]
        if out.finished:
            lines[-1].update(self._final_fields(out))
        return "".join(self._wrap(line) for line in lines)

    def _line(self, token: TokenOutput, index: int) -> dict:
        line: dict[str, Any] = {"token": token_to_dict(token, self.ctx.decode_token, self.ctx.tgi_compat)}
        if self.ctx.tgi_compat:  # TGI StreamResponse: 1-based index, top tokens beside the token
            line["index"] = index
            if token.top_tokens:
                line["top_tokens"] = top_tokens_to_dicts(token, self.ctx.decode_token, tgi_compat=True)
        return line

    def _final_fields(self, out: RequestOutput) -> dict:
        fields: dict[str, Any] = {"generated_text": self.generated_text(out)}
        if self.ctx.details or _is_error(out):
            fields["details"] = self.details(out, include_tokens=False)
        if _is_error(out):
            fields["error"] = _error_message(out)
        return fields

    def _wrap(self, line: dict) -> str:
        return dumps(line) + "\n"


class SseFormatter(JsonLinesFormatter):
    """option.output_formatter=sse (the tgi_compat streaming default): each line as `data: {json}\\n\\n`."""

    content_type = CONTENT_TYPES["sse"]

    def _wrap(self, line: dict) -> str:
        return sse(line)


class _OpenAIFormatter(Formatter):
    """Shared by the OpenAI shapes: ids, usage and logprobs from the tokens seen."""

    def _ids(self) -> dict[str, Any]:
        return {"request_id": self.ctx.request_id, "created": self.ctx.created, "model": self.ctx.model_name}

    def _usage_counts(self, out: RequestOutput) -> dict[str, int]:
        return {"prompt_tokens": out.num_prompt_tokens,
                "completion_tokens": out.num_generated_tokens or len(self.tokens)}

    def _error(self, out: RequestOutput) -> dict:
        return openai.openai_error(_error_message(out), GENERATION_ERROR_CODE)

    def _logprobs(self, tokens: list[TokenOutput], text_offset: int = 0) -> dict | None:
        if not self.ctx.logprobs:
            return None
        if self.ctx.chat:
            return openai.chat_logprobs(tokens, self.ctx.decode_token)
        return openai.completion_logprobs(tokens, self.ctx.decode_token, text_offset)


class ChatFormatter(_OpenAIFormatter):
    """OpenAI chat.completion, sent once when finished; an OpenAI error object on error."""

    def _format(self, out: RequestOutput) -> str:
        if not out.finished:
            return ""
        if _is_error(out):
            return dumps(self._error(out))
        return dumps(openai.chat_completion_response(
            **self._ids(), content=out.generated_text, finish_reason=out.finish_reason,
            logprobs=self._logprobs(self.tokens), **self._usage_counts(out)))


class CompletionFormatter(_OpenAIFormatter):
    """OpenAI text_completion (one choice), sent once when finished; echo = return_full_text."""

    def _format(self, out: RequestOutput) -> str:
        if not out.finished:
            return ""
        if _is_error(out):
            return dumps(self._error(out))
        offset = len(self.ctx.prompt_text) if self.ctx.return_full_text else 0
        return dumps(openai.completion_response(
            **self._ids(), text=self.generated_text(out), finish_reason=out.finish_reason,
            logprobs=self._logprobs(self.tokens, offset), **self._usage_counts(out)))


class _OpenAIStreamFormatter(_OpenAIFormatter):
    """Chunks per step: the step's text (if any) and, on the last, finish_reason; then usage and [DONE].

    An error mid-stream sends an OpenAI error object as its own event, then [DONE] (vLLM).
    """

    content_type = CONTENT_TYPES["sse"]

    def __init__(self, ctx: ResponseContext):
        super().__init__(ctx)
        self.as_sse = ctx.output_formatter != "jsonlines"
        if not self.as_sse:
            self.content_type = CONTENT_TYPES["jsonlines"]
        self.text_offset = len(ctx.prompt_text) if ctx.return_full_text else 0

    def _format(self, out: RequestOutput) -> str:
        if _is_error(out):
            return self._wrap(self._error(out)) + self._done()
        text = "".join(t.text for t in out.new_tokens)
        if not text and not out.finished and not (self.ctx.logprobs and out.new_tokens):
            return ""
        logprobs = self._logprobs(out.new_tokens, self.text_offset)
        self.text_offset += len(text)
        reason = out.finish_reason if out.finished else None
        body = self._wrap(self._chunk(text, reason, logprobs))
        if out.finished:
            if self.ctx.include_usage:
                body += self._wrap(openai.usage_chunk(**self._ids(), chat=self.ctx.chat,
                                                      **self._usage_counts(out)))
            body += self._done()
        return body

    def _chunk(self, text: str, reason: FinishReason | None, logprobs: dict | None) -> dict:
        raise NotImplementedError

    def _wrap(self, obj: dict) -> str:
        return sse(obj) if self.as_sse else dumps(obj) + "\n"

    def _done(self) -> str:
        return SSE_DONE if self.as_sse else ""


class ChatStreamFormatter(_OpenAIStreamFormatter):
    """OpenAI chat.completion.chunk stream; the first chunk carries role "assistant"."""

    def __init__(self, ctx: ResponseContext):
        super().__init__(ctx)
        self.sent_role = False

    def _chunk(self, text: str, reason: FinishReason | None, logprobs: dict | None) -> dict:
        delta: dict[str, str] = {"content": text}
        if not self.sent_role:
            delta = {"role": "assistant", **delta}
            self.sent_role = True
        return openai.chat_completion_chunk(**self._ids(), delta=delta, finish_reason=reason, logprobs=logprobs)


class CompletionStreamFormatter(_OpenAIStreamFormatter):
    """OpenAI text_completion stream; echo sends the prompt in the first chunk."""

    def __init__(self, ctx: ResponseContext):
        super().__init__(ctx)
        self.echo_pending = ctx.return_full_text

    def _chunk(self, text: str, reason: FinishReason | None, logprobs: dict | None) -> dict:
        if self.echo_pending:
            text, self.echo_pending = self.ctx.prompt_text + text, False
        return openai.completion_chunk(**self._ids(), text=text, finish_reason=reason, logprobs=logprobs)


_LMI_FORMATTERS = {"json": JsonFormatter, "jsonlines": JsonLinesFormatter, "sse": SseFormatter}


def make_formatter(ctx: ResponseContext) -> Formatter:
    """The formatter for one request. Raises ValueError for an unknown ctx.output_formatter
    (the handler resolves names first: resolve_output_formatter)."""
    if ctx.chat:
        return ChatStreamFormatter(ctx) if ctx.stream else ChatFormatter(ctx)
    if ctx.completion:
        return CompletionStreamFormatter(ctx) if ctx.stream else CompletionFormatter(ctx)
    try:
        return _LMI_FORMATTERS[ctx.output_formatter](ctx)
    except KeyError:
        raise ValueError(f"unknown output_formatter {ctx.output_formatter!r}; "
                         f"expected one of {sorted(_LMI_FORMATTERS)}") from None


def render_best_of(ctx: ResponseContext, members: list[list[RequestOutput]], seeds: list[int | None]) -> str:
    """The non-streaming answer of an n / best_of request (TGI best_of semantics).

    members[j] is sequence j's outputs, step by step. The sequence with the highest summed token
    log prob answers as usual; with details, the others follow in details.best_of_sequences as
    {generated_text, finish_reason, generated_tokens, seed, tokens} (TGI BestOfSequence).
    """
    formatters = [JsonFormatter(replace(ctx, details=True)) for _ in members]
    docs = [json.loads("".join(f.format(out) for out in outs)) for f, outs in zip(formatters, members)]
    docs = [doc[0] if isinstance(doc, list) else doc for doc in docs]    # tgi_compat wraps each in a list
    scores = [sum(t.log_prob for t in f.tokens) for f in formatters]
    best = max(range(len(members)), key=lambda j: scores[j])
    doc: dict[str, Any] = {"generated_text": docs[best]["generated_text"]}
    if ctx.details:
        doc["details"] = docs[best]["details"]
        doc["details"]["best_of_sequences"] = [
            {"generated_text": docs[j]["generated_text"], "finish_reason": docs[j]["details"]["finish_reason"],
             "generated_tokens": docs[j]["details"]["generated_tokens"], "seed": seeds[j],
             "tokens": docs[j]["details"]["tokens"]}
            for j in range(len(members)) if j != best]
    return dumps([doc] if ctx.tgi_compat else doc)


def stream_failure(message: str, code: int, output_formatter: str, openai_route: bool) -> str:
    """The last text of a stream whose request failed after HTTP 200 went out (DESIGN §3: a final
    line with finish_reason "error"). OpenAI routes get an error chunk and [DONE], as vLLM sends."""
    if openai_route:
        return sse(openai.openai_error(message, code)) + SSE_DONE
    line = {"token": token_to_dict(SENTINEL_TOKEN), "details": {"finish_reason": FinishReason.ERROR.value},
            "error": message, "code": code}
    return sse(line) if output_formatter == "sse" else dumps(line) + "\n"
