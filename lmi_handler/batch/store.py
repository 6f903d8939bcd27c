"""The /v1/files and /v1/batches store: SQLite rows + files on disk under option.batch_dir, and their OpenAI shapes.

Owns ids, rows, timestamps and the File / Batch objects (DESIGN §4) so a restart loses nothing;
running jobs is jobs.py's, HTTP routes.py's.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO

WINDOW_S = {"24h": 24 * 3600}   # OpenAI: "24h" is the only completion window
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
    filename TEXT NOT NULL, purpose TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, output_file_id TEXT, error_file_id TEXT,
    errors TEXT, total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, metadata TEXT, defaults TEXT NOT NULL,
    created_at INTEGER NOT NULL, in_progress_at INTEGER, expires_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER);
"""


# Ids are uuid4 (122 random bits): unguessable, so knowing one id tells nothing of another. Anything else is
# no id of ours and is answered 404 before SQLite sees it (a lone surrogate could not even be encoded there).
FILE_ID = re.compile(r"file-[0-9a-f]{32}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")


class QuotaExceeded(OSError):
    """Writing would take batch_dir past option.batch_max_total_bytes (errno EDQUOT, as a disk quota would)."""

    def __init__(self, needed: int, used: int, limit: int):
        super().__init__(errno.EDQUOT, f"batch_dir would hold {used + needed} bytes, past option.batch_max_total_bytes "
                         f"= {limit} ({used} in use, {needed} more asked)")
        self.limit = limit


def now_s() -> int:
    """Unix seconds (the Batch API's timestamps are integers)."""
    return int(time.time())


class BatchStore:
    """One directory: `state.sqlite3`, `files/<file id>` (uploads and results) and `work/<batch id>/`
    (results being written while a job runs). Used from the server's event loop thread only."""

    def __init__(self, root: Path, max_total_bytes: int | None = None):
        self.root = Path(root)
        self.max_total_bytes = max_total_bytes     # option.batch_max_total_bytes; None = no quota
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        (self.root / "work").mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.root / "state.sqlite3", isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.executescript(_SCHEMA)
        self._lock_file = None

    def try_lock(self) -> bool:
        """Take the directory's worker lock (one job runner per batch_dir, whatever shares it); True if held."""
        if self._lock_file is None:
            file = open(self.root / "worker.lock", "a")
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                file.close()
                return False
            self._lock_file = file
        return True

    # ---- the quota -----------------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Bytes of every file under the root (uploads, results, work in progress, the SQLite state)."""
        total = 0
        for folder, _, names in os.walk(self.root):
            for name in names:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except FileNotFoundError:      # deleted meanwhile
                    pass
        return total

    def check_room(self, needed: int) -> None:
        """Raise QuotaExceeded if `needed` more bytes would take the root past its quota."""
        if self.max_total_bytes is not None:
            used = self.used_bytes()
            if used + needed > self.max_total_bytes:
                raise QuotaExceeded(needed, used, self.max_total_bytes)

    # ---- files ---------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def add_file(self, filename: str, purpose: str, source: BinaryIO | Path) -> dict[str, Any]:
        """Store an upload (a binary stream) or a finished result file (a Path, moved in); its File object."""
        file_id = f"file-{uuid.uuid4().hex}"
        path = self.file_path(file_id)
        if isinstance(source, Path):
            shutil.move(str(source), path)
        else:
            with open(path, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
        self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)",
                        (file_id, path.stat().st_size, now_s(), filename, purpose))
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        if not FILE_ID.fullmatch(file_id):
            return None
        row = self.db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else file_object(row)

    def list_files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT * FROM files WHERE ? IS NULL OR purpose = ? ORDER BY rowid DESC",
                               (purpose, purpose)).fetchall()
        return [file_object(row) for row in rows]

    def delete_file(self, file_id: str) -> bool:
        if not FILE_ID.fullmatch(file_id):
            return False
        if self.db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 0:
            return False
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    # ---- batches -------------------------------------------------------------------------------

    def work_dir(self, batch_id: str) -> Path:
        path = self.root / "work" / batch_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def add_batch(self, endpoint: str, input_file_id: str, completion_window: str,
                  metadata: dict[str, str] | None, defaults: dict[str, Any]) -> dict[str, Any]:
        batch_id = f"batch_{uuid.uuid4().hex}"
        created = now_s()
        self.db.execute(
            "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, defaults, "
            "created_at, expires_at) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?, ?)",
            (batch_id, endpoint, input_file_id, completion_window, json.dumps(metadata) if metadata else None,
             json.dumps(defaults), created, created + WINDOW_S[completion_window]))
        return self.get_batch(batch_id)

    def row(self, batch_id: str) -> sqlite3.Row | None:
        if not BATCH_ID.fullmatch(batch_id):
            return None
        return self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        row = self.row(batch_id)
        return None if row is None else batch_object(row)

    def list_batches(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, starting after the batch `after` (a cursor); (page, has_more)."""
        cursor = self.db.execute("SELECT rowid FROM batches WHERE id = ?", (after,)).fetchone() \
            if after and BATCH_ID.fullmatch(after) else None
        start = cursor[0] if cursor is not None else 1 << 62
        rows = self.db.execute("SELECT * FROM batches WHERE rowid < ? ORDER BY rowid DESC LIMIT ?",
                               (start, limit + 1)).fetchall()
        return [batch_object(row) for row in rows[:limit]], len(rows) > limit

    def update(self, batch_id: str, **fields: Any) -> None:
        """Set columns of a batch; `status=...` also stamps its `<status>_at` when the status has one."""
        status = fields.get("status")
        if status and f"{status}_at" in TIMESTAMPS:
            fields.setdefault(f"{status}_at", now_s())
        if "errors" in fields and fields["errors"] is not None:
            fields["errors"] = json.dumps(fields["errors"])
        names = ", ".join(f"{name} = ?" for name in fields)
        self.db.execute(f"UPDATE batches SET {names} WHERE id = ?", (*fields.values(), batch_id))

    def next_active(self) -> sqlite3.Row | None:
        """The oldest batch still to be worked on (validating, in_progress, finalizing or cancelling)."""
        marks = ", ".join("?" for _ in ACTIVE)
        return self.db.execute(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY rowid LIMIT 1",
                               ACTIVE).fetchone()


def file_object(row: sqlite3.Row) -> dict[str, Any]:
    """OpenAI File: {id, object: "file", bytes, created_at, filename, purpose} (+ status "processed")."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None, "expires_at": None}


def batch_object(row: sqlite3.Row) -> dict[str, Any]:
    """OpenAI Batch (DESIGN §4): ids, status, errors, request_counts, metadata and every *_at (null until reached)."""
    errors = json.loads(row["errors"]) if row["errors"] else None
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"], "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"], "status": row["status"],
            "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            "errors": None if errors is None else {"object": "list", "data": errors},
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
            **{name: row[name] for name in TIMESTAMPS}}
