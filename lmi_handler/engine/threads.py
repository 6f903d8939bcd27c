"""How many CPU threads the engine computes with: option.num_threads=auto sizes them to the CPU actually there (the
affinity mask, the cgroup's cpu.max quota) and adapts them at run time when they are not getting their cores.

Owns the count and its changes (torch's threads and the C++ kernels' pool, kernels/pool.h); leaves how the work is
split over them to the kernels. An explicit option.num_threads stays fixed.
"""
from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def affinity_cores() -> int:
    """CPU cores this process may run on (its affinity mask); every core where the OS has no masks."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores (quota / period), the smallest along its path up to the root;
    None when there is none (`max`) or no cgroup file can be read. cgroup v2 (`cpu.max`: "QUOTA PERIOD" or
    "max PERIOD") and v1 (`cpu.cfs_quota_us`, -1 for none, and `cpu.cfs_period_us`)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "" and hierarchy == "0":                  # v2's one hierarchy
            for directory in _up_to(root, path):
                quotas.append(_v2_quota(directory / "cpu.max"))
        elif "cpu" in controllers.split(","):                       # v1's cpu controller
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
            for directory in _up_to(base, path):
                quotas.append(_v1_quota(directory))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _up_to(root: Path, path: str) -> list[Path]:
    """`root`/`path` and each of its parents up to `root` itself."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(file: Path) -> float | None:
    try:
        quota, period = file.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def auto_threads(cores: int | None = None, quota: float | None = None) -> int:
    """option.num_threads=auto's starting count: the cores of the affinity mask, no more than the cgroup quota's
    whole cores (a quota of 1.5 cores gives 1: a second thread would be throttled every period), at least 1.
    `cores` / `quota` default to this process's (affinity_cores, cgroup_cpu_quota)."""
    cores = affinity_cores() if cores is None else cores
    quota = cgroup_cpu_quota() if quota is None else quota
    limit = cores if quota is None else min(cores, math.floor(quota))
    return max(1, limit)


def run_queue_wait() -> tuple[int, int]:
    """(ns run, ns waited for a core while runnable) summed over this process's threads (/proc/self/task/*/schedstat);
    (0, 0) where the OS does not say."""
    run = wait = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0, 0
    for tid in tasks:
        try:
            fields = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
        except OSError:
            continue
        run, wait = run + int(fields[0]), wait + int(fields[1])
    return run, wait


WAIT_SHARE_HIGH = 0.25    # more of the threads' runnable time than this waiting for a core: one thread fewer
PROBE_GAIN = 1.08         # a probe of one thread more is kept when it computes this much faster


@dataclass
class ThreadTuner:
    """option.num_threads=auto's run-time adaptation, fed one measured window at a time (observe): when the engine's
    threads wait for a core more than WAIT_SHARE_HIGH of their runnable time, one thread fewer (down to 1); below
    `max_threads`, every `probe_s` seconds one thread more for a window, kept when its tokens a second of forward
    time beat the window before by PROBE_GAIN, else given back and the next probe twice as far off (up to
    `max_probe_s`). Pure (no clock, no files): the Engine's ThreadControl feeds it."""
    max_threads: int
    threads: int
    probe_s: float = 20.0
    max_probe_s: float = 320.0
    probe_gap_s: float = field(init=False)
    since_change_s: float = field(init=False, default=0.0)
    probing_from: tuple[int, float] | None = field(init=False, default=None)   # (threads, rate) before a probe

    def __post_init__(self):
        self.probe_gap_s = self.probe_s

    def observe(self, window_s: float, rate: float, wait_share: float) -> int | None:
        """One window of `window_s` seconds: forward tokens a second `rate` and the run-queue wait share. Returns the
        new thread count when it changes, else None."""
        self.since_change_s += window_s
        if self.probing_from is not None:
            before, before_rate = self.probing_from
            self.probing_from = None
            if rate >= before_rate * PROBE_GAIN and wait_share <= WAIT_SHARE_HIGH:
                self.probe_gap_s = self.probe_s
                return self._set(self.threads)
            self.probe_gap_s = min(self.max_probe_s, 2 * self.probe_gap_s)
            return self._set(before)
        if wait_share > WAIT_SHARE_HIGH and self.threads > 1:
            return self._set(self.threads - 1)
        if self.threads < self.max_threads and self.since_change_s >= self.probe_gap_s:
            self.probing_from = (self.threads, rate)
            return self._set(self.threads + 1)
        return None

    def _set(self, threads: int) -> int | None:
        self.since_change_s = 0.0
        if threads == self.threads:
            return None
        self.threads = threads
        return threads


def apply_threads(threads: int) -> None:
    """Compute with `threads` threads from now on: torch's (this thread's) and the C++ kernels' pool."""
    from lmi_handler.engine.model.kernels import built_kernels

    torch.set_num_threads(threads)
    module = built_kernels()
    if module is not None:
        module.set_threads(threads)


class ThreadControl:
    """The engine's threads: a fixed count (option.num_threads > 0), or auto (0): auto_threads() at start, then a
    ThreadTuner fed every WINDOW_S seconds of forward time (measure() around each forward). Changes are logged."""

    WINDOW_S = 2.0

    def __init__(self, num_threads: int):
        self.tuner: ThreadTuner | None = None
        if num_threads > 0:
            apply_threads(num_threads)
            return
        cores, quota = affinity_cores(), cgroup_cpu_quota()
        start = auto_threads(cores, quota)
        log.info("num_threads=auto: %d threads (affinity %d cores, cgroup quota %s)", start, cores,
                 "none" if quota is None else f"{quota:g} cores")
        apply_threads(start)
        self.tuner = ThreadTuner(max_threads=start, threads=start)
        self._window_s, self._tokens = 0.0, 0
        self._sched = run_queue_wait()

    @contextmanager
    def measure(self, num_tokens: int):
        """Time one forward of `num_tokens` tokens (a no-op under a fixed count)."""
        if self.tuner is None:
            yield
            return
        start = time.perf_counter()
        yield
        self._window_s += time.perf_counter() - start
        self._tokens += num_tokens
        if self._window_s >= self.WINDOW_S:
            self._close_window()

    def _close_window(self) -> None:
        run, wait = run_queue_wait()
        d_run, d_wait = run - self._sched[0], wait - self._sched[1]
        share = d_wait / (d_run + d_wait) if d_run + d_wait > 0 else 0.0
        before = self.tuner.threads
        changed = self.tuner.observe(self._window_s, self._tokens / self._window_s, share)
        if changed is not None:
            log.info("num_threads=auto: %d -> %d threads (run-queue wait %.0f%% of runnable time, %.1f tok/s)", before,
                     changed, 100 * share, self._tokens / self._window_s)
            apply_threads(changed)
        self._window_s, self._tokens, self._sched = 0.0, 0, run_queue_wait()
