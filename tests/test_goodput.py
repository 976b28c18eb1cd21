"""Goodput, badput breakdown and checkpoint advice, against worked examples done by hand.

Every expected figure is written as the arithmetic that gives it.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from supervisor.goodput import (
    CalculatorEvent,
    CalculatorLogError,
    CheckpointLoaded,
    CheckpointSaved,
    FailureDetected,
    GoodputReport,
    JobStarted,
    JobStopped,
    Record,
    Remediation,
    ReplicaChange,
    StepReported,
    TierInput,
    Timeline,
    advice_to_dict,
    advise,
    advise_from_report,
    calculator_goodput,
    check_tier_frequencies,
    compute_goodput,
    daly_interval,
    estimate_mtbf,
    expected_waste,
    goodput_from_calculator_log,
    goodput_series,
    goodput_to_dict,
    interval_steps,
    parse_calculator_log,
    parse_timestamp,
    ramdisk_size_bytes,
    ramdisk_sizing,
    ramdisk_to_dict,
    read_calculator_log,
    render_advice_text,
    render_goodput_text,
    render_ramdisk_text,
    timeline_from_calculator,
    young_interval,
)

approx = pytest.approx

# --- the calculator's log and formula ---------------------------------------------------------

# Times in seconds after 2025-01-01T00:00:00 (written as the calculator's tracker does: naive
# ISO 8601): scheduled 0, started 60, loaded step 0 at 70, saved 100 at 170 and 200 at
# 270, crashed at 300, restarted at 400, loaded 200 at 420, saved 300 at 520, ended 530.
CALCULATOR_LOG = """\
{"timestamp": "2025-01-01T00:00:00", "job_name": "llama", "event_type": "user_scheduled"}
{"timestamp": "2025-01-01T00:01:00", "job_name": "llama", "event_type": "job_started"}
{"timestamp": "2025-01-01T00:01:10", "job_name": "llama", "event_type": "checkpoint_loaded", "step": 0}
{"timestamp": "2025-01-01T00:02:50", "job_name": "llama", "event_type": "checkpoint_saved", "step": 100}

{"timestamp": "2025-01-01T00:04:30", "job_name": "llama", "event_type": "checkpoint_saved", "step": 200}
{"timestamp": "2025-01-01T00:05:00", "job_name": "llama", "event_type": "job_terminated"}
{"timestamp": "2025-01-01T00:06:40", "job_name": "llama", "event_type": "job_started"}
{"timestamp": "2025-01-01T00:07:00", "job_name": "llama", "event_type": "checkpoint_loaded", "step": 200}
{"timestamp": "2025-01-01T00:08:40", "job_name": "llama", "event_type": "checkpoint_saved", "step": 300}
{"timestamp": "2025-01-01T00:08:50", "job_name": "llama", "event_type": "job_terminated"}
"""  # noqa: E501


def calculator_events() -> list[CalculatorEvent]:
    return parse_calculator_log(CALCULATOR_LOG.splitlines())


def test_calculator_formula_on_a_written_log() -> None:
    result = calculator_goodput(calculator_events(), 1.0)
    # (max_saved_step - min_loaded_step) * reference_step_time / (last_ts - first_ts) * 100
    assert result.goodput_percent == approx((300 - 0) * 1.0 / (530 - 0) * 100)  # 56.60%
    assert result.total_runtime_s == 530
    assert result.effective_time_s == 300
    assert (result.min_loaded_step, result.max_saved_step, result.step_diff) == (0, 300, 300)
    assert result.job_name == "llama"
    assert result.job_starts == 2
    assert result.checkpoints_loaded == 1  # the calculator counts loads of a step above 0
    assert result.checkpoints_saved == 3
    assert result.zero_reason is None
    # A slower reference step scales the figure linearly: 300 * 1.5 / 530 * 100.
    assert calculator_goodput(calculator_events(), 1.5).goodput_percent == approx(
        300 * 1.5 / 530 * 100
    )


def test_calculator_formula_is_zero_without_a_reference_step_time() -> None:
    for ref in (None, 0.0):
        result = calculator_goodput(calculator_events(), ref)
        assert result.goodput_percent == 0
        assert result.effective_time_s == 0
        assert result.zero_reason == "no reference step time"
        assert result.total_runtime_s == 530  # still measured, as the calculator does
    with pytest.raises(ValueError, match="reference_step_time_s"):
        calculator_goodput(calculator_events(), -1.0)


def test_calculator_formula_other_zero_cases() -> None:
    no_load = [e for e in calculator_events() if e.event_type != "checkpoint_loaded"]
    assert calculator_goodput(no_load, 1.0).goodput_percent == 0
    assert calculator_goodput(no_load, 1.0).zero_reason == "no checkpoint_loaded event"
    assert calculator_goodput([], 1.0).zero_reason == "no events"
    only_step_zero = parse_calculator_log(
        [
            '{"timestamp": 0, "event_type": "checkpoint_loaded", "step": 0}',
            '{"timestamp": 10, "event_type": "checkpoint_saved", "step": 0}',
        ]
    )
    assert calculator_goodput(only_step_zero, 1.0).goodput_percent == 0


def test_calculator_selects_one_job_and_other_events_widen_the_span() -> None:
    lines = [
        '{"timestamp": 100, "job_name": "a", "event_type": "job_started"}',
        '{"timestamp": 50, "job_name": "b", "event_type": "job_started"}',
        '{"timestamp": 110, "job_name": "a", "event_type": "checkpoint_loaded", "step": 10}',
        '{"timestamp": 60, "job_name": "b", "event_type": "checkpoint_loaded", "step": 0}',
        '{"timestamp": 150, "job_name": "b", "event_type": "checkpoint_saved", "step": 40}',
        '{"timestamp": 200, "job_name": "a", "event_type": "checkpoint_saved", "step": 50}',
        '{"timestamp": 300, "job_name": "a", "event_type": "step_reported"}',
    ]
    events = parse_calculator_log(lines)
    # Without a name, the job of the earliest event (b, at 50), as the calculator does:
    # (40 - 0) * 2.0 / (150 - 50) * 100 = 80%.
    assert calculator_goodput(events, 2.0).goodput_percent == approx(40 * 2.0 / (150 - 50) * 100)
    # Job a: the unknown "step_reported" event at 300 still ends the runtime, as in the
    # the calculator: (50 - 10) * 2.0 / (300 - 100) * 100 = 40%.
    result = calculator_goodput(events, 2.0, job_name="a")
    assert result.goodput_percent == approx(40 * 2.0 / 200 * 100)
    assert result.other_events == 1
    with pytest.raises(CalculatorLogError, match=r"line 7, field 'event_type': unknown"):
        parse_calculator_log(lines, strict=True)


def test_calculator_log_liberal_field_names_and_timestamps() -> None:
    lines = [
        # Unix seconds as a number, another event name field, upper case.
        '{"ts": 1735689600, "event": "JOB_STARTED", "job": "x"}',
        # Milliseconds, a numeric string step under another name, dashes.
        '{"time": 1735689610000, "type": "checkpoint-loaded", "global_step": "5", "job": "x"}',
        # ISO 8601 with Z, and an offset: 2025-01-01T01:00:40+01:00 = 00:00:40Z.
        '{"timestamp": "2025-01-01T00:00:30Z", "event_type": "checkpoint_saved",'
        ' "checkpoint_step": 25.0, "job": "x"}',
        '{"@timestamp": "2025-01-01T01:00:40+01:00", "eventType": "job_terminated", "job": "x"}',
        # A Cloud Logging export entry: the payload inside, the time on the envelope.
        '{"jsonPayload": {"event_type": "user_terminated", "job_name": "x"},'
        ' "timestamp": "2025-01-01T00:00:50.500Z"}',
    ]
    events = parse_calculator_log(lines)
    t0 = 1735689600.0  # 2025-01-01T00:00:00Z
    assert [e.timestamp - t0 for e in events] == approx([0, 10, 30, 40, 50.5])
    assert [e.event_type for e in events] == [
        "job_started",
        "checkpoint_loaded",
        "checkpoint_saved",
        "job_terminated",
        "user_terminated",
    ]
    assert [e.step for e in events] == [None, 5, 25, None, None]
    assert {e.job_name for e in events} == {"x"}
    # (25 - 5) * 1.0 / 50.5 * 100
    assert calculator_goodput(events, 1.0).goodput_percent == approx(20 / 50.5 * 100)


def test_parse_timestamp_forms() -> None:
    z = parse_timestamp("2025-01-01T00:00:00Z")
    assert parse_timestamp("2025-01-01T00:00:00") == z  # naive is read as UTC
    assert parse_timestamp("2025-01-01 02:00:00+02:00") == z
    assert parse_timestamp(z) == z
    assert parse_timestamp(z * 1000) == approx(z)  # milliseconds
    assert parse_timestamp(z * 1_000_000) == approx(z)  # microseconds
    assert parse_timestamp(int(z) * 1_000_000_000) == approx(z)  # nanoseconds
    assert parse_timestamp(f"{z}") == z
    for bad in (True, None, "yesterday", float("nan"), [1]):
        with pytest.raises(ValueError):
            parse_timestamp(bad)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"line 2: invalid JSON"),
        ("[1, 2]", r"line 2: expected a JSON object, got list"),
        ('{"timestamp": 5}', r"line 2, field 'event_type': missing"),
        ('{"event_type": "job_started"}', r"line 2, field 'timestamp': missing"),
        ('{"event_type": "job_started", "ts": "noon"}', r"line 2, field 'ts': expected an ISO"),
        ('{"event_type": "job_started", "timestamp": true}', r"line 2, field 'timestamp'"),
        ('{"event_type": 7, "timestamp": 5}', r"line 2, field 'event_type': expected an event"),
        (
            '{"event_type": "checkpoint_saved", "timestamp": 5}',
            r"line 2, field 'step': missing \(a checkpoint_saved event needs a step\)",
        ),
        (
            '{"event_type": "checkpoint_loaded", "timestamp": 5, "step": -3}',
            r"line 2, field 'step': expected a non-negative integer, got -3",
        ),
        (
            '{"event_type": "checkpoint_loaded", "timestamp": 5, "iteration": 2.5}',
            r"line 2, field 'iteration'",
        ),
    ],
)
def test_calculator_log_errors_name_the_line_and_field(line: str, message: str) -> None:
    good = '{"timestamp": 1, "event_type": "user_scheduled"}'
    with pytest.raises(CalculatorLogError, match=message) as info:
        parse_calculator_log([good, line])
    assert info.value.line == 2


def test_read_calculator_log_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "llama-goodput.log"
    path.write_text(CALCULATOR_LOG)
    assert read_calculator_log(path) == calculator_events()
    path.write_text(CALCULATOR_LOG + '{"event_type": "job_started"}\n')
    with pytest.raises(CalculatorLogError, match=r"llama-goodput.log: line 12, field 'timestamp'"):
        read_calculator_log(path)


def test_breakdown_of_the_calculator_log() -> None:
    report = goodput_from_calculator_log(calculator_events(), 1.0)
    assert report.calculator is not None
    assert report.calculator.goodput_percent == approx(300 / 530 * 100)
    b = report.badput
    assert report.wall_s == 530
    # Steps 1-200 from the first load (70) to the save of 200 (270), steps 201-300 from
    # the second load (420) to the save of 300 (520): 200 + 100 s, all kept.
    assert report.productive_s == approx(200 + 100)
    # Work since the last save (270) lost when the job terminated at 300.
    assert b.lost_progress_s == approx(300 - 270)
    assert b.detection_s == 0  # the log has no fault times
    assert b.remediation_s == approx(400 - 300)  # terminated -> started again
    assert b.restart_s == approx((70 - 60) + (420 - 400))  # started -> first step
    assert b.checkpoint_save_s == 0  # the log has no save durations
    assert b.idle_s == approx((60 - 0) + (530 - 520))  # queued, and the end
    assert report.productive_s + b.total_s == approx(report.wall_s)
    # Here the reference step time is the real one, so both agree: 300 / 530.
    assert report.goodput * 100 == approx(report.calculator.goodput_percent)
    assert report.attempts == 2
    assert report.failures == 1
    assert report.last_step == 300


def test_calculator_user_termination_is_not_a_failure() -> None:
    lines = [
        '{"timestamp": 0, "event_type": "job_started"}',
        '{"timestamp": 10, "event_type": "checkpoint_loaded", "step": 0}',
        '{"timestamp": 110, "event_type": "checkpoint_saved", "step": 100}',
        '{"timestamp": 120, "event_type": "user_terminated"}',
        '{"timestamp": 120, "event_type": "job_terminated"}',
        '{"timestamp": 200, "event_type": "job_started"}',
        '{"timestamp": 200, "event_type": "job_started"}',
        '{"timestamp": 210, "event_type": "checkpoint_loaded", "step": 100}',
        '{"timestamp": 310, "event_type": "checkpoint_saved", "step": 200}',
    ]
    timeline = timeline_from_calculator(parse_calculator_log(lines))
    assert timeline.failures == ()
    assert len(timeline.job_starts) == 2  # repeated job_started collapsed, as the calculator does
    report = compute_goodput(timeline)
    assert report.productive_s == approx(100 + 100)
    assert report.badput.restart_s == approx(10 + 10)
    assert report.badput.idle_s == approx((120 - 110) + (200 - 120))  # stopped by the user
    assert report.badput.lost_progress_s == 0


# --- our breakdown ------------------------------------------------------------------------


def failure_timeline(*, emergency: bool) -> Timeline:
    """Steps of 10 s; a node dies at 255 (step 26 in flight), detected at 270.

    Periodic: the latest checkpoint is step 20 (saved asynchronously at 200); the job
    resumes from it and redoes steps 21-25. Emergency: the healthy replica saves step 25
    (270 -> 280) before the hot swap; the job resumes from step 25.
    """
    recs: list[Record] = [JobStarted(0)]
    recs += [StepReported(k, 10 * k) for k in range(1, 26)]  # step k done at 10k
    recs += [FailureDetected(detected_at=270, fault_at=255), Remediation(270, 300, "hot_swap")]
    recs.append(JobStarted(300))
    if emergency:
        recs.append(CheckpointSaved(25, 280, 10, "local", blocking=True))
        recs.append(CheckpointLoaded(25, 310, 10, "local"))
        recs += [StepReported(k, 310 + 10 * (k - 25)) for k in range(26, 31)]
    else:
        recs.append(CheckpointSaved(20, 200, 5, "durable", blocking=False))
        recs.append(CheckpointLoaded(20, 310, 10, "durable"))
        recs += [StepReported(k, 310 + 10 * (k - 20)) for k in range(21, 31)]
    return Timeline.from_records(recs, job="llama")


def assert_sums_to_wall(report: GoodputReport) -> None:
    assert report.productive_s + report.badput.total_s == approx(report.wall_s, abs=1e-6)
    assert report.productive_s >= -1e-9
    assert all(v >= -1e-9 for v in report.badput.as_dict().values())
    assert 0 <= report.goodput <= 1 + 1e-12


def test_failure_with_periodic_checkpoint() -> None:
    report = compute_goodput(failure_timeline(emergency=False))
    b = report.badput
    assert report.wall_s == 410  # step 30 done at 310 + 10 * 10
    # Kept: steps 1-20 (200 s) and 21-30 after the restart (100 s).
    assert report.productive_s == approx(20 * 10 + 10 * 10)
    # Redone steps 21-25 (5 x 10 s) plus step 26 in flight from 250 to the fault at 255.
    assert b.lost_progress_s == approx(5 * 10 + (255 - 250))
    assert b.detection_s == approx(270 - 255)
    assert b.remediation_s == approx(300 - 270)
    assert b.restart_s == approx(310 - 300)  # the load, 300 -> 310
    assert b.checkpoint_save_s == 0  # the save was asynchronous
    assert b.idle_s == approx(0)
    assert report.goodput == approx(300 / 410)
    assert (report.steps_kept, report.steps_redone, report.last_step) == (30, 5, 30)
    assert report.step_time_s == approx(10)
    assert_sums_to_wall(report)


def test_failure_with_emergency_checkpoint() -> None:
    report = compute_goodput(failure_timeline(emergency=True))
    b = report.badput
    assert report.wall_s == 360  # step 30 done at 310 + 5 * 10
    assert report.productive_s == approx(25 * 10 + 5 * 10)
    assert b.lost_progress_s == approx(255 - 250)  # only the step in flight
    assert b.detection_s == approx(270 - 255)
    # The emergency save (270 -> 280) happens while training is stopped: remediation.
    assert b.remediation_s == approx(300 - 270)
    assert b.checkpoint_save_s == 0
    assert b.restart_s == approx(310 - 300)
    assert report.goodput == approx(300 / 360)
    assert report.steps_redone == 0
    (local,) = report.tiers
    assert (local.tier, local.emergency_saves, local.mean_blocking_save_s) == ("local", 1, None)
    assert local.recoveries == 1
    assert_sums_to_wall(report)
    # The emergency checkpoint saved the 5 steps (50 s) the periodic one lost.
    periodic = compute_goodput(failure_timeline(emergency=False))
    assert periodic.badput.lost_progress_s - b.lost_progress_s == approx(5 * 10)


def test_only_answers_to_a_failure_count_as_emergency_saves() -> None:
    """A periodic save that ran between the fault and its detection was no answer to the
    failure; a save the training side reports as tier `emergency` always is one, and its
    tier's blocking cost is its own."""
    recs: list[Record] = [JobStarted(0)]
    recs += [StepReported(k, 10 * k) for k in range(1, 26)]
    recs.append(CheckpointSaved(25, 260, 2, "local", blocking=True))  # 258 -> 260
    recs += [FailureDetected(detected_at=270, fault_at=255), Remediation(270, 300, "hot_swap")]
    recs.append(CheckpointSaved(25, 276, 4, "emergency", blocking=True))  # 272 -> 276
    recs += [JobStarted(300), CheckpointLoaded(25, 310, 10, "emergency")]
    recs += [StepReported(k, 310 + 10 * (k - 25)) for k in range(26, 31)]
    report = compute_goodput(Timeline.from_records(recs))
    tiers = {t.tier: t for t in report.tiers}
    assert (tiers["local"].emergency_saves, tiers["local"].mean_blocking_save_s) == (0, 2)
    assert (tiers["emergency"].emergency_saves, tiers["emergency"].blocking_saves) == (1, 1)
    assert tiers["emergency"].mean_blocking_save_s == 4
    assert report.badput.checkpoint_save_s == approx(2)  # the periodic one
    assert_sums_to_wall(report)


