"""Other work on the benchmark's CPU, started and stopped by the harness: `--busy-cores N` runs N processes that
only spin (`python -c 'while True: pass'`, one core each) while the busy phases run, as a neighbour, a log shipper
or the container's own front end would take cores from the engine.

Owns starting the spinners and stopping them whatever happens; which phases run beside them is bench.py's.
"""
from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager

SPIN = "while True: pass"


@contextmanager
def busy_cores(num: int, settle_s: float = 0.5):
    """N spinning processes for the block's duration (none when num is 0), each stopped (killed and reaped) at its
    end, also on an error or Ctrl-C. Yields their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL) for _ in range(max(0, num))]
    try:
        if procs:
            time.sleep(settle_s)
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
