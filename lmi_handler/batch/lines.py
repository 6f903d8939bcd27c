"""The batch-line loop both runners share (offline runner.py, the server's jobs.py), and a line's request.

Owns which lines of a file still run (a resumed run skips the ones with a result; a line that cannot run
gets its record at once), turning a checked line into its RequestPlan (Kind.BATCH_LINE: the OpenAI object
its url answers) and each outcome into its record. Admitting lines is each runner's (the engine's step
loop offline, the front end's queue on the server); line rules are protocol/batch_lines.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from lmi_handler.batch.results import line_error_record, line_key, refused_record, success_record
from lmi_handler.engine.sequence import RequestOutput
from lmi_handler.protocol.batch_lines import BatchLine, LineError
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.formatters import Answer
from lmi_handler.protocol.plan import Kind, RequestPlan
from lmi_handler.protocol.sequences import Member
from lmi_handler.service import Service

Record = dict[str, Any]


def lines_to_run(items: Iterable[BatchLine | LineError], done: set[str],
                 write: Callable[[Record], None]) -> Iterator[BatchLine]:
    """The lines to run, in file order: those whose key is in `done` (results.ResultFiles.done) are skipped,
    a line that cannot run is written (`write(record)`) and skipped."""
    for item in items:
        if line_key(item) in done:
            continue
        if isinstance(item, LineError):
            write(line_error_record(item))
            continue
        yield item


def plan_line(service: Service, line: BatchLine, request_id: str) -> RequestPlan:
    """Parse, tokenize and check a line as its OpenAI route does, with any `model` (the served-model rule,
    Service.answering_model). Raises RequestValidationError: bad parameters or a prompt that cannot fit."""
    return service.plan_openai_body(line.body, line.url, request_id, kind=Kind.BATCH_LINE)


def refusal(line: BatchLine, request_id: str, exc: RequestValidationError) -> Record:
    """The record of a line its route refused (the route's own 4xx answer, as OpenAI's batch output has it)."""
    return refused_record(line.custom_id, request_id, exc.message, exc.status_code, exc.field)


def answer_record(line: BatchLine, request_id: str, body: dict[str, Any]) -> Record:
    """The record of a line the route answered: 200 with the answer, or the status of the error object a
    failed generation answers (424 on the server, 500 for a step that failed offline)."""
    status = body["error"]["code"] if "error" in body else 200
    return success_record(line.custom_id, request_id, body, status)


@dataclass
class LineRequest:
    """One line ready for the engine: its plan, engine sequences (members) and the answer they fill."""

    line: BatchLine
    plan: RequestPlan
    members: list[Member]
    answer: Answer

    @classmethod
    def prepare(cls, service: Service, line: BatchLine, request_id: str) -> "LineRequest":
        """The line's plan and members (n > 1 gives several). Raises RequestValidationError."""
        plan = plan_line(service, line, request_id)
        (members,) = plan.members()   # a batch line has one prompt
        return cls(line, plan, members, Answer(plan, [members]))

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    def add(self, out: RequestOutput) -> dict[str, Any] | None:
        """Feed one step's output of a member; the route's JSON answer once every member finished, else None."""
        self.answer.add(out)
        return self.answer.body() if self.answer.done else None
