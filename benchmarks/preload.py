"""LD_PRELOAD for vLLM's CPU build as its docs ask: TCMalloc and the vLLM venv's Intel OpenMP (libiomp5).

Owns finding the two libraries, checking that the dynamic loader takes them and that they end up mapped,
and the record of what was preloaded or why not. vLLM's CPU install guide ("set LD_PRELOAD": install
libtcmalloc-minimal4, find libtcmalloc_minimal.so.4 and libiomp5.so, export
LD_PRELOAD="$TC_PATH:$IOMP_PATH:$LD_PRELOAD"; docs/getting_started/installation/cpu.x86.inc.md).
Plain Python: the orchestrator and the vLLM worker both import it.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

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


def plan(venv: Path, tcmalloc_dirs: tuple[Path, ...] | list[Path] = SYSTEM_LIB_DIRS) -> dict:
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


def check(python: Path, record: dict, timeout_s: float = 120) -> dict:
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
