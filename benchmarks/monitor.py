"""Process-tree memory and machine-load sampling for the benchmark phases (psutil).

Owns "how much memory did the engine use" (peak RSS of a process and all its children, summed,
sampled) and "how busy was the rest of the machine" (CPU of processes outside the benchmark).
"""
from __future__ import annotations

import os
import threading
import time

import psutil


def tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and all its descendants (those gone meanwhile are left out)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss_bytes(pid: int) -> int:
    total = 0
    for proc in tree(pid):
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _cpu_seconds_by_pid() -> dict[int, float]:
    out = {}
    for proc in psutil.process_iter(["cpu_times"]):
        times = proc.info["cpu_times"]
        if times is not None:
            out[proc.pid] = times.user + times.system
    return out


def machine_snapshot(sample_s: float = 1.0) -> dict:
    """Load average and the CPU other processes use now (cores busy, over `sample_s` seconds).

    "Other" is every process except this one and its descendants.
    """
    ours = {p.pid for p in tree(os.getpid())}
    before = _cpu_seconds_by_pid()
    time.sleep(sample_s)
    after = _cpu_seconds_by_pid()
    others = {pid: after[pid] - before.get(pid, 0.0) for pid in after if pid not in ours}
    busiest = sorted(others.items(), key=lambda kv: -kv[1])[:3]
    names = {}
    for pid, _ in busiest:
        try:
            names[pid] = psutil.Process(pid).name()
        except psutil.NoSuchProcess:
            names[pid] = "?"
    return {"loadavg_1_5_15": list(os.getloadavg()), "other_cpu_cores_busy": sum(others.values()) / sample_s,
            "busiest_others": [{"pid": pid, "name": names[pid], "cpu_cores": cpu / sample_s} for pid, cpu in busiest]}


class PhaseMonitor:
    """Samples one phase in a thread: peak summed RSS of the tree under `pid`, and other processes' CPU.

    `pid` None watches this process's own tree (an engine run in-process). `interval_s` is the sampling
    period, so a peak shorter than that can be missed. Use as a context manager; read `result()` after.
    """

    def __init__(self, pid: int | None = None, interval_s: float = 0.2):
        self.pid = pid or os.getpid()
        self.interval_s = interval_s
        self.peak_rss_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start_cpu: dict[int, float] = {}
        self._start_time = 0.0
        self._end: dict = {}

    def watch(self, pid: int) -> None:
        """Switch to another root process (e.g. a server started after the monitor)."""
        self.pid = pid

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_rss_bytes = max(self.peak_rss_bytes, tree_rss_bytes(self.pid))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PhaseMonitor":
        self._start_time = time.monotonic()
        self._start_cpu = _cpu_seconds_by_pid()
        self._load_before = list(os.getloadavg())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        wall = time.monotonic() - self._start_time
        ours = {p.pid for p in tree(os.getpid())} | {p.pid for p in tree(self.pid)}
        end_cpu = _cpu_seconds_by_pid()
        other = sum(end_cpu[pid] - self._start_cpu.get(pid, 0.0) for pid in end_cpu if pid not in ours)
        self._end = {"wall_s": wall, "loadavg_before": self._load_before, "loadavg_after": list(os.getloadavg()),
                     "other_cpu_cores_busy": other / wall if wall else 0.0}

    def result(self) -> dict:
        return {"peak_rss_mib": self.peak_rss_bytes / 2**20, "rss_sample_interval_s": self.interval_s, **self._end}
