"""The @input_formatter mark of LMI's model.py, importable without djl_python.

Owns only the mark (the attribute djl_python's decorator of the same name sets); finding and applying
marked functions is custom_formatters.py's.
"""
from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def input_formatter(function: F) -> F:
    """Mark `function` as model.py's input formatter: (decoded_payload: dict, tokenizer=None, **kwargs) -> dict."""
    function.is_input_formatter = True
    return function