def test_blocking_checkpoint_save() -> None:
    recs: list[Record] = [JobStarted(0)]
    recs += [StepReported(k, 10 * k) for k in range(1, 11)]
    recs.append(CheckpointSaved(10, 105, 5, "local", blocking=True))  # 100 -> 105
    recs += [StepReported(k, 105 + 10 * (k - 10)) for k in range(11, 21)]
    report = compute_goodput(Timeline.from_records(recs))
    assert report.wall_s == 205
    assert report.productive_s == approx(20 * 10)
    assert report.badput.checkpoint_save_s == approx(105 - 100)
    # Step 11's interval (100 -> 115) minus the save is 10 s, like the others.
    assert report.step_time_s == approx(10)
    (local,) = report.tiers
    assert local.mean_blocking_save_s == 5
    assert_sums_to_wall(report)


def test_tier_sizes_and_throughputs_never_count_as_badput() -> None:
    mib = 2**20
    recs: list[Record] = [JobStarted(0)]
    recs += [StepReported(k, 10 * k) for k in range(1, 31)]
    # RAM saves blocking 1 s each but 4 s / 2 s / unknown in all; a peer copy that does
    # not block; a load served by the peer tier.
    recs += [
        CheckpointSaved(10, 101, 1, "ram", size_bytes=256 * mib, total_s=4),
        CheckpointSaved(20, 201, 1, "ram", size_bytes=128 * mib, total_s=2),
        CheckpointSaved(30, 301, 1, "ram"),
        CheckpointSaved(30, 330, 0, "peer", blocking=False, size_bytes=64 * mib, total_s=0),
        CheckpointLoaded(30, 400, 5, "peer", size_bytes=64 * mib, total_s=0.5),
    ]
    report = compute_goodput(Timeline.from_records(recs))
    assert report.badput.checkpoint_save_s == approx(3 * 1)  # blocking seconds only
    ram, peer = report.tier("ram"), report.tier("peer")
    assert ram is not None and peer is not None
    assert ram.mean_save_bytes == approx((256 + 128) / 2 * mib)
    assert ram.save_mib_per_s == approx((256 / 4 + 128 / 2) / 2)  # 64 MiB/s
    assert ram.mean_save_s == 1 and ram.mean_load_bytes is None and ram.load_mib_per_s is None
    # A save with no time in all has a size but no throughput.
    assert peer.mean_save_bytes == 64 * mib and peer.save_mib_per_s is None
    assert (peer.loads, peer.mean_load_s, peer.mean_load_bytes) == (1, 5, 64 * mib)
    assert peer.load_mib_per_s == approx(128)
    assert_sums_to_wall(report)
    # An older timeline (no sizes at all) has none.
    (local,) = compute_goodput(Timeline.from_records([CheckpointSaved(1, 1, 0.5, "local")])).tiers
    assert (local.mean_save_bytes, local.save_mib_per_s) == (None, None)


