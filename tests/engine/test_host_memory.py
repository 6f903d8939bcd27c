"""engine/host_memory.py: after keep_freed_memory, step-sized buffers come from the heap, not new mmaps."""
from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys, torch
from lmi_handler.engine.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
buffer = torch.empty(8 << 20, dtype=torch.uint8)      # 8 MiB: a decode step's logits are 12.6 MB
print(libc.mallinfo2().hblkhd - before)
"""


def _mmapped_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_a_step_sized_buffer_is_a_fresh_mmap_by_default_and_heap_memory_once_tuned():
    assert _mmapped_bytes("default") >= 8 << 20
    assert _mmapped_bytes("tuned") == 0
