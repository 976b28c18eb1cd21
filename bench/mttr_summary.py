"""The MTTR rows' cells: medians, maxima and counts of `bench.mttr.FaultResult`s; and the
rows every MTTR section ends with (the faults not recovered, the bench's own restarts)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from bench.mttr import FaultResult, PolicyRun
from bench.table import Row


def median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def fmt_s(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{median(values):.2f} / {max(values):.2f} s"


def tiers(faults: list[FaultResult]) -> str:
    counts: dict[str, int] = {}
    for f in faults:
        if f.resumed_tier is not None:
            counts[f.resumed_tier] = counts.get(f.resumed_tier, 0) + 1
    return ", ".join(f"{tier} x{n}" for tier, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def lost_summary(faults: list[FaultResult]) -> str:
    lost = [f.steps_lost for f in faults if f.ok and f.steps_lost is not None]
    if not lost:
        return "-"
    return f"{sum(lost) / len(lost):.1f} / {max(lost)} ({tiers(faults)})"


def failed_note(faults: list[FaultResult], expected: int) -> str:
    failed = sum(1 for f in faults if not f.ok) + max(0, expected - len(faults))
    return f", {failed} FAILED" if failed else ""


def recovered(faults: list[FaultResult]) -> list[FaultResult]:
    return [f for f in faults if f.ok and f.mttr_s is not None]


def column(faults: list[FaultResult], n: int) -> str:
    """detected k/n, detection p50, MTTR p50/max, steps lost mean/max, not recovered."""
    detected = [f.detection_s for f in faults if f.detection_s is not None]
    good = recovered(faults)
    lost = [f.steps_lost for f in good if f.steps_lost is not None]
    lost_text = f"{sum(lost) / len(lost):.1f} / {max(lost)}" if lost else "-"
    mttrs = [f.mttr_s for f in good if f.mttr_s is not None]
    return (
        f"detected {len(detected)}/{n} in {fmt_s(detected)}; MTTR {fmt_s(mttrs)}; "
        f"steps lost {lost_text}; not recovered {n - len(good)}"
    )


def p50_counting_misses(faults: list[FaultResult], n: int) -> float:
    """MTTR p50 over `n` faults, one not recovered (or never injected) counting as never
    (infinite): a launcher that recovers fewer than half has no finite p50."""
    mttrs = [f.mttr_s for f in recovered(faults) if f.mttr_s is not None]
    return median(mttrs + [math.inf] * max(0, n - len(mttrs)))


def failure_rows(runs: Iterable[tuple[str, PolicyRun]]) -> list[Row]:
    """One info row per fault a run did not recover, and a FAIL row per run stopped early."""
    rows: list[Row] = []
    for who, run in runs:
        rows += [
            Row(f"  torch {who}: {f.kind} on {f.victim}", f.error or "", verdict="info")
            for f in run.faults
            if not f.ok
        ]
        if run.error is not None:
            rows.append(Row(f"  torch {who}: run stopped early", run.error, verdict="FAIL"))
    return rows


def bench_restart_rows(who: str, run: PolicyRun) -> list[Row]:
    """The whole-job restarts the bench had to make itself (torchrun's baseline)."""
    if not run.restarts_by_bench:
        return []
    return [
        Row(
            f"  {who}: whole-job restarts by the bench",
            f"{run.restarts_by_bench} (the job was lost or its rendezvous kept failing)",
        )
    ]
