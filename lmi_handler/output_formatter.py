"""The @output_formatter mark of LMI's model.py, importable without djl_python, and the objects it gets.

Owns only the mark (the attribute djl_python's decorator of the same name sets); finding and applying
marked functions is custom_formatters.py's, the objects are request_io.py's.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from lmi_handler.request_io import RequestOutput, TextGenerationOutput

__all__ = ["RequestOutput", "TextGenerationOutput", "output_formatter"]

F = TypeVar("F", bound=Callable)


def output_formatter(function: F) -> F:
    """Mark `function` as model.py's output formatter: (request_output: RequestOutput) -> str, called at each
    step, or (response_data: dict) -> dict, called with each answer object."""
    function.is_output_formatter = True
    return function
