"""The batch code's only coupling to the service and the formatters: a BatchLine -> engine sequences -> route body.

Owns turning a checked line into its RequestPlan (Kind.BATCH_LINE: the OpenAI object its url answers) and
the finished members into that body; the line rules are protocol/batch_lines.py's, the loop runner.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmi_handler.engine.sequence import RequestOutput
from lmi_handler.protocol.batch_lines import BatchLine
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.formatters import Answer
from lmi_handler.protocol.plan import Kind, RequestPlan
from lmi_handler.protocol.sequences import Member


@dataclass
class LineRequest:
    """One line ready for the engine: its plan, engine sequences (members) and the answer they fill."""

    line: BatchLine
    plan: RequestPlan
    members: list[Member]
    answer: Answer

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.plan.prompts[0].token_ids)

    def add(self, out: RequestOutput) -> dict[str, Any] | None:
        """Feed one step's output of a member; the route's JSON answer once every member finished, else None."""
        self.answer.add(out)
        return self.answer.body() if self.answer.done else None


def plan_line(service, line: BatchLine, request_id: str) -> RequestPlan:
    """Parse, tokenize and check a line as its OpenAI route does (the server pre-validates the same way).

    Raises RequestValidationError: bad parameters or a prompt that cannot fit 400, a `model` that is not
    served 404 (as the live route answers, so a line gets the same answer offline and on the server).
    """
    model = line.body.get("model")
    if model not in (None, service.model_name):
        raise RequestValidationError("model", f"The model `{model}` does not exist (this server serves "
                                     f"`{service.model_name}`)", status_code=404)
    return service.plan_openai_body(line.body, line.url, request_id, kind=Kind.BATCH_LINE)


def prepare_line(service, line: BatchLine, request_id: str) -> LineRequest:
    """The line's plan and members (n > 1 gives several). Raises RequestValidationError."""
    plan = plan_line(service, line, request_id)
    (members,) = plan.members()   # a batch line has one prompt
    return LineRequest(line, plan, members, Answer(plan, [members]))
