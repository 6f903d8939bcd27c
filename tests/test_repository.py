"""Rules over the whole repository rather than one module: it stands alone (what the tests and the benchmark
read is inside it, and the copies still match their originals), packages point one way, and tests/ is laid
out as README's "Tests and benchmarks" says."""
from __future__ import annotations

import pytest

from tests.helpers import CASES_DIR, MT_BENCH, REPO, SHARED

# repository copy -> where it comes from, under ../shared
COPIES = {CASES_DIR: SHARED / "cases", MT_BENCH.parent: SHARED / "data"}


def test_the_request_cases_and_the_benchmark_prompts_are_inside_the_repository():
    assert {p.name for p in CASES_DIR.glob("C*.json")} >= {"C01.json", "C09.json", "C31.json"}
    assert (CASES_DIR / "README.md").is_file()
    assert MT_BENCH.is_file() and len(MT_BENCH.read_text().splitlines()) == 80
    assert "Apache License" in (MT_BENCH.parent / "LICENSE").read_text()   # the MT-bench questions' licence
    assert "Apache License 2.0" in (MT_BENCH.parent / "README.md").read_text()


@pytest.mark.parametrize("copy", sorted(COPIES), ids=lambda p: str(p.relative_to(REPO)))
def test_the_copies_match_shared_when_it_is_beside_the_checkout(copy):
    original = COPIES[copy]
    if not original.is_dir():
        pytest.skip(f"{original} is not here (a clone alone): nothing to compare the copies with")
    for source in sorted(p for p in original.iterdir() if p.is_file()):
        mirrored = copy / source.name
        assert mirrored.is_file(), f"{source.name} of {original} has no copy in {copy}"
        assert mirrored.read_bytes() == source.read_bytes(), f"{mirrored} differs from {source}: copy it again"
