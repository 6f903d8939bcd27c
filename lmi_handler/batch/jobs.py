"""The /v1/batches job worker: runs stored jobs one at a time through the server's own front end, live traffic first.

Owns a job's life (validating -> in_progress -> finalizing -> completed, failed, expired, cancelling ->
cancelled) and how many of its lines share the engine; rows are store.py's, which lines run and their
records lines.py's (shared with the offline runner), line rules batch_lines.py's.

Each line goes through the front end's queue as an internal request on its route (so it is admitted
by handle() like a live request and answered with the very object the route sends). Live requests
come first: a job keeps at most `max_batch_size - reserve` lines in flight (reserve = a quarter of
the batch, at least 1) and adds one only while the front end has room for it (FrontEnd.has_room: no
live request waits, and the active batch has room past the reserve), so an arriving request finds a
free place at the next step.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmi_handler.batch.lines import Record, answer_record, lines_to_run, plan_line, refusal
from lmi_handler.batch.results import ResultFiles
from lmi_handler.batch.store import BatchStore, now_s
from lmi_handler.frontend.loops import FrontEnd
from lmi_handler.frontend.requests import ENGINE_DEAD_CODE, ClientRequest
from lmi_handler.protocol.batch_lines import BatchDefaults, BatchLine, check_lines, read_batch
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import RequestValidationError, error_body, safe_text
from lmi_handler.service import Service

logger = logging.getLogger(__name__)

POLL_S = 0.05          # how often a waiting job looks for room in the batch
IDLE_S = 1.0           # how often an idle worker looks for expired jobs


class JobStopped(Exception):
    """The job was cancelled, expired or failed while it ran."""


class BatchJobs:
    """The store plus one asyncio task (on the server's event loop) that works through the active jobs."""

    def __init__(self, store: BatchStore, front_end: FrontEnd):
        self.store = store
        self.front_end = front_end
        self.service: Service | None = None               # the loaded model's (start)
        size = front_end.max_batch_size
        self.reserve = max(1, size // 4)
        self.max_in_flight = max(1, size - self.reserve)
        self.inflight: dict[str, ClientRequest] = {}     # this job's lines holding a place, by request id
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.prepare_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prepare")

    async def start(self, service: Service) -> None:
        """Start working through the jobs on `service`'s model (once it is loaded)."""
        self.service = service
        self.task = asyncio.create_task(self._run(), name="batch-jobs")

    async def stop(self) -> None:
        """Stop at once: lines in flight are dropped and redone on the next start (their jobs stay in_progress)."""
        for client in self.inflight.values():
            client.cancelled = True
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)

    def wake(self) -> None:
        self.wakeup.set()

    async def _run(self) -> None:
        while True:
            # servers sharing a batch_dir: only the lock holder runs jobs (the others still take uploads
            # and create jobs; the holder finds them within IDLE_S)
            row = self.store.next_active() if self.store.try_lock() else None
            if row is None:
                self.wakeup.clear()
                try:
                    await asyncio.wait_for(self.wakeup.wait(), IDLE_S)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                await self._work(row["id"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not stop every later job: this one fails
                logger.exception("batch %s failed", row["id"])
                self._fail(row["id"], "internal_error", str(exc))

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        """Mark the job failed with one error. If even that cannot be written (the disk is full for SQLite
        too), the job stays as it was and is redone at the next start; the worker goes on either way."""
        try:
            self.store.update(batch_id, status="failed", errors=[_file_error(code, message, None)])
        except Exception:  # the state stays consistent: SQLite rolls the update back
            logger.exception("batch %s: could not record its failure (%s); it resumes at the next start",
                             batch_id, message)

    # ---- one job -------------------------------------------------------------------------------

    async def _work(self, batch_id: str) -> None:
        row = self.store.row(batch_id)
        defaults = BatchDefaults.parse(json.loads(row["defaults"]))
        if row["status"] == "validating" and not await self._validate(row, defaults):
            return
        if self.store.row(batch_id)["status"] == "in_progress":
            try:
                await self._process(batch_id, defaults)
            except JobStopped:
                pass
            except OSError as exc:      # the result files could not be opened (a full disk, the quota)
                self._fail_storage(batch_id, exc)
        self._finish(batch_id)

    async def _validate(self, row, defaults: BatchDefaults) -> bool:
        """validating -> in_progress, or failed with `errors` when the file itself is unusable."""
        path = self.store.file_path(row["input_file_id"])
        if not path.is_file():
            self.store.update(row["id"], status="failed", errors=[_file_error(
                "missing_file", f"input file {row['input_file_id']} no longer exists", "input_file_id")])
            return False
        plan = await asyncio.get_running_loop().run_in_executor(
            self.prepare_pool, _read_plan, path, defaults, row["endpoint"])
        errors = [_file_error("missing_max_tokens", f"line {b.line} ({b.custom_id}) has no output length: give "
                              "it max_completion_tokens or max_tokens, or create the batch with "
                              "max_decoding_length", "body.max_completion_tokens", b.line)
                  for b in plan.missing_length]
        if plan.total == 0:
            errors.append(_file_error("empty_file", "the input file holds no requests", "input_file_id"))
        if errors:
            self.store.update(row["id"], status="failed", errors=errors, total=plan.total)
            return False
        if self.store.row(row["id"])["status"] == "validating":   # not cancelled meanwhile
            defaults.log_once()
            self.store.update(row["id"], status="in_progress", total=plan.total)
        return True

    async def _process(self, batch_id: str, defaults: BatchDefaults) -> None:
        """Run every line that has no result yet; results are appended (and flushed) as they finish."""
        work = self.store.work_dir(batch_id)
        with ResultFiles(work / "output.jsonl", work / "errors.jsonl") as results, \
                open(self.store.file_path(self.store.row(batch_id)["input_file_id"]), encoding="utf-8",
                     errors="replace") as lines:
            self._count(batch_id, results)
            tasks: set[asyncio.Task] = set()

            def write(record: Record) -> None:
                self._write(batch_id, results, record)

            try:
                items = check_lines(lines, defaults, self.store.row(batch_id)["endpoint"])
                for line in lines_to_run(items, results.done, write):
                    await self._wait_for_room(batch_id)
                    # the place is taken now, before the task runs, so the next _has_room counts it
                    client = ClientRequest(json.dumps(line.body).encode(), asyncio.get_running_loop(),
                                           route=line.url, internal=True)
                    self.inflight[client.request_id] = client
                    task = asyncio.create_task(self._run_line(batch_id, line, client, results))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.wait(set(tasks), timeout=IDLE_S)
                    self._check_stopped(batch_id)
            finally:
                for client in self.inflight.values():
                    client.cancelled = True
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)

    async def _wait_for_room(self, batch_id: str) -> None:
        while not self._has_room():
            self._check_stopped(batch_id)
            await asyncio.sleep(POLL_S)
        self._check_stopped(batch_id)

    def _has_room(self) -> bool:
        """Live first: the job under its cap, and the front end has room past the reserve (FrontEnd.has_room)."""
        return len(self.inflight) < self.max_in_flight and self.front_end.has_room(self.reserve)

    def _check_stopped(self, batch_id: str) -> None:
        row = self.store.row(batch_id)
        if row["status"] in ("cancelling", "failed"):
            raise JobStopped
        if row["expires_at"] is not None and now_s() >= row["expires_at"]:
            self.store.update(batch_id, status="expired")
            raise JobStopped

    async def _run_line(self, batch_id: str, line: BatchLine, client: ClientRequest, results: ResultFiles) -> None:
        request_id = client.request_id
        try:
            record = await self._answer(line, client)
        except Exception as exc:  # a bug must cost this line only, and still give it a record
            logger.exception("batch %s line %d failed", batch_id, line.line)
            record = answer_record(line, request_id, error_body(Dialect.OPENAI, f"internal error: {exc}", 500))
        finally:
            self.inflight.pop(request_id, None)
        if record is not None:
            try:
                self._write(batch_id, results, record)
            except JobStopped:       # the results could not be written: the job has failed, _process stops
                pass

    async def _answer(self, line: BatchLine, client: ClientRequest) -> Record | None:
        """The line's record: its plan first (the same as offline, Kind.BATCH_LINE; a refused line never
        queues, and the handler takes the plan as built), then its answer from the front end; None when
        it was cancelled."""
        try:
            client.plan = await asyncio.get_running_loop().run_in_executor(
                self.prepare_pool, plan_line, self.service, line, client.request_id)
        except RequestValidationError as exc:
            return refusal(line, client.request_id, exc)
        if client.cancelled:
            return None
        while not self.front_end.submit(client):   # the waiting queue is full of live requests: they go first
            if client.cancelled:
                return None
            await asyncio.sleep(POLL_S)
        return await _collect(client, line)

    def _write(self, batch_id: str, results: ResultFiles, record: dict) -> None:
        """Append a record; a storage failure (a full disk: ENOSPC, the quota: EDQUOT) fails the whole job,
        naming the cause, and raises JobStopped. The records already written stay in its work directory."""
        try:
            results.write(record, self.store.check_room)
        except OSError as exc:
            self._fail_storage(batch_id, exc)
            raise JobStopped from exc
        self._count(batch_id, results)

    def _fail_storage(self, batch_id: str, exc: OSError) -> None:
        if self.store.row(batch_id)["status"] == "failed":
            return
        cause = errno.errorcode.get(exc.errno, "") if exc.errno else ""
        logger.error("batch %s failed: its results could not be written: %s", batch_id, exc)
        self._fail(batch_id, "storage_error", f"writing the batch's results failed: {exc.strerror or exc}"
                   + (f" ({cause})" if cause else "") + f" under option.batch_dir {self.store.root}")

    def _count(self, batch_id: str, results: ResultFiles) -> None:
        self.store.update(batch_id, completed=results.num_completed, failed=results.num_failed)

    # ---- the end of a job ----------------------------------------------------------------------

    def _finish(self, batch_id: str) -> None:
        """Results become files (purpose batch_output); then completed, cancelled or expired (failed stays)."""
        row = self.store.row(batch_id)
        if row["status"] == "failed":
            return
        final = {"in_progress": "completed", "finalizing": "completed", "validating": "cancelled",
                 "cancelling": "cancelled"}.get(row["status"], row["status"])
        if row["status"] == "in_progress":
            self.store.update(batch_id, status="finalizing")
        work = self.store.work_dir(batch_id)
        fields: dict[str, Any] = {}
        for column, name in (("output_file_id", "output.jsonl"), ("error_file_id", "errors.jsonl")):
            path = work / name
            if row[column] is None and path.is_file() and path.stat().st_size > 0:
                fields[column] = self.store.add_file(f"{batch_id}_{name}", "batch_output", path)["id"]
        self.store.update(batch_id, **fields, status=final)


def _read_plan(path: Path, defaults: BatchDefaults, endpoint: str):
    with open(path, encoding="utf-8", errors="replace") as lines:
        return read_batch(lines, defaults, endpoint)


def _file_error(code: str, message: str, param: str | None, line: int | None = None) -> dict[str, Any]:
    """An entry of a failed Batch's errors; the message may quote a custom_id (safe_text: always encodable)."""
    return {"code": code, "message": safe_text(message), "param": param, "line": line}


async def _collect(client: ClientRequest, line: BatchLine) -> Record | None:
    """The line's record once its last chunk came: the answer object the handler handed back
    (ClientRequest.answer), or the error its chunk carries; None when it was cancelled before finishing."""
    while True:
        try:
            chunk = await asyncio.wait_for(client.chunks.get(), POLL_S * 10)
        except asyncio.TimeoutError:
            if client.cancelled:   # a cancelled request the front end never admitted gets no answer
                return None
            continue
        if chunk.code == ENGINE_DEAD_CODE:   # not the line's fault: no record, it is redone after the restart
            return None
        if chunk.code is not None:
            body = error_body(Dialect.OPENAI, chunk.error or "inference failed", chunk.code)
            return answer_record(line, client.request_id, body)
        if chunk.last:
            break
    if client.answer is None:
        return None   # cancelled: the handler ended it without an answer
    return answer_record(line, client.request_id, client.answer)
