"""The typed error every protocol parser raises for bad client input, and its wire bodies.

The server and handler map it to an HTTP status; OpenAI-shaped bodies are built in protocol/openai.py.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class RequestValidationError(ValueError):
    """Bad client input, found before inference: names the field, the bad value and the allowed range.

    `field` is the name as the client spelled it (an alias such as `stop` stays `stop`).
    `status_code` is the HTTP status the server answers with (400 unless a rule says otherwise,
    e.g. 413 for an over-long input).
    """

    def __init__(self, field: str, message: str, status_code: int = 400):
        super().__init__(message)
        self.field = field
        self.message = message
        self.status_code = status_code

    def to_dict(self) -> dict[str, Any]:
        """LMI schema error body: {"error": message, "code": status_code}."""
        return {"error": self.message, "code": self.status_code}

    @classmethod
    def out_of_range(cls, field: str, value: Any, allowed: str) -> "RequestValidationError":
        """`field` must be `allowed`, got `value` (the one message shape for type and range errors)."""
        return cls(field, f"Invalid parameter `{field}`: must be {allowed}, got {_show(value)}")


def from_pydantic(exc: ValidationError, rules: dict[str, str], prefix: str = "") -> RequestValidationError:
    """Turn pydantic's first error into a RequestValidationError naming the field as sent.

    `rules` maps a field (or alias) name to its allowed values in words ("a number in (0, 1]");
    `prefix` is prepended to nested names (e.g. "parameters.").
    """
    err = exc.errors(include_url=False)[0]
    loc = [str(part) for part in err["loc"]]
    field = loc[0] if loc else "body"
    allowed = rules.get(field)
    if allowed is None:
        return RequestValidationError(prefix + field, f"Invalid parameter `{prefix}{field}`: {err['msg']}")
    return RequestValidationError.out_of_range(prefix + field, err.get("input"), allowed)


def _show(value: Any) -> str:
    """The bad value as the client would recognise it (JSON-ish, cut to 80 characters)."""
    text = repr(value)
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    return text if len(text) <= 80 else text[:77] + "..."
