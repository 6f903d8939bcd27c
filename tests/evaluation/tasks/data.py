"""The shipped tasks' data: each JSONL file beside this one as a `datasets.Dataset`, no download (the harness's
`custom_dataset`; its YAML names these functions with `!function data.<name>`)."""
from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _split(name: str) -> dict[str, datasets.Dataset]:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def multiple_choice(**kwargs) -> dict[str, datasets.Dataset]:
    """20 everyday questions with 4 choices each (the harness passes the task's metadata as kwargs)."""
    return _split("multiple_choice.jsonl")


def capitals(**kwargs) -> dict[str, datasets.Dataset]:
    """20 countries and their capitals."""
    return _split("capitals.jsonl")
