"""Percentiles for latency lists (TTFT, ITL); plain Python so every process can use it."""
from __future__ import annotations

import statistics


def percentiles(values: list[float]) -> dict | None:
    """mean, p50, p90, p99, min, max of `values` (linear interpolation between ranks); None when empty."""
    if not values:
        return None
    values = sorted(values)

    def pct(p: float) -> float:
        k = (len(values) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (k - lo)

    return {"n": len(values), "mean": statistics.fmean(values), "p50": pct(0.5), "p90": pct(0.9),
            "p99": pct(0.99), "min": values[0], "max": values[-1]}
