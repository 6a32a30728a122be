"""Small latency statistics and timing shared by the demo and the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), nearest-rank; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    """p50, p99, mean and max of durations given in seconds, in milliseconds."""
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan"), "max": float("nan")}
    return {
        "p50": percentile(values, 50) * 1000,
        "p99": percentile(values, 99) * 1000,
        "mean": statistics.fmean(values) * 1000,
        "max": max(values) * 1000,
    }


def durations(n: int, call: Callable[[], object], warmup: int = 10) -> list[float]:
    """Seconds each of ``n`` calls took, after ``warmup`` unmeasured ones."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples
