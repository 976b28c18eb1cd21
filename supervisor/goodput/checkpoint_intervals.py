"""Time between checkpoints of one tier: Young's and Daly's optima and the time they waste
(the model is in :mod:`supervisor.goodput.advice`)."""

from __future__ import annotations

import math


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise ValueError unless ``value`` is a finite number above 0 (or 0, when allowed)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(
            f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}"
        )


def young_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young's optimum time between checkpoints: ``sqrt(2 * C * M)`` seconds."""
    check_positive("save_cost_s", save_cost_s, allow_zero=True)
    check_positive("mtbf_s", mtbf_s)
    return math.sqrt(2 * save_cost_s * mtbf_s)


def daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum time between checkpoints (seconds).

    ``sqrt(2CM) * (1 + sqrt(C/(2M))/3 + (C/(2M))/9) - C`` for ``C < 2M``, else ``M``.
    """
    check_positive("save_cost_s", save_cost_s, allow_zero=True)
    check_positive("mtbf_s", mtbf_s)
    c, m = save_cost_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def expected_waste(interval_s: float, save_cost_s: float, mtbf_s: float | None) -> float:
    """Fraction of time lost by one tier: ``C/T + T/(2M)`` (no rework term without M)."""
    check_positive("interval_s", interval_s)
    rework = interval_s / (2 * mtbf_s) if mtbf_s is not None else 0.0
    return save_cost_s / interval_s + rework


def interval_steps(interval_s: float, step_time_s: float) -> int:
    """An interval in seconds as a whole number of steps (at least 1)."""
    check_positive("step_time_s", step_time_s)
    return max(1, round(interval_s / step_time_s))
