"""The batch-jobs part of the settings: where /v1/files and /v1/batches keep their state, and their limits.

Owns option.batch_dir, batch_max_file_bytes and batch_max_total_bytes; the jobs themselves are batch/'s.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field

from lmi_handler.config.base import Options


class BatchOptions(Options):
    """Batch jobs: the OpenAI files and batches APIs' storage."""

    batch_dir: str = "batches"
    """Where /v1/files and /v1/batches keep their SQLite state and files; relative paths start at model_dir
    (the directory of serving.properties)."""
    batch_max_file_bytes: int = Field(200 << 20, ge=1)
    """Largest /v1/files upload in bytes (OpenAI's batch input limit, 200 MB); larger answers 413."""
    batch_max_total_bytes: int | None = Field(None, ge=1)
    """Quota in bytes for everything under batch_dir (uploads, result files, the SQLite state); an upload
    that would pass it answers 413 naming the limit, a job whose results would pass it fails naming it.
    Unset: no quota (the disk's own size is the limit)."""

    @property
    def batch_path(self) -> Path:
        path = Path(self.batch_dir)
        return path if path.is_absolute() else Path(self.model_dir) / path
