"""Durable saves by the wall clock (`multi_tier_checkpointing_backup_interval_minutes`)
beside the step interval: at the first RAM step past each boundary of the interval's
grid, the same step on every rank without a collective, and committed by a real
Checkpointer."""

from __future__ import annotations

from pathlib import Path

import pytest

from resiliency_protocol.clock import wall_clock
from tests.test_checkpoint_tiers import small_checkpointer
from training.checkpoint import CheckpointSettings
from training.checkpoint import format as fmt
from training.checkpoint.schedule import SaveSchedule

#: A grid boundary every minute; steps of 7 s; RAM every 2 steps.
MINUTE = 60.0
STEP_S = 7.0


class Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def settings(tmp_path: Path, **changes: object) -> CheckpointSettings:
    values: dict[str, object] = {
        "in_memory_checkpointing_freq": 2,
        "s3_checkpointing_freq": 0,
        "multi_tier_checkpointing_backup_interval_minutes": 1.0,
        "durable_dir": tmp_path / "durable",
        "ram_dir": tmp_path / "ram",
    }
    values.update(changes)
    return CheckpointSettings(**values)  # type: ignore[arg-type]


def durable_steps(schedule: SaveSchedule, clock: Clock, start: float, steps: int) -> list[int]:
    """Steps a rank saves durably when step `s` completes at `start + s * STEP_S`."""
    saved = []
    for step in range(1, steps + 1):
        clock.now = start + step * STEP_S
        ram, durable = schedule.due(step)
        assert ram == (step % 2 == 0)
        if durable:
            saved.append(step)
    return saved


def test_a_durable_save_at_the_first_ram_step_past_each_boundary(tmp_path: Path) -> None:
    clock = Clock(10 * MINUTE + 1.0)
    schedule = SaveSchedule(settings(tmp_path), clock=clock)
    saved = durable_steps(schedule, clock, 10 * MINUTE + 1.0, 40)
    # Boundaries at 11:00, 12:00, ...: crossed during steps 9, 18, 26, 35 (7 s each);
    # the first RAM step at or after each: 10, 18, 26, 36.
    assert saved == [10, 18, 26, 36]


def test_the_step_interval_still_saves_and_counts_for_its_slot(tmp_path: Path) -> None:
    clock = Clock(10 * MINUTE + 1.0)
    schedule = SaveSchedule(settings(tmp_path, s3_checkpointing_freq=4), clock=clock)
    saved = durable_steps(schedule, clock, 10 * MINUTE + 1.0, 20)
    # Every 4th step by steps; besides, the first RAM step of each new slot of the grid
    # (10 after 11:00, 18 after 12:00), since no step-interval save came first in it.
    assert saved == [4, 8, 10, 12, 16, 18, 20]


def test_ranks_with_skewed_clocks_save_the_same_steps(tmp_path: Path) -> None:
    """Each rank reads its own clock (50 ms apart) at the same step: the same steps."""
    start = 10 * MINUTE + 1.0
    seen = []
    for skew in (0.0, 0.05, -0.05):
        clock = Clock(start + skew)
        schedule = SaveSchedule(settings(tmp_path), clock=clock)
        seen.append(durable_steps(schedule, clock, start + skew, 60))
    assert seen[0] == seen[1] == seen[2] == [10, 18, 26, 36, 44, 52, 60]


def test_ranks_split_by_a_boundary_meet_again_at_the_next(tmp_path: Path) -> None:
    """A boundary inside the ranks' skew: one interval's durable step differs between
    them (a restore never loads it: not every rank holds it); the next one is the same."""
    # Step 10 (a RAM step) completes at 11:00 minus 10 ms on one rank, plus 10 ms on the
    # other: only the second crosses the boundary there; the first does at step 12.
    start = 11 * MINUTE - 10 * STEP_S - 0.01
    early, late = Clock(start), Clock(start + 0.02)
    first = durable_steps(SaveSchedule(settings(tmp_path), clock=early), early, start, 30)
    second = durable_steps(SaveSchedule(settings(tmp_path), clock=late), late, start + 0.02, 30)
    assert (first, second) == ([2, 12, 20, 28], [2, 10, 20, 28])


def test_a_replicated_models_other_ranks_write_no_durable_copy(tmp_path: Path) -> None:
    clock = Clock(10 * MINUTE + 1.0)
    schedule = SaveSchedule(settings(tmp_path), writes_durable=False, clock=clock)
    assert durable_steps(schedule, clock, 10 * MINUTE + 1.0, 40) == []


def test_the_setting_is_refused_without_what_it_needs(tmp_path: Path) -> None:
    name = "multi_tier_checkpointing_backup_interval_minutes"
    with pytest.raises(ValueError, match=f"{name}=1.0 needs the RAM tier"):
        settings(tmp_path, in_memory_checkpointing_freq=0)
    with pytest.raises(ValueError, match=f"{name}=1.0 needs durable_dir or durable_url"):
        settings(tmp_path, durable_dir=None)
    with pytest.raises(ValueError, match=f"{name} must be >= 0"):
        settings(tmp_path, multi_tier_checkpointing_backup_interval_minutes=-1)
    with pytest.raises(ValueError, match=f"{name.upper()} must be a number"):
        CheckpointSettings.from_env({name.upper(): "half an hour"})
    env = {
        name.upper(): "30",
        "S3_CHECKPOINTING_FREQ": "0",
        "CHECKPOINT_DURABLE_DIR": str(tmp_path / "durable"),
    }
    assert CheckpointSettings.from_env(env).multi_tier_checkpointing_backup_interval_minutes == 30


def test_a_checkpointer_commits_durable_steps_by_the_clock(tmp_path: Path) -> None:
    """Durable by time only (no step interval): the Checkpointer opens the durable tier and
    commits the first RAM step past each boundary there."""
    start = 10 * MINUTE + 1.0
    clock = Clock(start)
    with wall_clock(clock):
        ckpt = small_checkpointer(
            tmp_path,
            in_memory_checkpointing_freq=2,
            s3_checkpointing_freq=0,
            multi_tier_checkpointing_backup_interval_minutes=1.0,
            enable_async_ckpt=False,
            topk_ckpt=5,
        )
        try:
            for step in range(1, 21):
                clock.now = start + step * STEP_S
                ckpt.step_done(step)
        finally:
            ckpt.close()
    assert fmt.committed_steps(tmp_path / "durable", 0) == [10, 18]
    assert [r.step for r in ckpt.save_results if r.tier == "durable"] == [10, 18]
    assert all(r.error is None for r in ckpt.save_results)