def test_scale_down_period() -> None:
    recs: list[Record] = [JobStarted(0)]
    recs += [StepReported(k, 10 * k) for k in range(1, 31)]
    recs += [ReplicaChange(100, 3, 4), ReplicaChange(200, 4, 4)]  # 3 of 4 replicas
    report = compute_goodput(Timeline.from_records(recs))
    assert report.wall_s == 300
    # 100 s at 3/4 capacity: a quarter of it is missing.
    assert report.badput.reduced_capacity_s == approx((200 - 100) * (1 - 3 / 4))
    assert report.productive_s == approx(300 - 25)
    assert report.goodput == approx(275 / 300)
    assert_sums_to_wall(report)


def test_restart_runs_until_the_first_step_begins() -> None:
    # Started at 0, loaded step 40 from 5 to 20; first report (step 41) at 40; steps of
    # 10 s. Step 41 is taken to have begun at 40 - 10 = 30, so 0 -> 30 is restart.
    recs: list[Record] = [JobStarted(0), CheckpointLoaded(40, 20, 15)]
    recs += [StepReported(k, 40 + 10 * (k - 41)) for k in range(41, 46)]
    report = compute_goodput(Timeline.from_records(recs))
    assert report.badput.restart_s == approx(30 - 0)
    assert report.productive_s == approx(5 * 10)
    assert report.badput.idle_s == approx(0)
    # With a reference step time of 4 s, step 41 is placed at 36 -> 40: restart 0 -> 36,
    # productive 36 -> 80.
    ref = compute_goodput(Timeline.from_records(recs), reference_step_time_s=4)
    assert ref.badput.restart_s == approx(36)
    assert ref.productive_s == approx(80 - 36)
    # An explicit duration wins over both: 40 - 2 = 38.
    recs[2] = StepReported(41, 40, duration_s=2)
    explicit = compute_goodput(Timeline.from_records(recs), reference_step_time_s=4)
    assert explicit.badput.restart_s == approx(38)


