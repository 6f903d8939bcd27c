"""The typed error every protocol parser raises for bad client input, and the error objects of both dialects.

Owns the error shapes (LMI {"error", "code"}, OpenAI {"error": {...}}), the 424 status, and keeping every
error text encodable (safe_text); the server and handler pick the status, the encoder turns the objects
into bytes.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationError

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
        return cls(field, f"Invalid parameter `{field}`: must be {allowed}, got {_show(value)}")


def lmi_error(message: str, code: int) -> dict[str, Any]:
    """LMI schema error object {"error": message, "code": code} (DESIGN §3: validation errors, failed items)."""
    return {"error": safe_text(message), "code": code}


def openai_error(message: str, code: int, param: str | None = None,
                 error_type: ErrorType | None = None) -> dict[str, Any]:
    """OpenAI error object {"error": {message, type, param, code}}; code is the HTTP status (as vLLM)."""
    kind = error_type or ("invalid_request_error" if code < 500 else "server_error")
    return {"error": {"message": safe_text(message), "type": kind, "param": None if param is None else safe_text(param),
                      "code": code}}


def error_object(message: str, code: int, *, openai: bool, param: str | None = None) -> dict[str, Any]:
    """The body of a request that failed before its answer began: OpenAI's shape on OpenAI routes
    (a generation failure, code >= 424, is a server_error), else LMI's."""
    if openai:
        kind: ErrorType = "invalid_request_error" if code < GENERATION_ERROR_CODE else "server_error"
        return openai_error(message, code, param=param, error_type=kind)
    return lmi_error(message, code)


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


def _show(value: Any) -> str:
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
