"""Paths and loaders shared by every test package (imported by tests; conftest only holds fixtures)."""
from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "model"
# ../shared beside the checkout; LMI_SHARED_DIR points elsewhere (e.g. from a git worktree)
SHARED = Path(os.environ.get("LMI_SHARED_DIR") or REPO.parent / "shared")


def load_case(case_id: str) -> dict:
    """A request case from ../shared/cases (real bug reports against similar servers)."""
    return json.loads((SHARED / "cases" / f"{case_id}.json").read_text())
