"""What every part of the settings shares: the error, the pydantic base each part derives from, model_dir.

Owns no option of its own but model_dir (every part resolves its relative paths from it); the parts are the
modules beside this one, and settings.py composes them.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration key has a bad value; the message names the key and the allowed range."""


class Options(BaseModel):
    """The base of each part of the settings: frozen, other parts' keys ignored, docstrings as descriptions."""

    # use_attribute_docstrings: each field's docstring is its description (docs/configuration.md's table)
    model_config = ConfigDict(frozen=True, extra="ignore", use_attribute_docstrings=True)

    model_dir: str = "."
    """Directory of serving.properties; relative model_id paths start here."""


def split_keys(text: str) -> tuple[str, ...]:
    """A comma-separated option value as its non-empty items, stripped."""
    return tuple(key.strip() for key in text.split(",") if key.strip())
