"""Soak measurements: the server's resources sampled every few seconds, their growth after warm-up, the plot.

Owns what is sampled (RSS of the server's process tree, its open file descriptors and threads, KV blocks in
use and HTTP requests live from /metrics, the SQLite state file and everything under batch_dir) and how
growth is computed; the
traffic is soak_traffic.py's, the run soak.py's.
"""
from __future__ import annotations

import re
import statistics
import threading
import time
from pathlib import Path

import httpx
import psutil

SERIES = {"rss_bytes": "RSS (MiB)", "num_fds": "open file descriptors", "num_threads": "threads",
          "kv_blocks_used": "KV blocks in use", "live_requests": "HTTP requests live", "sqlite_bytes": "SQLite state (KiB)",
          "batch_dir_bytes": "batch_dir (KiB)"}
SCALE = {"rss_bytes": 1 << 20, "sqlite_bytes": 1 << 10, "batch_dir_bytes": 1 << 10}
GAUGES = {"kv_blocks_used": "lmi_kv_cache_blocks_used", "live_requests": "lmi_front_end_live_requests"}


def gauges(url: str) -> dict[str, int | None]:
    """GAUGES read from the server's /metrics (None where one cannot be read)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return dict.fromkeys(GAUGES)
    found = {}
    for key, metric in GAUGES.items():
        match = re.search(rf"^{metric}\s+([0-9.eE+-]+)$", text, re.M)
        found[key] = int(float(match.group(1))) if match else None
    return found


def dir_bytes(path: Path, pattern: str = "**/*") -> int:
    total = 0
    for item in path.glob(pattern):
        try:
            total += item.stat().st_size if item.is_file() else 0
        except OSError:   # deleted meanwhile
            pass
    return total


def sample(pid: int, url: str, batch_dir: Path) -> dict:
    """One reading of the server process `pid` (and its children, for RSS)."""
    proc = psutil.Process(pid)
    rss = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            rss += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return {"rss_bytes": rss, "num_fds": proc.num_fds(), "num_threads": proc.num_threads(), **gauges(url),
            "sqlite_bytes": dir_bytes(batch_dir, "state.sqlite3*"),
            "batch_dir_bytes": dir_bytes(batch_dir)}


class Sampler:
    """A thread sampling every `interval_s` seconds from start() to stop(); `samples` carry `t_s` (seconds
    since start) and `requests_done` (read from `progress()`)."""

    def __init__(self, pid: int, url: str, batch_dir: Path, interval_s: float, progress=lambda: 0):
        self.pid, self.url, self.batch_dir, self.interval_s, self.progress = pid, url, batch_dir, interval_s, progress
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self.start_time = 0.0

    def start(self) -> "Sampler":
        self.start_time = time.monotonic()
        self._thread.start()
        return self

    def take(self) -> dict:
        reading = {"t_s": round(time.monotonic() - self.start_time, 2), **sample(self.pid, self.url, self.batch_dir),
                   "requests_done": self.progress()}
        self.samples.append(reading)
        return reading

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.take()
            except psutil.Error:   # the server is gone; the run reports that itself
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def growth(samples: list[dict], warmup_s: float) -> dict[str, dict]:
    """Per series: the median of the first tenth of the samples after warm-up (`after_warmup`), of the last
    tenth (`end`), their change in % of the first (`growth_pct`, None when it is 0) and the maximum."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    out: dict[str, dict] = {}
    if len(after) < 2:
        return out
    k = max(1, len(after) // 10)
    for name in SERIES:
        values = [s[name] for s in after if s.get(name) is not None]
        if len(values) < 2:
            continue
        base, end = statistics.median(values[:k]), statistics.median(values[-k:])
        out[name] = {"after_warmup": base, "end": end, "max": max(values),
                     "growth_pct": round(100 * (end - base) / base, 2) if base else None}
    return out


def describe_growth(report: dict[str, dict]) -> list[str]:
    """One line per series, for the console."""
    lines = []
    for name, row in report.items():
        scale = SCALE.get(name, 1)
        pct = "n/a (starts at 0)" if row["growth_pct"] is None else f"{row['growth_pct']:+.1f} %"
        lines.append(f"  {SERIES[name]:24s} {row['after_warmup'] / scale:10.1f} -> {row['end'] / scale:10.1f}  "
                     f"({pct}; max {row['max'] / scale:.1f})")
    return lines


def plot(samples: list[dict], warmup_s: float, path: Path, title: str) -> None:
    """One panel per series against time, the warm-up marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(SERIES) + ["requests_done"]
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.0 * len(names)), sharex=True)
    times = [s["t_s"] / 60 for s in samples]
    for ax, name in zip(axes, names):
        scale = SCALE.get(name, 1)
        ax.plot(times, [(s.get(name) or 0) / scale for s in samples], lw=1.2)
        ax.axvline(warmup_s / 60, color="grey", ls="--", lw=0.8)
        ax.set_ylabel(SERIES.get(name, "requests done"), fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_title(title, fontsize=10)
    axes[-1].set_xlabel("minutes (dashed: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
