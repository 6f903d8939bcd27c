"""LMI's documented request and output objects, as a model.py output formatter receives them.

Owns the shapes of djl-serving's output_formatter_schema.md (RequestOutput, TextGenerationOutput, Sequence,
Token; RequestInput, TextInput); filling them from the engine's outputs is custom_formatters.py's.
`from lmi_handler.request_io import TextGenerationOutput` works where djl_python is not installed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Token:
    """One generated token (LMI Token): `log_prob` is the natural log of its probability."""

    id: int
    text: str
    log_prob: float | None = None
    special_token: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """LMI's token object: {id, text, log_prob} and special_token when it is one."""
        out: dict[str, Any] = {"id": self.id, "text": self.text, "log_prob": self.log_prob}
        if self.special_token:
            out["special_token"] = True
        return out


@dataclass
class Sequence:
    """One generated sequence; get_next_token() walks its tokens once, as LMI's iterator does.

    A formatter called at each step reads the tokens added since its last call with get_next_token(), which
    returns (Token, is_first_token, is_last_token), or (None, False, False) when none is left.
    """

    tokens: list[Token] = field(default_factory=list)
    cumulative_log_prob: float = 0.0
    finish_reason: str | None = None      # length | eos_token | stop_sequence | error, once finished
    _last_index: int | None = field(default=None, repr=False)
    _next_index: int = field(default=0, repr=False)

    def has_next_token(self) -> bool:
        return self._next_index < len(self.tokens)

    def get_next_token(self) -> tuple[Token | None, bool, bool]:
        if not self.has_next_token():
            return None, False, False
        index = self._next_index
        self._next_index += 1
        return self.tokens[index], index == 0, index == self._last_index

    def get_last_token(self) -> Token | None:
        return self.tokens[self._last_index] if self._last_index is not None else None

    def add_token(self, token: Token, is_last: bool = False) -> None:
        self.tokens.append(token)
        if token.log_prob is not None:
            self.cumulative_log_prob += token.log_prob
        if is_last:
            self._last_index = len(self.tokens) - 1


@dataclass
class RequestInput:
    """What was asked: `parameters` as the request sent them (after the input formatter)."""

    request_id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    output_formatter: Callable | str | None = None


@dataclass
class TextInput(RequestInput):
    """A text request: the prompt as given (`input_text`) and its token ids."""

    input_text: str | None = None
    input_ids: list[int] = field(default_factory=list)
    adapters: Any = None
    tokenizer: Any = None


@dataclass
class RequestOutput:
    """A request's output so far; `finished` once its last token is in."""

    request_id: str | None = None
    input: RequestInput | None = None
    finished: bool = False


@dataclass
class TextGenerationOutput(RequestOutput):
    """A text generation's output: `sequences[best_sequence_index]` is the answer (one sequence per request,
    as LMI's custom formatters document). `prompt_tokens_details` holds the prompt's tokens when the request
    asked for decoder_input_details."""

    sequences: dict[int, Sequence] = field(default_factory=lambda: {0: Sequence()})
    best_sequence_index: int = 0
    prompt_tokens_details: list[Token] = field(default_factory=list)
