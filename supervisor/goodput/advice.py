"""Checkpoint advice: how often to checkpoint each tier (ramdisk sizing: :mod:`.ramdisk`).

Model (first-order, valid when save cost C << interval T << MTBF M). Checkpointing a tier
every T seconds of computation, with a blocking save cost of C seconds, and failures that
this tier recovers from arriving every M seconds on average, wastes a fraction of time::

    waste(T) = C / T          (checkpoint overhead)
             + T / (2 M)      (expected rework: half an interval is lost per failure)

Minimising it gives Young's interval ``T = sqrt(2 C M)``; Daly's higher-order optimum is
``T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` for ``C < 2M``, else
``T = M``. We recommend Daly's.

With two tiers (a fast local tier, a durable tier), each failure rolls back to one tier:
to the local tier when it survived (a process crash, a restart in place), to the durable
tier when it did not (e.g. node losses the local tier cannot survive). With ``M`` the MTBF
of all failures and ``M_d`` that of failures needing the durable tier, the local tier's
failures arrive every ``M_l = 1 / (1/M - 1/M_d)``; each tier is optimised with its own
cost and MTBF, and the durable interval is rounded to a multiple of the local one (as
HyperPod's tiered checkpointing advises: "S3 frequency should generally be a multiple of
in-memory frequency")::

    expected goodput = 1 - sum over tiers of (C_i / T_i + T_i / (2 M_i))
                         - downtime_per_failure / M

MTBF is estimated as observed wall time / observed failures, and only from 2 failures up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from supervisor.goodput.checkpoint_intervals import (
    check_positive,
    daly_interval,
    expected_waste,
    interval_steps,
    young_interval,
)
from supervisor.goodput.model import (
    DURABLE_TIER,
    LOCAL_TIER,
    RAM_TIER,
    GoodputReport,
    TierStats,
)

MODEL = (
    "waste per tier = C/T (save overhead) + T/(2*M) (expected rework); "
    "expected goodput = 1 - sum of tier wastes - downtime_per_failure/MTBF; "
    "Young T = sqrt(2*C*M); Daly T = sqrt(2*C*M)*(1 + sqrt(C/(2M))/3 + C/(2M)/9) - C "
    "for C < 2M, else M"
)

#: Fewer observed failures than this give no MTBF estimate.
MIN_FAILURES_FOR_MTBF = 2


# --- MTBF ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MtbfEstimate:
    """Mean time between failures from ``failures`` seen over ``observed_s`` of wall time."""

    failures: int
    observed_s: float
    #: ``observed_s / failures``, or None when there is not enough data.
    mtbf_s: float | None
    note: str

    @property
    def enough_data(self) -> bool:
        return self.mtbf_s is not None


def estimate_mtbf(
    failures: int, observed_s: float, *, min_failures: int = MIN_FAILURES_FOR_MTBF
) -> MtbfEstimate:
    """MTBF = observed wall time / failures; "not enough data" below ``min_failures``."""
    if failures < 0:
        raise ValueError(f"failures must not be negative, got {failures}")
    check_positive("observed_s", observed_s, allow_zero=True)
    hours = observed_s / 3600
    if failures < max(1, min_failures) or observed_s <= 0:
        return MtbfEstimate(
            failures,
            observed_s,
            None,
            f"not enough data: {failures} failure(s) in {hours:.2f} h observed; "
            f"an MTBF estimate needs at least {max(1, min_failures)}",
        )
    mtbf = observed_s / failures
    return MtbfEstimate(
        failures, observed_s, mtbf, f"{failures} failures in {hours:.2f} h: {mtbf / 3600:.2f} h"
    )


# --- advice -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierInput:
    """One checkpoint tier as measured or configured."""

    name: str
    #: Blocking save time C (seconds); 0 for a fully asynchronous save.
    save_cost_s: float
    #: The interval in use now, in steps (None if unknown).
    current_interval_steps: int | None = None
    #: Shortest sensible interval, e.g. an asynchronous save's duration (the next save
    #: cannot start before it ends).
    min_interval_s: float = 0.0

    def __post_init__(self) -> None:
        check_positive("save_cost_s", self.save_cost_s, allow_zero=True)
        check_positive("min_interval_s", self.min_interval_s, allow_zero=True)
        if self.current_interval_steps is not None and self.current_interval_steps < 1:
            raise ValueError(
                f"current_interval_steps must be at least 1, got {self.current_interval_steps}"
            )


@dataclass(frozen=True)
class TierAdvice:
    name: str
    save_cost_s: float
    #: MTBF of the failures this tier is the recovery point for (None: unknown).
    mtbf_s: float | None
    young_interval_s: float | None
    daly_interval_s: float | None
    recommended_interval_steps: int | None
    recommended_interval_s: float | None
    current_interval_steps: int | None
    current_interval_s: float | None
    #: Expected fraction of time lost by this tier (C/T + T/2M) at each setting.
    waste_current: float | None
    waste_recommended: float | None


@dataclass(frozen=True)
class CheckpointAdvice:
    step_time_s: float | None
    #: MTBF of all failures (None: not enough data).
    mtbf_s: float | None
    #: MTBF of the failures that need the durable tier (None: unknown).
    durable_mtbf_s: float | None
    downtime_per_failure_s: float
    tiers: tuple[TierAdvice, ...]
    expected_goodput_current: float | None
    expected_goodput_recommended: float | None
    warnings: tuple[str, ...]
    model: str = MODEL

    def tier(self, name: str) -> TierAdvice | None:
        return next((t for t in self.tiers if t.name == name), None)


def check_tier_frequencies(local_steps: int, durable_steps: int) -> str | None:
    """HyperPod's rule: the durable frequency (steps) should be a multiple of the local one.

    Returns a warning naming the nearest multiples, or None when the rule holds.
    """
    if local_steps < 1 or durable_steps < 1:
        raise ValueError("checkpoint frequencies must be at least 1 step")
    if durable_steps % local_steps == 0:
        return None
    below = durable_steps // local_steps * local_steps
    above = below + local_steps
    options = f"{below} or {above}" if below >= local_steps else f"{above}"
    return (
        f"durable checkpoints every {durable_steps} steps are not a multiple of local "
        f"checkpoints every {local_steps} steps; use a multiple ({options} steps): the "
        "durable frequency should be a multiple of the in-memory one (as HyperPod requires)"
    )


def _mtbf_value(value: float | MtbfEstimate | None, what: str, warnings: list[str]) -> float | None:
    if isinstance(value, MtbfEstimate):
        if value.mtbf_s is None:
            warnings.append(f"{what}: {value.note}")
        return value.mtbf_s
    if value is not None:
        check_positive(what, value)
    return value


def advise(
    step_time_s: float | None,
    local: TierInput,
    *,
    mtbf_s: float | MtbfEstimate | None,
    durable: TierInput | None = None,
    durable_mtbf_s: float | MtbfEstimate | None = None,
    downtime_per_failure_s: float = 0.0,
) -> CheckpointAdvice:
    """Recommended checkpoint intervals per tier and the expected goodput (module doc).

    ``local`` is the only tier when ``durable`` is None; it then recovers every failure.
    ``mtbf_s`` is the MTBF of all failures, ``durable_mtbf_s`` that of the failures the
    local tier cannot survive (a subset: it must not be shorter than ``mtbf_s``).
    """
    if step_time_s is not None:
        check_positive("step_time_s", step_time_s)
    check_positive("downtime_per_failure_s", downtime_per_failure_s, allow_zero=True)
    warnings: list[str] = []
    m_all = _mtbf_value(mtbf_s, "MTBF", warnings)
    m_dur = _mtbf_value(durable_mtbf_s, "durable-tier MTBF", warnings) if durable else None
    if step_time_s is None:
        warnings.append("no step time measured: intervals are given in seconds only")

    m_local: float | None = m_all
    if durable is not None and m_dur is not None and m_all is not None:
        if m_dur < m_all * (1 - 1e-9):
            raise ValueError(
                f"durable_mtbf_s ({m_dur}) is shorter than mtbf_s ({m_all}): the failures "
                "needing the durable tier are a subset of all failures"
            )
        rate = 1 / m_all - 1 / m_dur
        m_local = 1 / rate if rate > 1e-15 else None
        if m_local is None:
            warnings.append(
                "every failure needs the durable tier: local checkpoints save no rework"
            )
    elif durable is not None and m_dur is None and m_all is not None:
        warnings.append(
            "durable-tier MTBF unknown: no durable interval recommended, and the local "
            "tier is assumed to recover every failure"
        )

    def tier_advice(tier: TierInput, mtbf: float | None, multiple_of: int | None) -> TierAdvice:
        young = young_interval(tier.save_cost_s, mtbf) if mtbf is not None else None
        daly = daly_interval(tier.save_cost_s, mtbf) if mtbf is not None else None
        if daly is not None and mtbf is not None and tier.save_cost_s >= 2 * mtbf:
            warnings.append(
                f"{tier.name} tier: save cost {tier.save_cost_s:g} s is at least twice its "
                f"MTBF: Daly's interval is the MTBF itself"
            )
        rec_steps: int | None = None
        rec_s: float | None = None
        if daly is not None:
            target = max(daly, tier.min_interval_s)
            if step_time_s is None:
                rec_s = target
            else:
                if target < step_time_s:
                    warnings.append(
                        f"{tier.name} tier: the optimum ({target:.3g} s) is shorter than one "
                        "step; recommending every step"
                    )
                rec_steps = interval_steps(target, step_time_s)
                if multiple_of is not None:
                    rec_steps = max(1, round(rec_steps / multiple_of)) * multiple_of
                rec_s = rec_steps * step_time_s
        cur_steps = tier.current_interval_steps
        cur_s = cur_steps * step_time_s if cur_steps is not None and step_time_s else None
        return TierAdvice(
            name=tier.name,
            save_cost_s=tier.save_cost_s,
            mtbf_s=mtbf,
            young_interval_s=young,
            daly_interval_s=daly,
            recommended_interval_steps=rec_steps,
            recommended_interval_s=rec_s,
            current_interval_steps=cur_steps,
            current_interval_s=cur_s,
            waste_current=expected_waste(cur_s, tier.save_cost_s, mtbf) if cur_s else None,
            waste_recommended=expected_waste(rec_s, tier.save_cost_s, mtbf) if rec_s else None,
        )

    local_advice = tier_advice(local, m_local, None)
    tiers = [local_advice]
    if durable is not None:
        tiers.append(tier_advice(durable, m_dur, local_advice.recommended_interval_steps))
        if local.current_interval_steps and durable.current_interval_steps:
            warning = check_tier_frequencies(
                local.current_interval_steps, durable.current_interval_steps
            )
            if warning:
                warnings.append(warning)

    def goodput(wastes: list[float | None]) -> float | None:
        if m_all is None or any(w is None for w in wastes):
            return None
        lost = sum(w for w in wastes if w is not None) + downtime_per_failure_s / m_all
        return min(1.0, max(0.0, 1 - lost))

    # A tier without a known MTBF (durable tier) still costs its overhead C/T.
    return CheckpointAdvice(
        step_time_s=step_time_s,
        mtbf_s=m_all,
        durable_mtbf_s=m_dur,
        downtime_per_failure_s=downtime_per_failure_s,
        tiers=tuple(tiers),
        expected_goodput_current=goodput([t.waste_current for t in tiers]),
        expected_goodput_recommended=goodput(
            [
                t.waste_recommended if t.recommended_interval_s is not None else t.waste_current
                for t in tiers
            ]
        ),
        warnings=tuple(warnings),
    )


def _tier_input(
    stats: TierStats | None, name: str, cost: float | None, current: int | None, notes: list[str]
) -> TierInput | None:
    if stats is None and cost is None:
        return None
    min_interval = 0.0
    if cost is None and stats is not None:
        if stats.mean_blocking_save_s is not None:
            cost = stats.mean_blocking_save_s
        elif stats.mean_save_s:
            cost = 0.0
            min_interval = stats.mean_save_s
            notes.append(
                f"{name} tier: saves are asynchronous (no blocking time measured); the interval "
                f"is kept at least as long as a save ({stats.mean_save_s:.3g} s)"
            )
        else:
            notes.append(f"{name} tier: no save duration measured; give its save cost")
            return None
    if current is None and stats is not None:
        current = stats.interval_steps
    return TierInput(name, cost or 0.0, current, min_interval)


def advise_from_report(
    report: GoodputReport,
    *,
    local_tier: str = LOCAL_TIER,
    durable_tier: str = DURABLE_TIER,
    step_time_s: float | None = None,
    mtbf_s: float | None = None,
    durable_mtbf_s: float | None = None,
    local_save_cost_s: float | None = None,
    durable_save_cost_s: float | None = None,
    current_local_steps: int | None = None,
    current_durable_steps: int | None = None,
    downtime_per_failure_s: float | None = None,
) -> CheckpointAdvice:
    """Advice from what a :class:`GoodputReport` measured; any argument given overrides it.

    Measured: step time (median), save cost per tier (mean blocking save, emergency
    checkpoints excluded), current interval per tier (median steps between saves), MTBF
    (failures over wall time), durable MTBF (failures recovered from the durable tier over
    wall time) and downtime per failure. A tier with no saves and no cost given is left
    out; with only one tier, it recovers every failure. A report with a single tier of
    another name (the gpu-recipes calculator's "unknown") uses it as the local tier.
    """
    notes: list[str] = []
    if local_tier == LOCAL_TIER and report.tier(LOCAL_TIER) is None and report.tier(RAM_TIER):
        local_tier = RAM_TIER  # a PyTorch job's fast tier (training.checkpoint)
    if (
        report.tier(local_tier) is None
        and report.tier(durable_tier) is None
        and len(report.tiers) == 1
        and durable_save_cost_s is None
    ):
        local_tier = report.tiers[0].tier  # the only tier (e.g. of a calculator log)
    local = _tier_input(
        report.tier(local_tier), local_tier, local_save_cost_s, current_local_steps, notes
    )
    durable = _tier_input(
        report.tier(durable_tier), durable_tier, durable_save_cost_s, current_durable_steps, notes
    )
    mtbf: float | MtbfEstimate = (
        mtbf_s if mtbf_s is not None else estimate_mtbf(report.failures, report.wall_s)
    )
    durable_mtbf: float | MtbfEstimate | None = durable_mtbf_s
    stats = report.tier(durable_tier)
    if durable_mtbf is None and stats is not None and local is not None:
        durable_mtbf = estimate_mtbf(stats.recoveries, report.wall_s)
    downtime = downtime_per_failure_s
    if downtime is None:
        downtime = report.downtime_per_failure_s or 0.0
    step = step_time_s if step_time_s is not None else report.step_time_s
    only = local or durable
    if only is None:
        m = mtbf.mtbf_s if isinstance(mtbf, MtbfEstimate) else mtbf
        return CheckpointAdvice(
            step_time_s=step,
            mtbf_s=m,
            durable_mtbf_s=None,
            downtime_per_failure_s=downtime,
            tiers=(),
            expected_goodput_current=None,
            expected_goodput_recommended=None,
            warnings=("no checkpoint saves measured and no save cost given", *notes),
        )
    advice = advise(
        step,
        local or only,
        mtbf_s=mtbf,
        durable=durable if local is not None else None,
        durable_mtbf_s=durable_mtbf if local is not None else None,
        downtime_per_failure_s=downtime,
    )
    if notes:
        advice = replace(advice, warnings=(*advice.warnings, *notes))
    return advice
