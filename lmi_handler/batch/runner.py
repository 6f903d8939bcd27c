"""The offline batch runner: a JSONL file of OpenAI requests through the rolling-batch engine, results by custom_id.

Owns the admission window and the step loop (no HTTP, no handle() calls); which lines run and their
records are lines.py's (shared with the server's jobs), line rules protocol/batch_lines.py's.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from lmi_handler.batch.lines import LineRequest, Record, answer_record, lines_to_run, refusal
from lmi_handler.batch.results import ResultFiles, is_success, output_tokens
from lmi_handler.engine.engine import RequestRejected
from lmi_handler.engine.faults import StepGuard
from lmi_handler.engine.health import EngineDead
from lmi_handler.protocol.batch_lines import (
    BatchDefaults,
    BatchLine,
    BatchPlan,
    BatchRejected,
    LineError,
    check_lines,
    read_batch,
)
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import RequestValidationError, error_body
from lmi_handler.service import Service

logger = logging.getLogger(__name__)
__all__ = ["BatchRejected", "BatchRunner", "BatchSummary", "EngineFailed", "Progress"]


class EngineFailed(RuntimeError):
    """The engine cannot go on (engine/health.py: EngineDead, e.g. a tensor-parallel rank is gone, a sticky CUDA
    error). No retry on it: the process ends (a Ray replica exits, so Ray starts a fresh one) and the lines
    without a record run again."""


@dataclass
class BatchSummary:
    """What a run did: lines in the file, results already there, and this run's counts and output tokens."""

    total: int
    already_done: int
    completed: int
    failed: int
    output_tokens: int
    elapsed_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def check_file(input_path: Path, defaults: BatchDefaults) -> BatchPlan:
    """The first pass over a batch file (counts, bad lines), the batch-level defaults' warning logged once.
    Raises BatchRejected (naming the lines) when some line has no output length: nothing may run."""
    with open(input_path, encoding="utf-8", errors="replace") as lines:
        plan = read_batch(lines, defaults)
    if plan.rejection():
        raise BatchRejected(plan.rejection())
    defaults.log_once()
    return plan


def resuming(results: ResultFiles, total: int) -> int:
    """How many of the file's `total` lines already have a result (logged when some do)."""
    if results.done:
        logger.info("resuming: %d of %d lines already have a result", len(results.done), total)
    return len(results.done)


class Progress:
    """tqdm bar: lines done (of the file), failed, output tokens/s and the ETA tqdm computes."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="req", desc="batch", disable=not enabled,
                        mininterval=0.5, dynamic_ncols=True)
        self.initial = initial    # lines with a result before this run (a disabled tqdm keeps none of it)
        self.started = time.monotonic()
        self.failed = 0
        self.output_tokens = 0

    def update(self, record: Record, advance: bool = True) -> None:
        """Count one line's record (and move the bar one line, unless `advance` is False: see show)."""
        self.failed += not is_success(record)
        self.output_tokens += output_tokens(record)
        self._postfix()
        if advance:
            self.bar.update(1)

    def show(self, num_lines: int) -> None:
        """Set the bar to `num_lines` done in this run (lines counted elsewhere, e.g. by Ray replicas)."""
        self.bar.n = self.initial + num_lines
        self.bar.refresh()

    def _postfix(self) -> None:
        rate = self.output_tokens / max(time.monotonic() - self.started, 1e-9)
        self.bar.set_postfix(failed=self.failed, tok_s=f"{rate:.1f}", refresh=False)

    def close(self) -> None:
        self.bar.close()


