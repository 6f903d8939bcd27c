"""The batch code's only coupling to the service and the formatters: a BatchLine -> engine request -> route body.

Owns turning a checked line into prompt ids + SamplingParams (as the OpenAI route would) and a finished
run into the route's JSON answer; the line rules are protocol/batch_lines.py's, the loop runner.py's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lmi_handler.engine.sequence import RequestOutput, SamplingParams
from lmi_handler.protocol.batch_lines import BatchLine
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.formatters import Formatter, make_formatter
from lmi_handler.service import Service


@dataclass
class LineRequest:
    """One line ready for the engine, and the formatter that renders its answer."""

    line: BatchLine
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    formatter: Formatter
    num_prompt_tokens: int = 0

    def answer(self, out: RequestOutput) -> dict[str, Any] | None:
        """Feed one step's output; the route's JSON answer once finished, else None."""
        text = self.formatter.format(out)
        return json.loads(text) if out.finished else None


def check_body(service: Service, line: BatchLine):
    """Parse the line's body as its OpenAI route does (the server pre-validates the same way).

    Raises RequestValidationError: bad parameters 400, a `model` that is not served 404 (as the live route).
    """
    parsed = service.parse(line.body, route=line.url)
    if parsed.openai_model not in (None, service.model_name):
        raise RequestValidationError("model", f"The model `{parsed.openai_model}` does not exist (this server "
                                     f"serves `{service.model_name}`)", status_code=404)
    return parsed


def prepare_line(service: Service, line: BatchLine, request_id: str) -> LineRequest:
    """Tokenize and check a line against the model (context length, vocabulary). Raises RequestValidationError."""
    prepared = service.prepare(check_body(service, line), request_id)[0]
    return LineRequest(line, prepared.request_id, prepared.prompt_token_ids, prepared.params,
                       make_formatter(prepared.context), len(prepared.prompt_token_ids))
