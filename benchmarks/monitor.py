"""Process-tree memory and machine-load sampling for the benchmark phases (psutil).

Owns "how much memory did the engine use" (peak RSS of a process and all its children, summed,
sampled) and "how busy was the rest of the machine" (CPU of processes outside the benchmark, and
the CPU time the hypervisor stole from this guest).
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


def _proc_stat_jiffies() -> list[int] | None:
    """The machine's CPU time so far (/proc/stat's "cpu" line: user, nice, system, idle, iowait, irq,
    softirq, steal; guest time is already inside user); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in fields[1:9]] if fields and fields[0] == "cpu" else None


def steal_fraction(before: list[int] | None, after: list[int] | None) -> float | None:
    """CPU time stolen by the hypervisor between two `_proc_stat_jiffies()` readings, as a fraction of
    all CPU time in between (steal is the 8th field); None when unknown or no time passed."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return None
    total = sum(after) - sum(before)
    return (after[7] - before[7]) / total if total > 0 else None


def machine_snapshot(sample_s: float = 1.0) -> dict:
    """Load average, the CPU other processes use now (cores busy, over `sample_s` seconds) and the
    steal fraction over the same seconds.

    "Other" is every process except this one and its descendants (so every engine worker we started,
    busy or idle, is left out).
    """
    ours = {p.pid for p in tree(os.getpid())}
    before, stat_before = _cpu_seconds_by_pid(), _proc_stat_jiffies()
    time.sleep(sample_s)
    after, stat_after = _cpu_seconds_by_pid(), _proc_stat_jiffies()
    others = {pid: after[pid] - before.get(pid, 0.0) for pid in after if pid not in ours}
    busiest = sorted(others.items(), key=lambda kv: -kv[1])[:3]
    names = {}
    for pid, _ in busiest:
        try:
            names[pid] = psutil.Process(pid).name()
        except psutil.NoSuchProcess:
            names[pid] = "?"
    return {"loadavg_1_5_15": list(os.getloadavg()), "other_cpu_cores_busy": sum(others.values()) / sample_s,
            "steal_fraction": steal_fraction(stat_before, stat_after),
            "busiest_others": [{"pid": pid, "name": names[pid], "cpu_cores": cpu / sample_s} for pid, cpu in busiest]}


class PhaseMonitor:
    """Samples one phase in a thread: peak summed RSS of the tree under `pid`, and other processes' CPU.

    `pid` None watches this process's own tree (an engine run in-process). `interval_s` is the sampling
    period, so a peak shorter than that can be missed. Use as a context manager (or `start()` ... `stop()`
    around a worker's whole life); read `result()` after.
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

    def start(self) -> "PhaseMonitor":
        self._start_time = time.monotonic()
        self._start_cpu, self._start_stat = _cpu_seconds_by_pid(), _proc_stat_jiffies()
        self._load_before = list(os.getloadavg())
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the sampling (a second call, or one before `start`, changes nothing)."""
        if self._end or not self._start_time:
            return
        self._stop.set()
        self._thread.join()
        wall = time.monotonic() - self._start_time
        ours = {p.pid for p in tree(os.getpid())} | {p.pid for p in tree(self.pid)}
        end_cpu = _cpu_seconds_by_pid()
        other = sum(end_cpu[pid] - self._start_cpu.get(pid, 0.0) for pid in end_cpu if pid not in ours)
        self._end = {"wall_s": wall, "loadavg_before": self._load_before, "loadavg_after": list(os.getloadavg()),
                     "other_cpu_cores_busy": other / wall if wall else 0.0,
                     "steal_fraction": steal_fraction(self._start_stat, _proc_stat_jiffies())}

    def __enter__(self) -> "PhaseMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def result(self) -> dict:
        return {"peak_rss_mib": self.peak_rss_bytes / 2**20, "rss_sample_interval_s": self.interval_s, **self._end}


class RoundWatch:
    """Where the CPU went during one offline round: the engine running it, its idle peers, everyone else.

    `pid` is the running worker, `peer_pids` the workers waiting their turn (each with its process tree,
    taken at the start and the end; the idle peers' figure is None without peers). "Other" is every
    process outside this one's tree, so the benchmark's own processes are never in it. Cores busy = CPU
    seconds / the round's wall time; steal as in `steal_fraction`. Use as a context manager; read
    `result()` after.
    """

    def __init__(self, pid: int, peer_pids: list[int]):
        self.pid, self.peer_pids = pid, peer_pids

    def _trees(self) -> tuple[set[int], set[int]]:
        return {p.pid for p in tree(self.pid)}, {p.pid for peer in self.peer_pids for p in tree(peer)}

    def __enter__(self) -> "RoundWatch":
        self._engine, self._peers = self._trees()
        self._cpu, self._stat = _cpu_seconds_by_pid(), _proc_stat_jiffies()
        self._start = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self._start
        cpu, stat = _cpu_seconds_by_pid(), _proc_stat_jiffies()
        engine, peers = self._trees()
        engine, peers = engine | self._engine, peers | self._peers
        ours = {p.pid for p in tree(os.getpid())} | engine | peers

        def cores(pids) -> float:
            return sum(cpu[pid] - self._cpu.get(pid, 0.0) for pid in pids if pid in cpu) / wall if wall else 0.0

        self._result = {"wall_s": wall, "steal_fraction": steal_fraction(self._stat, stat),
                        "engine_cpu_cores_busy": cores(engine),
                        "idle_peer_cpu_cores_busy": cores(peers - engine) if self.peer_pids else None,
                        "other_cpu_cores_busy": cores(set(cpu) - ours), "loadavg_after": list(os.getloadavg())}

    def result(self) -> dict:
        return self._result
