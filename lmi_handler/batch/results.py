"""Batch result files: OpenAI batch output records, written and flushed one by one, resumable after a kill.

Owns the record shapes ({id, custom_id, response: {status_code, request_id, body}, error}) and the
files' repair and resume; which lines to run is the runner's / job worker's.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Callable

from lmi_handler.protocol.batch_lines import BatchLine, LineError
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import error_body

logger = logging.getLogger(__name__)

# How record lines are written: a lone surrogate (a custom_id sent as the JSON escape "\\ud800") becomes that
# same escape, so the record stays valid JSON that reads back to the same string (UTF-8 cannot carry it).
RECORD_ERRORS = "backslashreplace"

# Line-level failures are keyed by line number (their custom_id is unknown or not theirs alone).
_LINE_KEYED = {"invalid_json", "missing_custom_id", "duplicate_custom_id"}


def line_key(item: BatchLine | LineError) -> str:
    """The key a line's result is found by when resuming: its custom_id, or `line:N` for a line whose
    custom_id is unreadable or a duplicate (the custom_id then belongs to an earlier line)."""
    if isinstance(item, LineError) and (item.custom_id is None or item.code in _LINE_KEYED):
        return f"line:{item.line}"
    return f"id:{item.custom_id}"


def record_key(record: dict[str, Any]) -> str:
    error = record.get("error") or {}
    if error.get("code") in _LINE_KEYED and error.get("line") is not None:
        return f"line:{error['line']}"
    return f"id:{record.get('custom_id')}"


def _record(custom_id: str | None, response: dict | None, error: dict | None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def success_record(custom_id: str, request_id: str, body: dict[str, Any], status_code: int = 200) -> dict[str, Any]:
    """A line the route answered: `body` is the route's JSON answer (an OpenAI error object when status >= 400)."""
    return _record(custom_id, {"status_code": status_code, "request_id": request_id, "body": body}, None)


def refused_record(custom_id: str | None, request_id: str, message: str, status_code: int,
                   param: str | None) -> dict[str, Any]:
    """A line its route refused: the route's own 4xx answer (an OpenAI error object), as OpenAI's batch output
    carries it. The one place a refused line's record is built (offline, on the server, at checking)."""
    return success_record(custom_id, request_id, error_body(Dialect.OPENAI, message, status_code, param),
                          status_code)


def line_error_record(error: LineError) -> dict[str, Any]:
    """A line that could not run. A refused body parameter carries the route's own 400 answer (as OpenAI's
    batch output does); an unreadable line, bad method/url, stream or duplicate id carries `error` instead."""
    if error.status_code is not None:
        return refused_record(error.custom_id, f"line-{error.line}", error.message, error.status_code, error.param)
    return _record(error.custom_id, None, {"code": error.code, "message": error.message, "param": error.param,
                                           "line": error.line})


def is_success(record: dict[str, Any]) -> bool:
    response = record.get("response")
    return record.get("error") is None and response is not None and response.get("status_code") == 200


def output_tokens(record: dict[str, Any]) -> int:
    """Completion tokens of a successful record (its body's usage); 0 for a failed one."""
    usage = record["response"]["body"].get("usage") if is_success(record) else None
    return (usage or {}).get("completion_tokens", 0)


class ResultFiles:
    """The output file (successes) and error file (failures; the output file when None), append-only.

    On open, a torn last line (a kill in the middle of a write) is cut off, and the keys of the
    records already there are read: `done`. Each write is one line, flushed at once, so a
    SIGKILL loses at most the record being written, which the next run redoes.
    """

    def __init__(self, output_path: Path, errors_path: Path | None = None):
        self.paths = [Path(output_path)] + ([Path(errors_path)] if errors_path else [])
        self.done: set[str] = set()
        self.failure: OSError | None = None
        self.num_completed = 0
        self.num_failed = 0
        for path in dict.fromkeys(self.paths):
            for record in _read_repaired(path):
                self._count(record)
        self.files = [open(path, "a", encoding="utf-8", errors=RECORD_ERRORS) for path in self.paths]

    def _count(self, record: dict[str, Any]) -> None:
        self.done.add(record_key(record))
        if is_success(record):
            self.num_completed += 1
        else:
            self.num_failed += 1

    def write(self, record: dict[str, Any], check_room: Callable[[int], None] | None = None) -> None:
        """Append one record to the output (success) or error file, flushed to the OS before returning.
        `check_room(num_bytes)` (store.BatchStore.check_room: the quota) is asked first, with the bytes the
        record's line takes. Raises OSError when the file cannot take it (ENOSPC: a full disk) or check_room
        does (QuotaExceeded); nothing is counted then."""
        if self.failure is not None:       # a file failed before: nothing more is written to either
            raise self.failure
        line = record_line(record)
        if check_room is not None:
            check_room(len(line.encode("utf-8", RECORD_ERRORS)))
        file = self.files[0] if is_success(record) or len(self.files) == 1 else self.files[1]
        try:
            file.write(line)
            file.flush()
        except OSError as exc:
            self.failure = exc
            _drop_buffer(file)
            raise
        self._count(record)

    def close(self) -> None:
        for file in self.files:
            file.close()

    def __enter__(self) -> "ResultFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def record_line(record: dict[str, Any]) -> str:
    """A record as its line in a result file (or a shard's record file: shards.py), written with
    errors=RECORD_ERRORS."""
    return json.dumps(record, ensure_ascii=False) + "\n"


def _drop_buffer(file) -> None:
    """After a failed write: forget what the text file still buffers, so closing it raises nothing more and
    no half record reaches the disk later (the torn-line repair cuts whatever part of it did)."""
    try:
        file.close()
    except OSError:
        pass


def _read_repaired(path: Path) -> list[dict[str, Any]]:
    """The records of a result file; a last line without its newline (torn by a kill) is cut off the file."""
    if not path.is_file():         # nothing yet (or not a regular file, e.g. a device: nothing to resume)
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path, len(data) - end)
        with open(path, "r+b") as file:
            file.truncate(end)
            os.fsync(file.fileno())
    records = []
    for number, line in enumerate(data[:end].decode("utf-8", errors="replace").splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except ValueError:
            logger.warning("%s: line %d is not a record; ignored", path, number)
    return records
