"""Another revision's C++ kernels, built as an extension of their own: the old side of `ab.py batch1`, `linears` and
`attention` (the new side is this checkout's cpu_kernels()).
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from workload import REPO

from lmi_handler.engine.model.kernels import build

KERNELS = "lmi_handler/engine/model/kernels"


def old_kernels(rev: str):
    """Revision `rev`'s kernel sources (.cpp, .h) built as an extension of their own."""
    out = Path(tempfile.mkdtemp(prefix="ab-kernels-"))
    names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:{KERNELS}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".cpp", ".h")):
            (out / name).write_bytes(subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{KERNELS}/{name}"],
                                                    check=True, capture_output=True).stdout)
    source = out / "cpu_kernels.cpp"
    return build.build_extension(source, build._module_name(source))