def test_reports_every_n_steps_and_partial_redo() -> None:
    # Reports every 10 steps (1 s per step); checkpoint of step 15 (non-blocking); failure
    # at 27 s detected at 27; restart at 30, loads step 15 at 30, redoes 16-20 and goes on.
    recs: list[Record] = [JobStarted(0), StepReported(10, 10), StepReported(20, 20)]
    recs += [CheckpointSaved(15, 15, 0.0, "local", blocking=False), FailureDetected(27)]
    recs += [JobStarted(30), CheckpointLoaded(15, 30), StepReported(20, 35), StepReported(30, 45)]
    report = compute_goodput(Timeline.from_records(recs))
    # Steps 16-20 of the report at 20 (half of its 10 s) were redone; 20 -> 27 in flight.
    assert report.badput.lost_progress_s == approx(10 * 5 / 10 + (27 - 20))
    assert report.badput.remediation_s == approx(30 - 27)
    assert report.productive_s == approx(5 + 10 + 5 + 10)  # 1-15, then 16-30 again
    assert report.steps_redone == 5
    assert_sums_to_wall(report)


def test_empty_and_trivial_timelines() -> None:
    empty = compute_goodput(Timeline())
    assert (empty.wall_s, empty.goodput, empty.notes) == (0, 0, ("empty timeline",))
    only_window = compute_goodput(Timeline(start=0, end=100))
    assert only_window.badput.idle_s == 100
    # Steps without any recorded start: the job is assumed started at the window start.
    steps = compute_goodput(Timeline(start=0, steps=(StepReported(5, 10), StepReported(6, 20))))
    assert steps.attempts == 1
    assert any("no job start" in n for n in steps.notes)
    assert_sums_to_wall(steps)


def test_record_validation() -> None:
    with pytest.raises(ValueError, match="fault_at"):
        FailureDetected(detected_at=10, fault_at=20)
    with pytest.raises(ValueError, match="replicas"):
        ReplicaChange(0, 5, 4)
    with pytest.raises(ValueError, match="step"):
        StepReported(-1, 0)
    with pytest.raises(ValueError, match="duration_s"):
        CheckpointSaved(1, 0, -2)
    with pytest.raises(ValueError, match="size_bytes"):
        CheckpointSaved(1, 0, 0, size_bytes=-1)
    with pytest.raises(ValueError, match="size_bytes"):
        CheckpointLoaded(1, 0, 0, size_bytes=math.inf)
    with pytest.raises(ValueError, match="total_s"):
        CheckpointLoaded(1, 0, 0, total_s=math.nan)
    with pytest.raises(ValueError, match="end"):
        Remediation(10, 5)
    with pytest.raises(ValueError, match="before"):
        Timeline(start=10, end=5)
    with pytest.raises(TypeError):
        Timeline.from_records([object()])  # type: ignore[list-item]


def test_goodput_series_ends_with_the_full_report() -> None:
    timeline = failure_timeline(emergency=False)
    series = goodput_series(timeline, points=4)
    assert [r.end for r in series] == approx([410 / 4, 410 / 2, 410 * 3 / 4, 410])
    full = compute_goodput(timeline)
    assert series[-1].productive_s == approx(full.productive_s)
    # At 205 (before the failure) nothing was redone yet: 20 steps kept; step 21, in
    # flight and not yet reported, is unexplained (idle) so far.
    assert series[1].productive_s == approx(200)
    assert series[1].badput.idle_s == approx(205 - 200)
    for report in series:
        assert_sums_to_wall(report)


