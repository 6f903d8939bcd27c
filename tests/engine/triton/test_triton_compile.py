"""Every Triton kernel compiles for an H100/H200 (sm_90) without a GPU: the interpreter runs what the compiler may
refuse (a type, a loop-carried value, a 3-D block), so the compiler itself checks the GPU path here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmi_handler.engine.model.backends import triton as tb

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)")
def test_every_kernel_compiles_for_sm_90_through_ptxas():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}    # interpreted kernels do not compile
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "tests.engine.triton.compile_check", "90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from tests.engine.triton.compile_check import cases
    compiled = proc.stdout.splitlines()
    assert len(compiled) == 2 * len(list(cases("bf16"))) and all(line.startswith("sm_90 ") for line in compiled), proc.stdout
