"""When each tier is due: RAM every `in_memory_checkpointing_freq` steps; durable every
`s3_checkpointing_freq` steps and, with `multi_tier_checkpointing_backup_interval_minutes`,
also by the wall clock.

A durable save is a copy of a RAM save of the same step, so a durable save by time is
taken at a RAM step too: the first one that completes past a boundary of the interval's
grid on the wall clock (Unix time divided into intervals: 00:00, 00:30, 01:00, ... for 30
minutes). Every rank decides alone, without a collective, from its own clock at the
same step. The grid, not the time since the last save, is what keeps them together: ranks
step in lockstep (each step ends in the same collectives) and their clocks agree to a few
milliseconds, so they cross a boundary at the same RAM step unless it falls inside that
skew. When it does, one interval's durable step is missing on some ranks (never loaded:
a restore takes the newest step every rank holds), and the ranks meet again at the next
boundary, since no rank's schedule drifts from where the last save left it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from resiliency_protocol.clock import wall_time
from training.checkpoint.settings import CheckpointSettings


class SaveSchedule:
    """Which tiers a step is due in, for one rank."""

    def __init__(
        self,
        settings: CheckpointSettings,
        *,
        writes_durable: bool = True,
        clock: Callable[[], float] = wall_time,
    ) -> None:
        self.ram_every = settings.in_memory_checkpointing_freq
        # A replicated model's durable copy is one rank's: the others write none.
        self.durable_every = settings.s3_checkpointing_freq if writes_durable else 0
        minutes = settings.multi_tier_checkpointing_backup_interval_minutes
        self.interval_s = minutes * 60.0 if writes_durable else 0.0
        self.clock = clock
        #: The grid's interval this rank's last durable save (or its start) fell in.
        self._last_slot = self._slot()

    def _slot(self) -> int:
        return math.floor(self.clock() / self.interval_s) if self.interval_s else 0

    def due(self, step: int) -> tuple[bool, bool]:
        """(RAM due, durable due) at `step`, just completed."""
        ram = bool(self.ram_every) and step % self.ram_every == 0
        by_steps = bool(self.durable_every) and step % self.durable_every == 0
        by_time = False
        if self.interval_s and ram:
            slot = self._slot()
            by_time = slot > self._last_slot
        durable = by_steps or by_time
        if durable and self.interval_s:
            self._last_slot = self._slot()
        return ram, durable
