"""benchmarks/interference.py: --busy-cores' spinning processes run while the block runs and are gone after it, also
when it raises."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from interference import busy_cores  # noqa: E402


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_n_spinning_processes_run_inside_the_block_and_are_stopped_after_it_even_on_an_error():
    with pytest.raises(RuntimeError), busy_cores(2, settle_s=0.0) as pids:
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        raise RuntimeError("a phase failed")
    assert not any(_alive(p) for p in pids)
    with busy_cores(0) as none:
        assert none == []
