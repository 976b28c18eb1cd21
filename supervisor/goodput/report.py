"""Goodput reports and checkpoint advice as plain-text tables (CLI) and JSON-able dicts (API).

The dicts hold only str, int, float (finite), bool, None, lists and dicts.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from supervisor.goodput.advice import CheckpointAdvice
from supervisor.goodput.calculator_log import CalculatorGoodput
from supervisor.goodput.model import BADPUT_CATEGORIES, GoodputReport
from supervisor.goodput.ramdisk import RamdiskSizing

#: Labels of the badput categories in tables.
CATEGORY_LABELS = {
    "productive_s": "productive",
    "lost_progress_s": "lost progress",
    "detection_s": "detection",
    "remediation_s": "remediation",
    "restart_s": "restart",
    "checkpoint_save_s": "checkpoint save",
    "reduced_capacity_s": "reduced capacity",
    "idle_s": "idle",
}


# --- formatting helpers -------------------------------------------------------------------


def format_duration(seconds: float | None) -> str:
    """``12.5s``, ``5m 03s``, ``2h 04m 05s``, ``3d 01h 02m``; ``-`` for None."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    sign = "-" if seconds < 0 else ""
    s = abs(seconds)
    if s < 60:
        return f"{sign}{s:.1f}s"
    total = round(s)
    d, rest = divmod(total, 86400)
    h, rest = divmod(rest, 3600)
    m, sec = divmod(rest, 60)
    if d:
        return f"{sign}{d}d {h:02d}h {m:02d}m"
    if h:
        return f"{sign}{h}h {m:02d}m {sec:02d}s"
    return f"{sign}{m}m {sec:02d}s"


def format_percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def format_bytes(n: int) -> str:
    """Decimal units, as GKE multi-tier checkpointing writes them (840 GB), with the exact count."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,} bytes)"
    return f"{n} bytes"


def render_table(
    headers: list[str], rows: list[list[str]], *, right: set[int] | None = None
) -> str:
    """Columns padded to their widest cell; columns in ``right`` aligned right."""
    right = right or set()
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


# --- goodput ------------------------------------------------------------------------------


def calculator_to_dict(calculator: CalculatorGoodput) -> dict[str, Any]:
    d = asdict(calculator)
    d["step_diff"] = calculator.step_diff
    result: dict[str, Any] = _clean(d)
    return result


def goodput_to_dict(report: GoodputReport) -> dict[str, Any]:
    """The report as a JSON-able dict (times in seconds, goodput as a 0..1 fraction)."""
    d: dict[str, Any] = {
        "job": report.job,
        "start": report.start,
        "end": report.end,
        "wall_s": report.wall_s,
        "productive_s": report.productive_s,
        "goodput": report.goodput,
        "goodput_percent": report.goodput * 100,
        "badput": report.badput.as_dict(),
        "badput_total_s": report.badput.total_s,
        "attempts": report.attempts,
        "failures": report.failures,
        "last_step": report.last_step,
        "steps_kept": report.steps_kept,
        "steps_redone": report.steps_redone,
        "step_time_s": report.step_time_s,
        "downtime_per_failure_s": report.downtime_per_failure_s,
        "tiers": [asdict(t) for t in report.tiers],
        "calculator": calculator_to_dict(report.calculator)
        if report.calculator is not None
        else None,
        "notes": list(report.notes),
    }
    result: dict[str, Any] = _clean(d)
    return result


def render_goodput_text(report: GoodputReport) -> str:
    """A readable summary: headline, breakdown table, checkpoint tiers, the calculator's figure."""
    name = f"job {report.job}" if report.job else "the job"
    out = [
        f"Goodput of {name}: {format_percent(report.goodput)}"
        f"  (productive {format_duration(report.productive_s)}"
        f" of {format_duration(report.wall_s)} wall time)",
        f"attempts {report.attempts}, failures {report.failures}, "
        f"last step {report.last_step if report.last_step is not None else '-'}, "
        f"steps redone {report.steps_redone}, "
        f"step time {format_duration(report.step_time_s)}",
        "",
    ]
    wall = report.wall_s
    values = {"productive_s": report.productive_s, **report.badput.as_dict()}
    rows = [
        [
            CATEGORY_LABELS[k],
            format_duration(values[k]),
            format_percent(values[k] / wall if wall else None),
        ]
        for k in ("productive_s", *BADPUT_CATEGORIES)
    ]
    total = report.productive_s + report.badput.total_s
    rows.append(["total", format_duration(total), format_percent(total / wall if wall else None)])
    out.append(render_table(["time spent", "duration", "share"], rows, right={1, 2}))
    if report.tiers:
        out.append("")
        tier_rows = [
            [
                t.tier,
                str(t.saves),
                str(t.blocking_saves),
                str(t.emergency_saves),
                format_duration(t.mean_blocking_save_s),
                "-" if t.interval_steps is None else str(t.interval_steps),
                str(t.loads),
                format_duration(t.mean_load_s),
                str(t.recoveries),
            ]
            for t in report.tiers
        ]
        out.append(
            render_table(
                [
                    "checkpoint tier",
                    "saves",
                    "blocking",
                    "emergency",
                    "save cost",
                    "every (steps)",
                    "loads",
                    "load time",
                    "recoveries",
                ],
                tier_rows,
                right=set(range(1, 9)),
            )
        )
    if report.calculator is not None:
        out.append("")
        out.append(render_calculator_text(report.calculator))
    if report.notes:
        out.append("")
        out.extend(f"note: {n}" for n in report.notes)
    return "\n".join(out)