def simulated_timeline(rng: random.Random) -> Timeline:
    """A plausible job: attempts, steps, saves of both tiers, failures, scaling."""
    recs: list[Record] = []
    t = rng.uniform(0, 50)
    recs.append(JobStarted(t))
    step = saved = 0
    attempts = rng.randint(1, 4)
    for a in range(attempts):
        if a > 0 or rng.random() < 0.5:
            dur = rng.uniform(0, 20)
            t += dur
            recs.append(CheckpointLoaded(saved, t, dur, rng.choice(["local", "durable"])))
            step = saved
        for _ in range(rng.randint(0, 30)):
            gap = rng.uniform(0.5, 5)
            t += gap
            step += rng.choice([1, 1, 2, 5])
            duration = rng.choice([None, None, gap * rng.uniform(0.2, 1.5)])
            recs.append(StepReported(step, t, duration))
            if rng.random() < 0.25:
                blocking = rng.random() < 0.5
                dur = rng.uniform(0, 4)
                t += dur if blocking else 0
                recs.append(
                    CheckpointSaved(step, t, dur, rng.choice(["local", "durable"]), blocking)
                )
                saved = step
            if rng.random() < 0.1:
                recs.append(ReplicaChange(t, rng.randint(1, 4), 4))
        if a < attempts - 1:
            fault = t + rng.uniform(0, 5)
            detected = fault + rng.uniform(0, 30)
            recs.append(FailureDetected(detected, rng.choice([fault, None])))
            end = detected + rng.uniform(0, 40)
            if rng.random() < 0.5:
                recs.append(CheckpointSaved(step, detected + 1, 1, "local"))
                saved = step
            recs.append(Remediation(detected, end, "restart"))
            t = end + rng.uniform(0, 10)
            recs.append(JobStarted(t))
        elif rng.random() < 0.5:
            recs.append(JobStopped(t + rng.uniform(0, 10)))
    return Timeline.from_records(recs, end=t + rng.uniform(0, 20))


def chaotic_timeline(rng: random.Random) -> Timeline:
    """Records thrown at random: overlaps, rollbacks, duplicates, odd orders."""
    recs: list[Record] = []
    for _ in range(rng.randint(0, 40)):
        t = rng.uniform(0, 500)
        kind = rng.randrange(8)
        if kind == 0:
            recs.append(JobStarted(t))
        elif kind == 1:
            recs.append(JobStopped(t))
        elif kind == 2:
            recs.append(StepReported(rng.randint(0, 50), t, rng.choice([None, rng.uniform(0, 30)])))
        elif kind == 3:
            recs.append(
                CheckpointSaved(rng.randint(0, 50), t, rng.uniform(0, 30), "x", rng.random() < 0.5)
            )
        elif kind == 4:
            recs.append(CheckpointLoaded(rng.randint(0, 50), t, rng.uniform(0, 30)))
        elif kind == 5:
            recs.append(FailureDetected(t, rng.choice([None, t - rng.uniform(0, 30)])))
        elif kind == 6:
            recs.append(Remediation(t, t + rng.uniform(0, 60)))
        else:
            recs.append(ReplicaChange(t, rng.randint(0, 4), 4))
    return Timeline.from_records(recs)


@pytest.mark.parametrize("seed", range(40))
def test_sums_to_wall_on_random_timelines(seed: int) -> None:
    rng = random.Random(seed)
    for timeline in (simulated_timeline(rng), chaotic_timeline(rng)):
        for ref in (None, rng.uniform(0.5, 5)):
            report = compute_goodput(timeline, reference_step_time_s=ref)
            assert_sums_to_wall(report)
            json.dumps(goodput_to_dict(report))


# --- checkpoint advice --------------------------------------------------------------------

C, M = 60.0, 24 * 3600.0  # a one-minute save, a failure a day


def test_young_and_daly_on_known_numbers() -> None:
    # Young: sqrt(2 * 60 * 86400) = sqrt(10,368,000) = 3219.94 s (53.7 min).
    assert young_interval(C, M) == approx(math.sqrt(10_368_000))
    assert young_interval(C, M) == approx(3219.937887, rel=1e-9)
    # Daly: x = C / 2M = 60 / 172800 = 3.4722e-4; sqrt(x) = 0.0186339;
    # 3219.94 * (1 + 0.0186339 / 3 + 3.4722e-4 / 9) - 60 = 3219.94 * 1.0062499 - 60
    x = 60 / 172_800
    assert daly_interval(C, M) == approx(3219.937887 * (1 + math.sqrt(x) / 3 + x / 9) - 60)
    assert daly_interval(C, M) == approx(3180.06, abs=0.01)
    # C >= 2M: the interval is M itself.
    assert daly_interval(200, 100) == 100
    assert young_interval(0, M) == 0
    with pytest.raises(ValueError):
        young_interval(C, 0)


def test_step_conversion_and_expected_waste() -> None:
    # 2 s steps: Young 3219.94 / 2 = 1609.97 -> 1610 steps; Daly 3180.06 / 2 -> 1590.
    assert interval_steps(young_interval(C, M), 2.0) == 1610
    assert interval_steps(daly_interval(C, M), 2.0) == 1590
    assert interval_steps(0.1, 2.0) == 1  # never below one step
    # At Young's interval both terms equal sqrt(C / 2M): waste = 2 * 0.0186339.
    assert expected_waste(young_interval(C, M), C, M) == approx(2 * math.sqrt(C / (2 * M)))
    # Every 1000 s: 60 / 1000 + 1000 / 172800 = 0.06 + 0.005787 = 0.065787.
    assert expected_waste(1000, C, M) == approx(0.06 + 1000 / 172_800)


