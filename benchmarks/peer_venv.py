"""A benchmark peer's own venv (vLLM's, llama.cpp's), set up in named steps that each leave a marker.

Owns the idempotent step runner and the log; which steps a peer needs is its module's (vllm_peer.py,
llamacpp_peer.py). A step whose marker `<venv>/.step-<name>` exists is skipped, so a set-up can be rerun
after a failure and picks up where it stopped.
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# a step: a command line, or a Python callable given the open log (for steps that decide what to run)
Step = tuple[str, list[str] | Callable]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(venv: Path) -> Path | None:
    """The venv's site-packages directory (None before the venv exists)."""
    found = sorted(venv.glob("lib/python*/site-packages"))
    return found[0] if found else None


def run_steps(venv: Path, steps: list[Step], timeout_s: float = 3600) -> Path:
    """Create `venv` (the interpreter running this module) and run `steps` in order, each once; log to
    <venv>/setup.log. Returns the venv's python. Raises CalledProcessError / TimeoutExpired on a failing
    command (its marker is not written, so a rerun tries it again)."""
    venv.mkdir(parents=True, exist_ok=True)
    py = venv_python(venv)
    with open(venv / "setup.log", "a") as log:
        for name, step in [("venv", [sys.executable, "-m", "venv", str(venv)]), *steps]:
            marker = venv / f".step-{name}"
            if marker.exists() or (name == "venv" and py.exists()):
                marker.touch()
                continue
            start = time.monotonic()
            if callable(step):
                step(log)
            else:
                log.write(f"\n$ {' '.join(step)}\n")
                log.flush()
                subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=timeout_s)
            log.write(f"[step {name} done in {time.monotonic() - start:.0f} s]\n")
            log.flush()
            marker.touch()
    return py


def is_ready(venv: Path, last_step: str) -> bool:
    """True when the set-up got through its last step (`last_step`'s marker exists)."""
    return (venv / f".step-{last_step}").exists()
