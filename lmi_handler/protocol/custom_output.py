"""A model.py output formatter at work on one request: the engine's outputs in LMI's documented shape, step by step.

Owns CustomOutputRule (which formatter answers a request, and in which of LMI's two forms), CustomAnswer (the
RequestOutput form: a TextGenerationOutput fed each step, the formatter's text sent) and FormatterError (a
formatter that raised: a 500 for its request alone). Loading model.py is custom_formatters.py's; which
requests get a formatter is service.py's.
"""
from __future__ import annotations

import inspect
import math
import traceback
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from lmi_handler.engine.sequence import FinishReason, RequestOutput, TokenOutput
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.request_io import Sequence, TextGenerationOutput, TextInput, Token

FORMATTER_ERROR_CODE = 500     # a formatter that raises is the server's code failing, not the client's request


class FormatterError(RequestValidationError):
    """A model.py formatter raised or returned the wrong type: answers its request alone with a 500 that names
    the formatter and the error's last line (the whole traceback goes to the log)."""

    def __init__(self, formatter: Callable, role: str, problem: str):
        name = formatter.__name__      # model.py's functions (custom_formatters.py keeps only functions)
        super().__init__(name, f"the {role} formatter {name} of model.py failed: {problem}", FORMATTER_ERROR_CODE)

    @classmethod
    def raised(cls, formatter: Callable, role: str, exc: BaseException) -> "FormatterError":
        return cls(formatter, role, traceback.format_exception_only(type(exc), exc)[-1].strip())


def takes_dict(formatter: Callable) -> bool:
    """LMI's two output formatter forms, told apart by the first parameter's annotation, as LMI's own
    handlers told their legacy form: `dict` (its vLLM / TensorRT-LLM form: each answer object in, an object
    out) or anything else (its RequestOutput form: called at each step, returns the text to send)."""
    try:
        first = next(iter(inspect.signature(formatter).parameters.values()))
    except (StopIteration, TypeError, ValueError):
        return False
    annotation = first.annotation
    if isinstance(annotation, str):       # `from __future__ import annotations` in model.py
        return annotation.split("[")[0].strip() in ("dict", "Dict", "typing.Dict")
    return annotation is dict or typing.get_origin(annotation) is dict


@dataclass(frozen=True)
class CustomOutputRule:
    """The output formatter answering a request (the adapter's model.py, else the base model's), the form it
    takes, and the request's parameters as sent (its TextInput.parameters)."""

    formatter: Callable
    parameters: Mapping[str, Any] = field(default_factory=dict)

    @property
    def takes_dict(self) -> bool:
        return takes_dict(self.formatter)

    def reshape(self, obj: Any) -> Any:
        """The dict form: the formatter's object for one answer object (a whole answer or a stream line);
        a one-element list (tgi_compat) has its object reshaped; anything else (the stream's end marker) passes
        as it is. Raises FormatterError."""
        if isinstance(obj, list):
            return [self.reshape(item) for item in obj]
        if not isinstance(obj, dict):
            return obj
        try:
            result = self.formatter(obj)
        except Exception as exc:  # user code: any failure is this request's alone
            raise FormatterError.raised(self.formatter, "output", exc) from exc
        if not isinstance(result, dict):
            raise FormatterError(self.formatter, "output", f"it returned {type(result).__name__}, not a dict")
        return result


def _token(out: TokenOutput) -> Token:
    log_prob = out.log_prob if out.log_prob is not None and math.isfinite(out.log_prob) else None
    return Token(out.id, out.text, log_prob, bool(out.special_token))


class CustomAnswer:
    """The RequestOutput form for one request: at each step its new tokens join the TextGenerationOutput and
    the formatter is called once per new token (LMI's streaming loop), or once when the request ends with no
    new token; streamed, each step's texts go out as they come, else all of them once the request finished."""

    def __init__(self, rule: CustomOutputRule, request_id: str, prompt_text: str, prompt_ids: tuple[int, ...],
                 stream: bool):
        self.rule = rule
        self.stream = stream
        request_input = TextInput(request_id, dict(rule.parameters), rule.formatter, input_text=prompt_text,
                                  input_ids=list(prompt_ids))
        self.output = TextGenerationOutput(request_id, request_input)
        self.parts: list[str] = []
        self.finished = False

    @property
    def sequence(self) -> Sequence:
        return self.output.sequences[self.output.best_sequence_index]

    def step(self, out: RequestOutput | None) -> tuple[str, bool]:
        """This step's text and whether it is the last. Raises FormatterError."""
        if out is None:
            return "", False
        self._add(out)
        texts = [self._call() for _ in out.new_tokens] or ([self._call()] if out.finished else [])
        self.finished = out.finished
        if self.stream:
            return "".join(texts), self.finished
        self.parts += texts
        return ("".join(self.parts), True) if self.finished else ("", False)

    def _add(self, out: RequestOutput) -> None:
        if out.prompt_tokens is not None:
            self.output.prompt_tokens_details = [_token(t) for t in out.prompt_tokens]
        for i, token in enumerate(out.new_tokens):
            self.sequence.add_token(_token(token), is_last=out.finished and i == len(out.new_tokens) - 1)
        if out.finished:
            reason = FinishReason.ERROR if out.error is not None else out.finish_reason
            self.sequence.finish_reason = None if reason is None else FinishReason(reason).value
            self.output.finished = True

    def _call(self) -> str:
        try:
            text = self.rule.formatter(self.output)
        except Exception as exc:  # user code: any failure is this request's alone
            raise FormatterError.raised(self.rule.formatter, "output", exc) from exc
        if text is None:
            return ""
        if not isinstance(text, str):
            raise FormatterError(self.rule.formatter, "output", f"it returned {type(text).__name__}, not a str")
        return text
