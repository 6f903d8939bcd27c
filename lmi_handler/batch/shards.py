"""A batch file cut into fixed line ranges (shards) and the finished shards' record files, for cluster.py.

Owns the cut (lines 1..K, K+1..2K, ... of the input file, fixed before any replica starts), each finished
shard's record file (written whole: temp file, fsync, rename) and merging those records into the result files,
each key once. Running a shard is cluster.py's (a Ray replica, through the runner's line loop); the line rules
are protocol/batch_lines.py's.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from lmi_handler.batch.lines import Record
from lmi_handler.batch.results import RECORD_ERRORS, ResultFiles, line_key, record_key, record_line
from lmi_handler.protocol.batch_lines import BatchLine, LineError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """Lines first_line..last_line (1-based, inclusive) of the input file, and those of them still to run.

    `items` are check_lines' outcomes (checked against the whole file: a custom_id used in an earlier shard
    is a duplicate here too), less the lines that already have a result.
    """

    first_line: int
    last_line: int
    items: tuple[BatchLine | LineError, ...]

    @property
    def name(self) -> str:
        """The shard's file name stem: its line range, so a rerun (any --shard-lines) finds it."""
        return f"lines-{self.first_line:09d}-{self.last_line:09d}"

    def __len__(self) -> int:
        return len(self.items)


def cut_shards(items: Iterable[BatchLine | LineError], shard_lines: int, done: set[str]) -> Iterator[Shard]:
    """Group checked lines (in file order) into shards of `shard_lines` input lines each, by line number:
    shard i holds lines i*K+1 .. (i+1)*K. Lines whose key is in `done` are left out; a shard with nothing
    left to run is not yielded (a finished shard is skipped). Raises ValueError for shard_lines < 1."""
    if shard_lines < 1:
        raise ValueError(f"shard_lines must be >= 1, got {shard_lines}")
    index, pending = None, []
    for item in items:
        item_index = (item.line - 1) // shard_lines
        if item_index != index:
            if pending:
                yield _shard(index, shard_lines, pending)
            index, pending = item_index, []
        if line_key(item) not in done:
            pending.append(item)
    if pending:
        yield _shard(index, shard_lines, pending)


def _shard(index: int, shard_lines: int, items: list) -> Shard:
    return Shard(index * shard_lines + 1, (index + 1) * shard_lines, tuple(items))


class ShardFiles:
    """The finished shards' record files of one output file: `<output>.shards/lines-A-B.jsonl`.

    A shard's file appears whole or not at all (written to a temp file, fsynced, renamed), so a driver killed
    at any point leaves only whole shards; `merge_into` copies their records into the result files, skipping
    keys already there, so merging twice (a rerun after a kill mid-merge) writes each key once.
    """

    def __init__(self, output_path: Path):
        output_path = Path(output_path)
        self.root = output_path.with_name(output_path.name + ".shards")

    def paths(self) -> list[Path]:
        return sorted(self.root.glob("lines-*.jsonl")) if self.root.is_dir() else []

    def save(self, shard: Shard, records: list[Record]) -> Path:
        """Write a finished shard's records as one file, atomically. Returns its path."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{shard.name}.jsonl"
        temp = path.with_suffix(f".tmp-{os.getpid()}")
        with open(temp, "w", encoding="utf-8", errors=RECORD_ERRORS) as file:   # as the result files' lines
            file.writelines(record_line(record) for record in records)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
        _fsync_dir(self.root)
        return path

    def merge_into(self, results: ResultFiles) -> int:
        """Append the records of every finished shard whose key has no result yet. Returns how many were
        written."""
        return sum(merge_records(results, map(json.loads, path.read_text(encoding="utf-8").splitlines()))
                   for path in self.paths())

    def clear(self) -> None:
        """Remove the shard files (every record is in the result files), and temp files a killed run left."""
        shutil.rmtree(self.root, ignore_errors=True)


def merge_records(results: ResultFiles, records: Iterable[Record]) -> int:
    """Append the `records` whose key has no result yet (a shard just saved, or read back from its file).
    Returns how many were written."""
    written = 0
    for record in records:
        if record_key(record) not in results.done:
            results.write(record)
            written += 1
    return written


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (POSIX: the directory entry is the directory's data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