class BatchRunner:
    """Runs batch files on one loaded Service's engine. `window` bounds the sequences inside the engine at once
    (default: twice the engine's max_num_seqs, so its waiting queue never runs dry), so memory does not
    grow with the file."""

    def __init__(self, service: Service, window: int | None = None):
        self.service = service
        self.engine = service.engine
        self.window = window or 2 * self.engine.scheduler.config.max_num_seqs
        # the server's rules for a failed step (engine/faults.py): a fault ends only the lines it is pinned to,
        # and decides whether the engine is dead
        self.guard = StepGuard(self.engine)

    def run(self, input_path: Path, output_path: Path, errors_path: Path | None = None,
            defaults: BatchDefaults | None = None, progress: bool = True) -> BatchSummary:
        """Run every line of `input_path` that has no result yet in the output/error files.

        Raises BatchRejected (naming the lines) when some line has no output length, before any
        file is written. Successes go to `output_path`; failures to `errors_path` (or `output_path`).
        """
        input_path, defaults = Path(input_path), defaults or BatchDefaults()
        plan = check_file(input_path, defaults)
        started = time.monotonic()
        with ResultFiles(output_path, errors_path) as results:
            already = resuming(results, plan.total)
            bar = Progress(plan.total, already, progress)
            try:
                with open(input_path, encoding="utf-8", errors="replace") as lines:
                    self._run_lines(check_lines(lines, defaults), results, bar)
            finally:
                bar.close()
            return BatchSummary(plan.total, already, results.num_completed, results.num_failed,
                                bar.output_tokens, time.monotonic() - started)

    def _run_lines(self, items, results: ResultFiles, bar: Progress) -> None:
        def write(record: Record) -> None:
            results.write(record)
            bar.update(record)

        self.run_items(items, results.done, write)

    def run_items(self, items: Iterable[BatchLine | LineError], done: set[str],
                  write: Callable[[Record], None]) -> None:
        """Run checked lines (protocol/batch_lines.check_lines' items, in file order) whose key is not in `done`;
        each line's record goes to `write` once it has one (a bad line's at once, a refused one's at admission).

        A step's fault ends only the lines it hits (StepGuard), each with a 500 record. Raises EngineFailed when
        the engine cannot go on (StepGuard raised EngineDead: a tensor-parallel rank died, a sticky CUDA error,
        every step failing even alone): the lines still inside the engine get no record, so a rerun (or another
        replica) does them.
        """
        inflight: dict[str, LineRequest] = {}
        try:
            for line in lines_to_run(items, done, write):
                request = self._admit(line, write)
                if request is not None:
                    inflight.update({member.request_id: request for member in request.members})
                while len(inflight) >= self.window:
                    self._step(inflight, write)
            while inflight:
                self._step(inflight, write)
        finally:
            self.engine.abort_all()

    def _admit(self, line: BatchLine, write) -> LineRequest | None:
        """The line planned and its sequences in the engine; None (its refusal written) when the route refuses it."""
        request_id = uuid.uuid4().hex
        try:
            request = LineRequest.prepare(self.service, line, request_id)
            self.service.add_members(request.plan.prompts[0].token_ids, request.members)
        except RequestRejected as exc:      # the engine refused it (never after a good plan: a bug)
            write(refusal(line, request_id, RequestValidationError(exc.field, str(exc))))
            return None
        except RequestValidationError as exc:
            write(refusal(line, request_id, exc))
            return None
        return request

    def _step(self, inflight: dict[str, LineRequest], write) -> None:
        try:
            outputs, failed = self.guard.step()
        except EngineDead as dead:    # a dead engine fails no line: they run again after the restart
            raise EngineFailed(f"the engine cannot go on: {dead.reason}") from dead
        except Exception:  # isolation itself broke: the lines inside the engine fail, not the whole file
            logger.exception("engine step failed and could not be isolated; failing %d in-flight lines", len(inflight))
            self.engine.abort_all()
            failed = {request_id: "internal error during generation" for request_id in inflight}
            outputs = []
        for request_id, message in failed.items():
            request = inflight.get(request_id)
            if request is None:       # a sibling of a line failed already
                continue
            for member in request.members:     # n > 1: the line fails as a whole
                inflight.pop(member.request_id, None)
                self.engine.abort(member.request_id)
            write(answer_record(request.line, request.request_id, error_body(Dialect.OPENAI, message, 500)))
        for out in outputs:
            request = inflight.get(out.request_id)
            body = request.add(out) if request is not None else None
            if body is None:
                continue
            for member in request.members:
                inflight.pop(member.request_id, None)
            write(answer_record(request.line, request.request_id, body))
