"""Paths and loaders shared by every test package (imported by tests; conftest only holds fixtures)."""
from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "model"
CASES_DIR = REPO / "tests" / "cases"                       # copies of ../shared/cases
MT_BENCH = REPO / "benchmarks" / "data" / "mt_bench_questions.jsonl"   # a copy of ../shared/data's
# The originals the copies come from: ../shared beside the checkout (LMI_SHARED_DIR points elsewhere);
# only tests/test_repository.py reads it, to check that the copies still match.
SHARED = Path(os.environ.get("LMI_SHARED_DIR") or REPO.parent / "shared")


def load_case(case_id: str) -> dict:
    """A request case from tests/cases (real bug reports against similar servers; README there)."""
    return json.loads((CASES_DIR / f"{case_id}.json").read_text())


def mt_bench_questions() -> list[str]:
    """First turns of the MT-Bench questions, in file order."""
    return [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip()]