def render_calculator_text(calculator: CalculatorGoodput) -> str:
    line = f"The calculator's goodput: {calculator.goodput_percent:.2f}%"
    if calculator.zero_reason:
        return f"{line} ({calculator.zero_reason})"
    return (
        f"{line} (steps {calculator.min_loaded_step} -> {calculator.max_saved_step} x "
        f"{calculator.reference_step_time_s:g} s reference step time / "
        f"{format_duration(calculator.total_runtime_s)} runtime)"
    )


# --- advice -------------------------------------------------------------------------------


def advice_to_dict(advice: CheckpointAdvice) -> dict[str, Any]:
    """The advice as a JSON-able dict (seconds; goodput and waste as 0..1 fractions)."""
    result: dict[str, Any] = _clean(asdict(advice))
    return result


def ramdisk_to_dict(sizing: RamdiskSizing) -> dict[str, Any]:
    d = asdict(sizing)
    d["size_mib"] = sizing.size_mib
    result: dict[str, Any] = _clean(d)
    return result


def _steps(steps: int | None, seconds: float | None) -> str:
    if steps is None:
        return format_duration(seconds)
    return f"{steps} ({format_duration(seconds)})"


def render_advice_text(advice: CheckpointAdvice) -> str:
    """The advice as a table per tier, expected goodput, warnings and the model used."""
    head = (
        f"Checkpoint advice  (step time {format_duration(advice.step_time_s)}, "
        f"MTBF {format_duration(advice.mtbf_s)}"
    )
    if advice.durable_mtbf_s is not None or len(advice.tiers) > 1:
        head += f", durable-tier MTBF {format_duration(advice.durable_mtbf_s)}"
    head += f", downtime per failure {format_duration(advice.downtime_per_failure_s)})"
    out = [head, ""]
    rows = [
        [
            t.name,
            format_duration(t.save_cost_s),
            format_duration(t.mtbf_s),
            format_duration(t.young_interval_s),
            format_duration(t.daly_interval_s),
            _steps(t.recommended_interval_steps, t.recommended_interval_s),
            _steps(t.current_interval_steps, t.current_interval_s),
            format_percent(t.waste_current),
            format_percent(t.waste_recommended),
        ]
        for t in advice.tiers
    ]
    if rows:
        out.append(
            render_table(
                [
                    "tier",
                    "save cost",
                    "MTBF",
                    "Young",
                    "Daly",
                    "recommended (steps)",
                    "current (steps)",
                    "waste now",
                    "waste rec.",
                ],
                rows,
                right=set(range(1, 9)),
            )
        )
        out.append("")
    out.append(
        f"Expected goodput: current {format_percent(advice.expected_goodput_current)}, "
        f"recommended {format_percent(advice.expected_goodput_recommended)}"
    )
    if advice.warnings:
        out.append("")
        out.append("Warnings:")
        out.extend(f"  - {w}" for w in advice.warnings)
    out.append("")
    out.append(f"Model: {advice.model}")
    return "\n".join(out)


def render_ramdisk_text(sizing: RamdiskSizing) -> str:
    """GKE's ramdisk calculation, step by step."""
    return "\n".join(
        [
            f"Ramdisk per host for {sizing.parameters:,.0f} parameters on {sizing.hosts} hosts:",
            f"  checkpoint   {sizing.parameters:,.0f} x {sizing.bytes_per_parameter:g} bytes"
            f" = {format_bytes(sizing.checkpoint_bytes)}",
            f"  shard        / {sizing.hosts} hosts = {format_bytes(sizing.shard_bytes)}",
            f"  x 2          = {format_bytes(sizing.double_buffered_bytes)}",
            f"  + {sizing.buffer * 100:g}% buffer = {format_bytes(sizing.size_bytes)}"
            f"  (xpk --mtc-ramdisk-size={sizing.size_mib}Mi)",
        ]
    )
