"""Shared by the benchmark tests: the repository, an environment that imports it, and running a script."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_benchmark(script: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """`python benchmarks/<script> ARGS` from the repository root; asserts it exits 0 (its output's tail if not)."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc
