"""Small statistics helpers."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100); nan when empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    """p50, p99 and max of durations given in seconds, in milliseconds."""
    values = sorted(seconds)
    return {
        "p50_ms": percentile(values, 50) * 1000,
        "p99_ms": percentile(values, 99) * 1000,
        "max_ms": (values[-1] * 1000) if values else math.nan,
    }
