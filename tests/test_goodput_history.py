"""A job's timeline from the supervisor's history, and its goodput, against worked examples.

Times are seconds after T0; every expected figure is written as the arithmetic that
gives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from supervisor.domain import (
    ActionRecord,
    ActionStatus,
    ActionType,
    CheckpointReport,
    Event,
    EventType,
    ProgressSample,
)
from supervisor.goodput import advise_from_report, compute_goodput
from supervisor.goodput.history import fault_time, group_checkpoints, timeline_from_history

approx = pytest.approx
T0 = datetime(2026, 1, 5, 12, 0, 0, tzinfo=UTC)
JOB = "j1"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def rel(t: float) -> float:
    return t - T0.timestamp()


def sample(step: int, t: float) -> ProgressSample:
    return ProgressSample(job=JOB, step=step, time=at(t))


_ids = iter(range(1, 1_000_000))


def report(
    event: str, step: int, t: float, duration_s: float, tier: str = "local", rank: int = 0
) -> CheckpointReport:
    return CheckpointReport(
        report_id=f"r{next(_ids)}",
        node=f"n{rank}",
        job=JOB,
        rank=rank,
        event=event,
        step=step,
        duration_s=duration_s,
        tier=tier,
        time=at(t),
    )


def event(type_: EventType, t: float, node: str = "n1", **details: Any) -> Event:
    return Event(type=type_, time=at(t), node=node, job=JOB, details=details, id=next(_ids))


def action(
    type_: ActionType,
    start: float,
    end: float | None,
    status: ActionStatus = ActionStatus.SUCCEEDED,
    **params: Any,
) -> ActionRecord:
    n = next(_ids)
    return ActionRecord(
        id=n,
        type=type_,
        status=status,
        idempotency_key=f"k{n}",
        source="policy",
        created_at=at(start),
        job=JOB,
        params=params,
        started_at=at(start),
        finished_at=at(end) if end is not None else None,
    )


def build(
    *,
    events: Sequence[Event] = (),
    actions: Sequence[ActionRecord] = (),
    checkpoints: Sequence[CheckpointReport] = (),
    samples: Sequence[ProgressSample] = (),
    now: float,
    max_replicas: int | None = None,
) -> Any:
    return timeline_from_history(
        JOB,
        created_at=T0,
        events=events,
        actions=actions,
        checkpoints=checkpoints,
        samples=samples,
        now=at(now),
        max_replicas=max_replicas,
    )


# --- the worked example: a node lost, an emergency checkpoint, a hot swap -----------------


def worked_example() -> dict[str, Any]:
    """One step per second. Steps 1-20 by t=20; a local save of step 20 (two ranks, the
    slower one 1 s: 20-21); steps 21-25 by t=26; the node dies at t=28 (its last
    heartbeat) and is declared lost at t=40 (a worker exit at 41 is the same incident);
    emergency checkpoint 40.5-41.5 (step 25), hot swap 42-50; the new workers load step 25
    from 50 to 52, then compute steps 26-40 by t=67, when the job finishes (exit code 0).
    """
    return {
        "samples": [sample(10, 10), sample(20, 20), sample(25, 26), sample(30, 57), sample(40, 67)],
        "checkpoints": [
            report("saved", 20, 20.5, 0.5, rank=0),
            report("saved", 20, 21.0, 1.0, rank=1),
            report("saved", 25, 41.5, 0.8, tier="emergency", rank=0),
            report("saved", 25, 41.4, 0.7, tier="emergency", rank=1),
            report("loaded", 25, 52.0, 2.0, tier="emergency", rank=0),
            report("loaded", 25, 51.9, 1.9, tier="emergency", rank=1),
        ],
        "events": [
            event(
                EventType.HOST_HEARTBEAT_LOST,
                40,
                last_heartbeat=at(28).isoformat(),
                heartbeat_timeout_s=12,
            ),
            event(EventType.WORKER_EXITED, 41, node="n2", exit_code=-9),
            event(EventType.WORKER_EXITED, 67, node="n2", exit_code=0),
        ],
        "actions": [
            action(ActionType.EMERGENCY_CHECKPOINT, 40.5, 41.5),
            action(ActionType.HOT_SWAP, 42, 50),
        ],
    }


def test_worked_example_timeline() -> None:
    timeline, sources = build(**worked_example(), now=100)
    # Starts: when the job was first seen (0) and the end of the hot swap (50).
    assert [rel(s.time) for s in timeline.job_starts] == approx([0, 50])
    # The two ranks' reports of one checkpoint are one save: last time, longest duration.
    local = [s for s in timeline.saves if s.tier == "local"]
    assert [(s.step, rel(s.time), s.duration_s) for s in local] == [(20, approx(21.0), 1.0)]
    assert [(ld.step, rel(ld.time), ld.duration_s) for ld in timeline.loads] == [
        (25, approx(52.0), 2.0)
    ]
    # The save's step (20, begun at 21 - 1 = 20) was already sampled: no extra step report.
    assert sorted(s.step for s in timeline.steps) == [10, 20, 25, 30, 40]
    # One incident (the worker exit at 41 came before any restart), fault at the last
    # heartbeat.
    assert len(timeline.failures) == 1
    assert rel(timeline.failures[0].fault_at or 0) == approx(28)
    assert rel(timeline.failures[0].detected_at) == approx(40)
    # The exit with code 0 ends the window (not `now`).
    assert rel(timeline.end) == approx(67)
    assert sources.failure_events == 2 and sources.checkpoint_reports == 6


def test_worked_example_goodput() -> None:
    timeline, _ = build(**worked_example(), now=100)
    report = compute_goodput(timeline)
    # Measured step time: (20-10)/10 = 1; (26-20 - 1 s save)/5 = 1; (67-57)/10 = 1 -> 1 s.
    assert report.step_time_s == approx(1.0)
    b = report.badput
    # Productive: steps 1-20 (0-20) 20 s + 21-25 (21-26) 5 s + 26-30 (52-57) 5 s
    # + 31-40 (57-67) 10 s = 40 s.
    assert report.productive_s == approx(40.0)
    assert b.checkpoint_save_s == approx(1.0)  # the local save 20-21
    assert b.lost_progress_s == approx(2.0)  # work in flight: last step 26 -> fault 28
    assert b.detection_s == approx(12.0)  # fault 28 -> detection 40
    # Detection 40 -> restart 50 with no step between (the emergency save 40.7-41.5 and
    # the hot swap 42-50 inside it): 10 s.
    assert b.remediation_s == approx(10.0)
    assert b.restart_s == approx(2.0)  # loading 50-52
    assert b.reduced_capacity_s == 0 and b.idle_s == approx(0.0)
    # 40 + 1 + 2 + 12 + 10 + 2 = 67 = the wall time; goodput 40/67.
    assert report.wall_s == approx(67.0)
    assert report.goodput == approx(40 / 67)
    assert (report.attempts, report.failures, report.last_step) == (2, 1, 40)
    assert report.steps_redone == 0  # the emergency checkpoint kept steps 21-25
    emergency = report.tier("emergency")
    assert emergency is not None and (emergency.saves, emergency.emergency_saves) == (1, 1)
    assert emergency.recoveries == 1
    # Downtime per failure: (detection 12 + remediation 10 + restart 2) / 1 = 24 s.
    assert report.downtime_per_failure_s == approx(24.0)


def test_worked_example_series() -> None:
    timeline, _ = build(**worked_example(), now=100)
    report = compute_goodput(timeline, series_points=2)
    half, whole = report.series
    # Up to 67/2 = 33.5: productive 0-20 and 21-26 (25 s), the save 1 s, lost 26-28 (2 s),
    # detection 28-33.5 (5.5 s): 33.5 s.
    assert rel(half.time) == approx(33.5) and half.wall_s == approx(33.5)
    assert half.productive_s == approx(25.0)
    assert half.badput.detection_s == approx(5.5) and half.badput.lost_progress_s == approx(2)
    assert half.badput.remediation_s == 0 and half.goodput == approx(25 / 33.5)
    # The last point is the whole report.
    assert whole.productive_s == approx(report.productive_s)
    assert whole.badput == report.badput and whole.wall_s == approx(report.wall_s)


def test_series_points_add_up_and_grow() -> None:
    timeline, _ = build(**worked_example(), now=100)
    report = compute_goodput(timeline, series_points=67)
    assert len(report.series) == 67
    previous = 0.0
    for k, point in enumerate(report.series, 1):
        assert point.wall_s == approx(k)  # one point per second
        assert point.productive_s + point.badput.total_s == approx(point.wall_s)
        assert point.productive_s >= previous - 1e-9
        previous = point.productive_s


def test_worked_example_without_emergency_checkpoint_redoes_steps() -> None:
    """The same failure, recovered from the local save of step 20 instead: steps 21-25
    are computed twice."""
    ex = worked_example()
    ex["checkpoints"] = [c for c in ex["checkpoints"] if c.tier == "local"] + [
        report("loaded", 20, 52.0, 2.0, tier="local")
    ]
    ex["actions"] = [action(ActionType.HOT_SWAP, 42, 50)]
    # After the load of step 20 at 52: steps 21-30 by 62, 31-40 by 72.
    ex["samples"] = [*ex["samples"][:3], sample(30, 62), sample(40, 72)]
    ex["events"][2] = event(EventType.WORKER_EXITED, 72, node="n2", exit_code=0)
    timeline, _ = build(**ex, now=100)
    result = compute_goodput(timeline)
    b = result.badput
    # Steps 21-25 ran at 21-26 and again at 52-57: the first run (5 s) is lost progress,
    # plus the work in flight 26 -> 28: 5 + 2 = 7 s.
    assert result.steps_redone == 5
    assert b.lost_progress_s == approx(7.0)
    # Productive: 0-20 (20 s) + 52-72 (20 s) = 40 s; wall 72 s.
    assert result.productive_s == approx(40.0)
    assert result.wall_s == approx(72.0)
    # 40 + save 1 + lost 7 + detection 12 + remediation 10 + restart 2 = 72.
    assert b.checkpoint_save_s + b.detection_s + b.remediation_s + b.restart_s == approx(25.0)
    local = result.tier("local")
    assert local is not None and local.recoveries == 1 and local.mean_blocking_save_s == 1.0


# --- starts nobody recorded --------------------------------------------------------------


def test_a_load_without_an_action_is_a_restart() -> None:
    """The workers were restarted by someone else (no action): the load at 40 (3 s)
    opens an attempt at 37."""
    timeline, _ = build(
        samples=[sample(10, 10), sample(20, 20), sample(25, 40 + 5)],
        checkpoints=[report("saved", 20, 20.5, 0.5), report("loaded", 20, 40.0, 3.0)],
        events=[event(EventType.WORKER_EXITED, 30, exit_code=1)],
        now=45,
    )
    assert [rel(s.time) for s in timeline.job_starts] == approx([0, 37])
    report_ = compute_goodput(timeline)
    assert (report_.attempts, report_.failures) == (2, 1)
    # Productive: steps 1-20 (0-20) and 21-25 (40-45): 25 s.
    assert report_.productive_s == approx(25.0)
    # The exit is detected at 30 (fault time unknown): the work in flight since the last
    # report (20) is lost, less the save 20-20.5: 9.5 s; 30 -> 37 remediation (no step
    # until the restart); 37 -> 40 loading: restart 3 s. 25 + 0.5 + 9.5 + 7 + 3 = 45.
    assert report_.badput.checkpoint_save_s == approx(0.5)
    assert report_.badput.lost_progress_s == approx(9.5)
    assert report_.badput.remediation_s == approx(7.0)
    assert report_.badput.restart_s == approx(3.0)


def test_a_step_going_back_without_a_start_is_a_restart() -> None:
    timeline, _ = build(samples=[sample(10, 10), sample(20, 20), sample(5, 30)], now=30)
    # Restarted somewhere between the samples of step 20 (t=20) and step 5 (t=30): at 25.
    assert [rel(s.time) for s in timeline.job_starts] == approx([0, 25])


def test_a_late_save_report_does_not_move_progress_back() -> None:
    """A save of step 20 reported after step 29 was sampled is not a step report."""
    timeline, _ = build(
        samples=[sample(10, 10), sample(29, 29)], checkpoints=[report("saved", 20, 35, 0.1)], now=35
    )
    assert sorted(s.step for s in timeline.steps) == [10, 29]
    assert compute_goodput(timeline).steps_redone == 0


def test_a_lagging_sample_below_a_reported_save_is_dropped() -> None:
    """Saves are reported at once; samples lag (worker progress interval + heartbeat).
    The save of step 20 began at 20; a sample of step 18 seen at 20.5 is stale."""
    timeline, _ = build(
        samples=[sample(10, 10), sample(18, 20.5), sample(30, 30)],
        checkpoints=[report("saved", 20, 20.2, 0.2)],
        now=30,
    )
    assert sorted((s.step, rel(s.time)) for s in timeline.steps) == [
        (10, approx(10)),
        (20, approx(20)),
        (30, approx(30)),
    ]
    result = compute_goodput(timeline)
    # Nothing redone, one attempt. Step time: median of (20-10)/10 = 1 and
    # (30-20 - 0.2 s save)/10 = 0.98: 0.99 s, so steps 1-10 started at 10 - 9.9 = 0.1
    # (0-0.1 is start-up: restart). Productive 9.9 + 10 + 9.8 (20.2-30) = 29.7 s.
    assert (result.steps_redone, result.attempts) == (0, 1)
    assert result.step_time_s == approx(0.99)
    assert result.productive_s == approx(29.7)
    assert result.badput.checkpoint_save_s == approx(0.2)
    assert result.badput.restart_s == approx(0.1)


def test_records_before_the_supervisor_saw_the_job_open_the_window() -> None:
    """The supervisor first saw the job at 0 (T0), but a save of step 10 began at -5:
    the job was running before; its window starts there, as one attempt."""
    timeline, _ = build(
        samples=[sample(20, 5)], checkpoints=[report("saved", 10, -4.5, 0.5)], now=5
    )
    assert rel(timeline.start) == approx(-5) and rel(timeline.end) == approx(5)
    assert [rel(s.time) for s in timeline.job_starts] == approx([-5])
    assert compute_goodput(timeline).attempts == 1


def test_a_save_between_samples_is_a_step_report() -> None:
    # Samples every 10 s; the save of step 15 began at 15.5 - 0.5 = 15.
    timeline, _ = build(
        samples=[sample(10, 10), sample(20, 20.5)],
        checkpoints=[report("saved", 15, 15.5, 0.5)],
        now=20.5,
    )
    assert sorted((s.step, rel(s.time)) for s in timeline.steps) == [
        (10, approx(10)),
        (15, approx(15)),
        (20, approx(20.5)),
    ]


# --- failures, replicas, running actions ---------------------------------------------------


def test_failures_are_incidents_separated_by_restarts() -> None:
    events = [
        event(EventType.HANG, 20, stalled_for_s=8.0),  # fault at 20 - 8 = 12
        event(EventType.WORKER_HEARTBEAT_LOST, 21),  # same incident
        event(EventType.GPU_XID, 60, observed_at=at(58).isoformat(), code=79),  # after restart
        event(EventType.SPARE_AVAILABLE, 61),  # not a failure
        event(EventType.WORKER_EXITED, 62, exit_code=0),  # not a failure either
    ]
    actions = [action(ActionType.RESTART_IN_PLACE, 22, 25)]
    timeline, sources = build(events=events, actions=actions, now=70)
    got = [(f.kind, rel(f.detected_at), rel(f.fault_at or 0)) for f in timeline.failures]
    assert got == [("hang", approx(20), approx(12)), ("gpu_xid", approx(60), approx(58))]
    assert sources.failure_events == 3


def test_fault_time_never_after_detection() -> None:
    e = event(EventType.HOST_HEARTBEAT_LOST, 10, last_heartbeat=at(12).isoformat())
    assert rel(fault_time(e) or 0) == approx(10)
    assert fault_time(event(EventType.HOST_HEARTBEAT_LOST, 10, last_heartbeat="noon")) is None
    assert fault_time(event(EventType.WORKER_EXITED, 10, exit_code=1)) is None


def test_scale_actions_give_replica_changes() -> None:
    """4 replicas at most, one step per second. Step 15 saved at 15; scaled down to 3
    from 15 to 20 (so 4 before); the workers load step 15 at 20 and compute steps 16-35
    by 35; scaled up to 4 from 35 to 40; step 35 loaded at 40, steps 36-50 by 50. A failed
    scale-up at 45-48 changes nothing (no start; step time outranks remediation)."""
    actions = [
        action(ActionType.SCALE_DOWN, 15, 20, to_replicas=3),
        action(ActionType.SCALE_UP, 35, 40, to_replicas=4),
        action(ActionType.SCALE_UP, 45, 48, ActionStatus.FAILED, to_replicas=4),
    ]
    samples = [sample(10, 10), sample(15, 15), sample(25, 25), sample(35, 35)]
    samples += [sample(45, 45), sample(50, 50)]
    checkpoints = [
        report("saved", 15, 15, 0),
        report("loaded", 15, 20, 0),
        report("saved", 35, 35, 0),
        report("loaded", 35, 40, 0),
    ]
    timeline, _ = build(
        actions=actions, samples=samples, checkpoints=checkpoints, now=50, max_replicas=4
    )
    assert [(rel(r.time), r.replicas) for r in timeline.replica_changes] == [
        (approx(0), 4),
        (approx(20), 3),
        (approx(40), 4),
    ]
    result = compute_goodput(timeline)
    b = result.badput
    # Steps 20-35 at 3 of 4 replicas: 15 s x 1/4 = 3.75 s of reduced capacity.
    assert b.reduced_capacity_s == approx(3.75)
    # Productive: 0-15 (15 s) + 20-35 x 3/4 (11.25 s) + 40-50 (10 s) = 36.25 s.
    assert result.productive_s == approx(36.25)
    # The scale actions 15-20 and 35-40: 10 s. 36.25 + 3.75 + 10 = 50 = the wall time.
    assert b.remediation_s == approx(10.0)
    assert result.wall_s == approx(50.0) and result.attempts == 3


def test_never_scaled_means_full_size() -> None:
    timeline, _ = build(samples=[sample(10, 10)], now=10, max_replicas=4)
    assert timeline.replica_changes == ()


def test_running_action_lasts_until_now() -> None:
    timeline, _ = build(actions=[action(ActionType.RESTART_WORKLOAD, 10, None)], now=30)
    assert [(rel(r.start), rel(r.end)) for r in timeline.remediations] == [(approx(10), approx(30))]
    # Not finished: not a start.
    assert [rel(s.time) for s in timeline.job_starts] == approx([0])


def test_grouping_separates_saves_of_one_step_far_apart() -> None:
    groups = group_checkpoints(
        [report("saved", 10, 10, 1), report("saved", 10, 11, 2), report("saved", 10, 100, 1)]
    )
    assert [(g.step, rel(g.last), g.duration_s) for g in groups] == [
        (10, approx(11), 2),
        (10, approx(100), 1),
    ]


def test_a_checkpoint_of_several_ranks_carries_their_mean_size_and_total_time() -> None:
    def sized(rank: int, t: float, size: int | None, total: float | None) -> CheckpointReport:
        r = report("saved", 10, t, 0.5 + rank, tier="ram", rank=rank)
        return replace(r, size_bytes=size, total_s=total)

    timeline, _ = build(
        checkpoints=[
            sized(0, 10, 100, 1.0),
            sized(1, 11, 300, 3.0),
            sized(2, 12, None, None),  # an older client
            replace(report("loaded", 10, 50, 2, tier="peer"), size_bytes=200, total_s=0.5),
        ],
        now=60,
    )
    (save,) = timeline.saves
    assert (save.tier, save.duration_s, save.size_bytes, save.total_s) == ("ram", 2.5, 200, 2.0)
    (load,) = timeline.loads
    assert (load.tier, load.size_bytes, load.total_s) == ("peer", 200, 0.5)


def test_ram_saves_are_periodic_steps_and_peer_copies_are_not() -> None:
    # A RAM save of step 15 began at 15; a peer copy of step 15 made later (at 19) by the
    # host monitor is no evidence of when step 15 was reached.
    timeline, _ = build(
        samples=[sample(10, 10), sample(20, 20.5)],
        checkpoints=[
            report("saved", 15, 15.5, 0.5, tier="ram"),
            report("saved", 15, 19, 0, "peer"),
        ],
        now=20.5,
    )
    assert sorted(s.step for s in timeline.steps) == [10, 15, 20]
    assert [rel(s.time) for s in timeline.steps if s.step == 15] == [approx(15)]


def test_advice_from_the_worked_example() -> None:
    """Advice on the history: local save cost 1 s measured, failures given as MTBF 1 h."""
    timeline, _ = build(**worked_example(), now=100)
    advice = advise_from_report(compute_goodput(timeline), mtbf_s=3600)
    local = advice.tier("local")
    assert local is not None
    # Daly: sqrt(2 x 1 x 3600) = 84.85; x = 1/7200; 84.85 x (1 + sqrt(x)/3 + x/9) - 1
    # = 84.85 x 1.003944 - 1 = 84.19 s; at 1 s per step: 84 steps.
    assert local.daly_interval_s == approx(84.19, abs=0.01)
    assert local.recommended_interval_steps == 84
    assert local.save_cost_s == 1.0