def test_single_tier_advice_current_and_recommended() -> None:
    advice = advise(2.0, TierInput("local", C, current_interval_steps=500), mtbf_s=M)
    (local,) = advice.tiers
    assert local.young_interval_s == approx(3219.94, abs=0.01)
    assert local.recommended_interval_steps == 1590  # Daly, 3180.06 s / 2 s
    assert local.recommended_interval_s == 3180
    assert local.current_interval_s == 1000  # 500 steps x 2 s
    # Current: 1 - (60/1000 + 1000/172800) = 1 - 0.065787 = 0.934213.
    assert advice.expected_goodput_current == approx(1 - (60 / 1000 + 1000 / 172_800))
    # Recommended: 1 - (60/3180 + 3180/172800) = 1 - (0.018868 + 0.018403) = 0.962729.
    assert advice.expected_goodput_recommended == approx(1 - (60 / 3180 + 3180 / 172_800))
    assert advice.warnings == ()
    # Downtime per failure costs downtime / M: 600 s a day = 0.6944%.
    with_downtime = advise(2.0, TierInput("local", C, 500), mtbf_s=M, downtime_per_failure_s=600)
    assert with_downtime.expected_goodput_current == approx(
        1 - (60 / 1000 + 1000 / 172_800) - 600 / 86_400
    )


def test_two_tier_advice_and_the_multiple_of_rule() -> None:
    # All failures every 24 h; those the local tier cannot survive every 4 days, so the
    # local tier's own failures come every 1 / (1/86400 - 1/345600) = 115200 s (32 h).
    advice = advise(
        2.0,
        TierInput("local", C, current_interval_steps=500),
        durable=TierInput("durable", 120, current_interval_steps=1250),
        mtbf_s=M,
        durable_mtbf_s=4 * M,
    )
    local, durable = advice.tiers
    assert local.mtbf_s == approx(115_200)
    assert local.daly_interval_s == approx(daly_interval(C, 115_200))
    # Local: sqrt(2*60*115200) = 3718.06; x = 60/230400 = 2.604e-4;
    # 3718.06 * (1 + sqrt(x)/3 + x/9) - 60 = 3678.17 s -> 3678.17 / 2 = 1839 steps.
    assert local.daly_interval_s == approx(3678.17, abs=0.01)
    assert local.recommended_interval_steps == 1839
    # Durable: Daly(120, 345600) = 9027.5 s = 4514 steps = 2.45 local intervals -> 2 x 1839.
    assert durable.daly_interval_s == approx(9027.54, abs=0.01)
    assert durable.recommended_interval_steps == 2 * 1839
    assert durable.recommended_interval_steps % local.recommended_interval_steps == 0
    # HyperPod's rule on the current settings: 1250 is not a multiple of 500.
    assert any("not a multiple" in w and "1000 or 1500" in w for w in advice.warnings)
    # Expected goodput sums both tiers' waste; now local every 1000 s, durable every 2500 s:
    # 1 - (60/1000 + 1000/230400) - (120/2500 + 2500/691200) = 1 - 0.115957 = 0.884043.
    assert advice.expected_goodput_current == approx(
        1 - (60 / 1000 + 1000 / (2 * 115_200)) - (120 / 2500 + 2500 / (2 * 345_600))
    )
    rec_local = local.recommended_interval_s or 0
    rec_durable = durable.recommended_interval_s or 0
    assert advice.expected_goodput_recommended == approx(
        1 - expected_waste(rec_local, C, 115_200) - expected_waste(rec_durable, 120, 4 * M)
    )
    assert check_tier_frequencies(10, 20) is None
    assert check_tier_frequencies(10, 100) is None
    assert "20 or 30" in (check_tier_frequencies(10, 25) or "")
    assert "(10 steps)" in (check_tier_frequencies(10, 5) or "")
    with pytest.raises(ValueError, match="subset"):
        advise(
            2.0, TierInput("local", C), durable=TierInput("d", 1), mtbf_s=M, durable_mtbf_s=M / 2
        )


def test_mtbf_estimation() -> None:
    # 3 failures in 72 h: 72 / 3 = 24 h.
    est = estimate_mtbf(3, 72 * 3600)
    assert est.mtbf_s == 24 * 3600
    assert est.enough_data
    for failures in (0, 1):
        few = estimate_mtbf(failures, 72 * 3600)
        assert few.mtbf_s is None
        assert not few.enough_data
        assert few.note.startswith("not enough data")
        assert "at least 2" in few.note
    # Advice without enough data: intervals unknown, a clear warning.
    advice = advise(2.0, TierInput("local", C, 500), mtbf_s=estimate_mtbf(1, 72 * 3600))
    (local,) = advice.tiers
    assert local.recommended_interval_steps is None
    assert advice.expected_goodput_current is None
    assert any("not enough data" in w for w in advice.warnings)


