"""The batch JSONL line rules (DESIGN §4): one line -> a checked OpenAI body with the batch rules made explicit.

Shared by the offline runner and the /v1/batches worker. Owns custom_id/method/url checks, the
output-length priority and the sampling defaults; running the body is the batch executor's job.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmi_handler.protocol.errors import RequestValidationError, from_pydantic
from lmi_handler.protocol.openai import OPENAI_RULES, ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

ROUTES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
DEFAULTS_WARNING = ("Batch-level sampling params serve as defaults; per-request values in JSONL body take "
                    "priority.")
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")
LENGTH_FIELDS = ("max_completion_tokens", "max_tokens")
BATCH_RULES = {**OPENAI_RULES, "max_decoding_length": "an integer >= 1",
               "top_k": "an integer >= -1 (0 or -1 = off, 1 = argmax)"}


class BatchRejected(ValueError):
    """The whole batch is refused before any work (DESIGN §4: a line with no output length at all)."""


class BatchDefaults(BaseModel):
    """Batch-level values (CLI flags, or extra fields of POST /v1/batches). None = not given.

    A line's own value always wins (DESIGN §4); max_decoding_length is the output length of
    lines that give neither max_completion_tokens nor max_tokens.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    max_decoding_length: int | None = Field(None, ge=1, description="tokens; lines without a length of their own")
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False, description=">= 0; 0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description="(0, 1]; 1.0 = off")
    top_k: int | None = Field(None, ge=-1, description="0 or -1 = off; 1 = argmax")

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "BatchDefaults":
        """Validate batch-level values (numbers from JSON or the CLI). Raises RequestValidationError naming one."""
        given = {key: value for key, value in data.items() if value is not None}
        try:
            return cls.model_validate(given)
        except ValidationError as exc:
            raise from_pydantic(exc, BATCH_RULES) from None

    @property
    def sampling(self) -> dict[str, Any]:
        """The batch-level sampling values given (temperature, top_p, top_k)."""
        return {name: getattr(self, name) for name in SAMPLING_DEFAULTS if getattr(self, name) is not None}

    def log_once(self) -> None:
        """The warning of DESIGN §4, once per batch, only when batch-level sampling values are given."""
        if self.sampling:
            shown = ", ".join(f"{name}={value}" for name, value in self.sampling.items())
            logger.warning("%s (batch-level: %s)", DEFAULTS_WARNING, shown)


@dataclass(frozen=True)
class LineError:
    """A line that cannot run. `line` is 1-based; `custom_id` is None when it cannot be read.

    `code` is a short word (invalid_json, invalid_url, ...); `param` names the field at fault;
    `status_code` 400 marks a body parameter the OpenAI route itself would refuse (the output
    record then carries the route's 400 answer, as OpenAI's batch output does).
    """

    line: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None
    status_code: int | None = None


@dataclass(frozen=True)
class BatchLine:
    """A good line: its number (1-based), custom_id, route and the body to send to that route.

    `body` is the line's body with the batch rules written in (length resolved, batch defaults
    filled, temperature 0 where none is given), so the OpenAI route answers it exactly as the
    batch contract says.
    """

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class BatchPlan:
    """The outcome of checking a whole file: how many good lines, the bad lines, the lines with no length."""

    num_good: int = 0
    errors: list[LineError] = field(default_factory=list)
    missing_length: list[BatchLine] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.num_good + len(self.errors) + len(self.missing_length)

    def rejection(self) -> str | None:
        """Why the whole batch is refused before any work (lines with no output length), or None."""
        if not self.missing_length:
            return None
        named = ", ".join(f"line {b.line} ({b.custom_id})" for b in self.missing_length)
        return (f"{len(self.missing_length)} line(s) have no output length: {named}. Give each line "
                "max_completion_tokens or max_tokens, or set the batch-level max_decoding_length")


def _error(line: int, custom_id: str | None, code: str, message: str, param: str | None = None,
           status_code: int | None = None) -> LineError:
    return LineError(line, custom_id, code, f"line {line}: {message}", param, status_code)


