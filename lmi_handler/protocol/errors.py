"""The typed error every protocol parser raises for bad client input, and each dialect's error object.

Owns the error shapes (LMI {"error", "code"}, OpenAI {"error": {...}}, TGI {"error", "error_type"}) behind
one `error_body(dialect, ...)` that the app, the handler and the batch jobs all call, the 424 status, and
keeping every error text encodable (safe_text); which dialect a request speaks is dialects.py's, the bytes
are the encoder's.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationError

from lmi_handler.protocol.dialects import Dialect

# DJL (DESIGN §2): an item that fails inside the handler (parsing, generation) answers 424.
GENERATION_ERROR_CODE = 424

ErrorType = Literal["invalid_request_error", "server_error"]


def safe_text(text: str) -> str:
    """`text` with what UTF-8 cannot carry (lone surrogates, which JSON's "\\ud800" escapes let a client
    send) written as Python escapes ("\\ud800"); all else unchanged. Every error text that may echo a
    client's value passes here, so an error body is always encodable, whatever the request held."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RequestValidationError(ValueError):
    """Bad client input, found before inference: names the field, the bad value and the allowed range.

    `field` is the name as the client spelled it (an alias such as `stop` stays `stop`).
    `status_code` is the HTTP status the server answers with (400 unless a rule says otherwise,
    e.g. 413 for an over-long input). Both texts go through safe_text: they may echo the client's bytes.
    """

    def __init__(self, field: str, message: str, status_code: int = 400):
        message = safe_text(message)
        super().__init__(message)
        self.field = safe_text(field)
        self.message = message
        self.status_code = status_code

    @classmethod
    def out_of_range(cls, field: str, value: Any, allowed: str) -> "RequestValidationError":
        """`field` must be `allowed`, got `value` (the one message shape for type and range errors)."""
        return cls(field, f"Invalid parameter `{field}`: must be {allowed}, got {show_value(value)}")


def _lmi_error(message: str, code: int, param: str | None = None) -> dict[str, Any]:  # noqa: ARG001 - one signature per shape
    """LMI schema error object {"error": message, "code": code} (DESIGN §3: validation errors, failed items)."""
    return {"error": message, "code": code}


def _openai_error(message: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI error object {"error": {message, type, param, code}}; code is the HTTP status (as vLLM).
    A refusal (code below 424) is an invalid_request_error, a failure of generation or of the server
    (424 and up: timeouts, cancels, a full queue included) a server_error."""
    kind: ErrorType = "invalid_request_error" if code < GENERATION_ERROR_CODE else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _tgi_error(message: str, code: int, param: str | None = None) -> dict[str, Any]:  # noqa: ARG001 - one signature per shape
    """TGI's error object {"error", "error_type": "generation"} once generation failed (code 424 and up: TGI's
    clients pick their exception by error_type). A refusal before inference keeps LMI's {"error", "code"}:
    TGI's clients then pick it by the HTTP status (400: BadRequestError), as for TGI's own 4xx."""
    if code < GENERATION_ERROR_CODE:
        return _lmi_error(message, code)
    return {"error": message, "error_type": "generation"}


# One error shape per dialect: a new dialect adds its row (docs/architecture.md, "Adding an output dialect").
_ERROR_SHAPES = {Dialect.LMI: _lmi_error, Dialect.OPENAI: _openai_error, Dialect.TGI: _tgi_error}


def error_body(dialect: Dialect, message: str, code: int, param: str | None = None) -> dict[str, Any]:
    """The error object of a request that failed, in its dialect's shape; `code` is the HTTP status it is
    answered with (or the failed item's, mid-answer), `param` the field at fault (OpenAI's `param`).
    Both texts pass safe_text here, the one place every error body is built: they may echo a client's value."""
    return _ERROR_SHAPES[dialect](safe_text(message), code, None if param is None else safe_text(param))


def from_pydantic(exc: ValidationError, rules: dict[str, str], prefix: str = "") -> RequestValidationError:
    """Turn pydantic's first error into a RequestValidationError naming the field as sent.

    `rules` maps a field (or alias) name to its allowed values in words ("a number in (0, 1]");
    `prefix` is prepended to nested names (e.g. "parameters.").
    """
    err = exc.errors(include_url=False)[0]
    loc = [str(part) for part in err["loc"]]
    field = loc[0] if loc else "body"
    allowed = rules.get(field)
    if err.get("type") == "missing":        # its "input" is the whole body, not the field's value
        return RequestValidationError(prefix + field, f"Invalid parameter `{prefix}{field}`: required"
                                      + (f", must be {allowed}" if allowed else ""))
    if allowed is None:
        return RequestValidationError(prefix + field, f"Invalid parameter `{prefix}{field}`: {err['msg']}")
    return RequestValidationError.out_of_range(prefix + field, err.get("input"), allowed)


def show_value(value: Any) -> str:
    """The bad value as the client would recognise it (JSON-ish, cut to 80 characters; always encodable)."""
    try:
        text = safe_text(repr(value))
    except ValueError:          # an int past Python's 4300-digit str() limit
        text = f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    return text if len(text) <= 80 else text[:77] + "..."


def check_unicode(text: str, field: str) -> None:
    """Raise RequestValidationError naming `field` for text that is not valid Unicode (JSON allows lone
    surrogates such as "\\ud800"; UTF-8 and the tokenizer do not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestValidationError(field, f"Invalid parameter `{field}`: the text is not valid Unicode "
                                     f"({exc.reason} at position {exc.start})") from None