def test_advice_from_a_measured_report() -> None:
    # 100 s steps; local blocking saves of 6 s every 6 steps; 4 failures, each followed
    # by a restart from the latest local checkpoint.
    recs: list[Record] = [JobStarted(0)]
    t, step = 0.0, 0
    for _ in range(4):
        for _ in range(60):
            t += 100
            step += 1
            recs.append(StepReported(step, t))
            if step % 6 == 0:
                t += 6
                recs.append(CheckpointSaved(step, t, 6, "local", blocking=True))
        saved = step - step % 6
        recs += [FailureDetected(t + 10, t + 5), JobStarted(t + 60)]
        recs.append(CheckpointLoaded(saved, t + 70, 10, "local"))
        t += 70
    report = compute_goodput(Timeline.from_records(recs))
    assert_sums_to_wall(report)
    assert report.failures == 4
    assert report.step_time_s == approx(100)
    advice = advise_from_report(report)
    (local,) = advice.tiers
    assert local.save_cost_s == 6  # mean blocking save
    assert local.current_interval_steps == 6
    assert advice.mtbf_s == approx(report.wall_s / 4)  # wall / failures
    assert local.daly_interval_s == approx(daly_interval(6, report.wall_s / 4))
    text = render_advice_text(advice)
    assert "Expected goodput" in text
    json.dumps(advice_to_dict(advice))


def test_advice_takes_a_pytorch_jobs_ram_tier_as_its_fast_tier() -> None:
    recs: list[Record] = [JobStarted(0)]
    t = 0.0
    for step in range(1, 401):
        t += 10
        recs.append(StepReported(step, t))
        if step % 10 == 0:
            recs.append(CheckpointSaved(step, t, 0.5, "ram", blocking=True))
        if step % 100 == 0:
            recs.append(CheckpointSaved(step, t, 0.0, "durable", blocking=True))
    advice = advise_from_report(compute_goodput(Timeline.from_records(recs)), mtbf_s=36_000)
    ram = advice.tier("ram")
    assert ram is not None and ram.save_cost_s == 0.5 and ram.current_interval_steps == 10
    assert advice.tier("durable") is not None


def test_ramdisk_sizing() -> None:
    # 70e9 params x 12 B = 840e9 B; / 16 hosts = 52.5e9; x 2 = 105e9; x 1.15 = 120.75e9.
    assert ramdisk_size_bytes(70e9, 16) == 120_750_000_000
    assert ramdisk_size_bytes(70e9, 16, buffer=0.10) == 115_500_000_000  # 105e9 x 1.10
    # GKE's own example: 32 hosts -> 26.25 GB shard, 52.5 GB, x 1.15 = 60.375 GB.
    sizing = ramdisk_sizing(70_000_000_000, 32)
    assert sizing.checkpoint_bytes == 840_000_000_000
    assert sizing.shard_bytes == 26_250_000_000
    assert sizing.double_buffered_bytes == 52_500_000_000
    assert sizing.size_bytes == 60_375_000_000
    assert sizing.size_mib == math.ceil(60_375_000_000 / 2**20)  # 57579 Mi
    assert ramdisk_size_bytes(1, 3, buffer=0) == 8  # 2 x 12 / 3, exact
    assert ramdisk_size_bytes(1, 7, buffer=0) == 4  # 24 / 7 = 3.43, rounded up
    for bad in ((0, 16), (70e9, 0), (-1, 16)):
        with pytest.raises(ValueError):
            ramdisk_size_bytes(*bad)
    with pytest.raises(ValueError):
        ramdisk_size_bytes(70e9, 16, buffer=-0.1)
    assert "--mtc-ramdisk-size=57579Mi" in render_ramdisk_text(sizing)
    assert ramdisk_to_dict(sizing)["size_bytes"] == 60_375_000_000


# --- rendering ----------------------------------------------------------------------------


def test_text_and_dict_rendering() -> None:
    report = goodput_from_calculator_log(calculator_events(), 1.0)
    text = render_goodput_text(report)
    assert "Goodput of job llama: 56.6%" in text
    assert "lost progress" in text
    assert "The calculator's goodput: 56.60%" in text
    assert text.splitlines()[-1].startswith("note:")
    data = goodput_to_dict(report)
    assert json.loads(json.dumps(data)) == data
    assert data["goodput_percent"] == approx(300 / 530 * 100)
    assert data["badput"]["remediation_s"] == approx(100)
    assert data["calculator"]["step_diff"] == 300
    assert set(data["badput"]) == set(report.badput.as_dict())

    advice = advise(2.0, TierInput("local", C, 500), mtbf_s=M)
    advice_dict = advice_to_dict(advice)
    assert json.loads(json.dumps(advice_dict)) == advice_dict
    assert advice_dict["tiers"][0]["recommended_interval_steps"] == 1590
    text = render_advice_text(advice)
    assert "1590 (53m 00s)" in text
    assert "Young T = sqrt(2*C*M)" in text


def test_advice_from_an_calculator_log_needs_the_save_cost() -> None:
    report = goodput_from_calculator_log(calculator_events(), 1.0)
    # The log has no save durations: without a cost there is nothing to optimise.
    bare = advise_from_report(report)
    assert bare.tiers == ()
    assert any("no save duration measured" in w for w in bare.warnings)
    # With a cost, its single tier ("unknown", saved every 100 steps) is advised on; one
    # failure is not enough for an MTBF.
    advice = advise_from_report(report, local_save_cost_s=5)
    (tier,) = advice.tiers
    assert (tier.name, tier.current_interval_steps, tier.save_cost_s) == ("unknown", 100, 5)
    assert any("not enough data: 1 failure(s)" in w for w in advice.warnings)
    # Given an MTBF of 2 h: Daly(5, 7200) = 268.3 s -> 268 steps of 1 s.
    given = advise_from_report(report, local_save_cost_s=5, mtbf_s=7200)
    assert given.tiers[0].recommended_interval_steps == round(daly_interval(5, 7200))