def _envelope(text: str, number: int) -> dict[str, Any] | LineError:
    """custom_id, method, url and body of one JSONL line, or the LineError saying which is wrong."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return _error(number, None, "invalid_json", f"not valid JSON ({str(exc)[:120]}); its custom_id "
                      "cannot be read", "line")
    if not isinstance(data, dict):
        return _error(number, None, "invalid_json", "must be a JSON object", "line")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _error(number, None, "missing_custom_id", "custom_id must be a non-empty string, got "
                      f"{custom_id!r}", "custom_id")
    if data.get("method") != "POST":
        return _error(number, custom_id, "invalid_method", f"method must be \"POST\", got "
                      f"{data.get('method')!r}", "method")
    if data.get("url") not in ROUTES:
        return _error(number, custom_id, "invalid_url", f"url {data.get('url')!r} is not supported; use one "
                      f"of {', '.join(ROUTES)}", "url")
    if not isinstance(data.get("body"), dict):
        return _error(number, custom_id, "missing_body", "body must be a JSON object with the request",
                      "body")
    if data["body"].get("stream") not in (None, False):
        return _error(number, custom_id, "invalid_stream", "stream must be false or absent: batch lines are not "
                      "streamed (streaming is for the live routes)", "body.stream")
    return data


def output_length(body: dict[str, Any], defaults: BatchDefaults) -> int | None:
    """DESIGN §4: max_completion_tokens, then max_tokens, then the batch's max_decoding_length (None: none)."""
    for name in LENGTH_FIELDS:
        if body.get(name) is not None:
            return body[name]
    return defaults.max_decoding_length


def effective_body(url: str, body: dict[str, Any], defaults: BatchDefaults, length: int) -> dict[str, Any]:
    """The line's body with the batch rules written in, as the OpenAI route must receive it.

    Length: `length` (see output_length) as max_tokens on /v1/completions (that route's only length
    field) or max_completion_tokens on chat. Sampling: the line's value, else the batch default,
    else none; a temperature still absent becomes 0 (greedy, DESIGN §4; the live routes would
    sample at 1.0). top_p absent stays 1.0 and top_k absent stays off, as on the routes.
    """
    out = {key: value for key, value in body.items() if value is not None and key not in LENGTH_FIELDS}
    out["max_tokens" if url == "/v1/completions" else "max_completion_tokens"] = length
    for name, value in defaults.sampling.items():
        out.setdefault(name, value)
    out.setdefault("temperature", 0.0)
    return out


def check_line(text: str, number: int, defaults: BatchDefaults) -> BatchLine | LineError:
    """Check one JSONL line (1-based `number`) on its own: envelope, body parameters, length.

    A good line whose length is missing everywhere comes back as a BatchLine with an empty
    body; BatchPlan collects those as missing_length. Uniqueness of custom_id is read_batch's.
    """
    data = _envelope(text, number)
    if isinstance(data, LineError):
        return data
    custom_id, url, body = data["custom_id"], data["url"], data["body"]
    length = output_length(body, defaults)
    try:
        for name in LENGTH_FIELDS:  # both length fields are checked on both routes
            if body.get(name) is not None and (type(body[name]) is not int or body[name] < 1):
                raise RequestValidationError.out_of_range(name, body[name], BATCH_RULES[name])
        if length is None:
            ROUTES[url].parse({**body, LENGTH_FIELDS[1]: 1})
            return BatchLine(number, custom_id, url, {})
        sent = effective_body(url, body, defaults, length)
        request = ROUTES[url].parse(sent)
        request.to_generation_parameters()
    except RequestValidationError as err:
        return _error(number, custom_id, "invalid_parameter", err.message, err.field, err.status_code)
    return BatchLine(number, custom_id, url, sent)


def check_lines(lines: Iterable[str], defaults: BatchDefaults,
                endpoint: str | None = None) -> Iterator[BatchLine | LineError]:
    """Check every line of a batch file, in order, one at a time (nothing but custom_ids is kept).

    Blank lines are skipped (still counted for line numbers). A second line with a custom_id
    already seen is an error (the first one runs). `endpoint` (a /v1/batches job's) makes a
    line with another url an error. A BatchLine with an empty body has no output length.
    """
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        checked = check_line(text.rstrip("\r\n"), number, defaults)
        if checked.custom_id is not None and checked.custom_id in seen:
            checked = _error(number, checked.custom_id, "duplicate_custom_id", f"custom_id "
                             f"{checked.custom_id!r} is already used on line {seen[checked.custom_id]}",
                             "custom_id")
        elif checked.custom_id is not None:
            seen[checked.custom_id] = number
        if isinstance(checked, BatchLine) and endpoint and checked.url != endpoint:
            checked = _error(number, checked.custom_id, "invalid_url", f"url {checked.url!r} differs from the "
                             f"batch's endpoint {endpoint!r}", "url")
        yield checked


def read_batch(lines: Iterable[str], defaults: BatchDefaults, endpoint: str | None = None) -> BatchPlan:
    """The first pass over a file: counts, bad lines and lines without a length (good bodies are not kept)."""
    plan = BatchPlan()
    for checked in check_lines(lines, defaults, endpoint):
        if isinstance(checked, LineError):
            plan.errors.append(checked)
        elif checked.body:
            plan.num_good += 1
        else:
            plan.missing_length.append(checked)
    return plan
