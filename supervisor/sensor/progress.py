"""Per-job step progress and the hang timeout learned from it.

Like NVRx, the timeout is learned: the longest interval seen between two observed step
advances, times a safety factor, never below a floor. The first few intervals (warm-up,
compilation, data loader start) are not watched, nor those after each restart (the
workers start, rendezvous and load a checkpoint again). A fixed timeout can be set instead.

An interval during which a worker left its loop (said it was finishing, stopped or exited)
is no step interval: it holds the job's end (a last save, hashing the weights, the output),
or a failure's. It is not learned from, nor counted in a warm-up (`ended`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class HangParams:
    fixed_timeout_s: float | None
    min_timeout_s: float
    safety_factor: float
    warmup_intervals: int


@dataclass(slots=True)
class JobProgress:
    params: HangParams
    max_step: int = -1
    last_progress: float = 0.0  # event-loop time of the last step advance
    intervals_seen: int = 0
    longest_interval_s: float = 0.0
    node_steps: dict[str, int] = field(default_factory=dict)
    # Step intervals still to pass, after a restart, before hangs are watched again.
    unwatched_intervals: int = 0
    # The interval now open (since `last_progress`) saw a worker leave its loop.
    open_interval_ended: bool = False

    @property
    def learned(self) -> bool:
        return self.params.fixed_timeout_s is None

    @property
    def warmed_up(self) -> bool:
        return self.intervals_seen >= self.params.warmup_intervals

    @property
    def watching(self) -> bool:
        """Whether hangs are detected yet (past the warm-up, and the one after a restart)."""
        return self.max_step >= 0 and self.warmed_up and not self.unwatched_intervals

    @property
    def learned_interval_s(self) -> float | None:
        """What was learned, to persist: the longest interval (None during the warm-up,
        and with a fixed timeout, which learns nothing)."""
        if self.params.fixed_timeout_s is not None or not self.warmed_up:
            return None
        return self.longest_interval_s

    def relearn(self, interval_s: float | None) -> None:
        """Take back what an earlier run of the supervisor learned (`learned_interval_s`):
        past the warm-up, the timeout no lower than it was."""
        if interval_s is not None:
            self.intervals_seen = max(self.intervals_seen, self.params.warmup_intervals)
            self.longest_interval_s = max(self.longest_interval_s, interval_s)

    @property
    def timeout_s(self) -> float:
        if self.params.fixed_timeout_s is not None:
            return self.params.fixed_timeout_s
        return max(self.params.min_timeout_s, self.params.safety_factor * self.longest_interval_s)

    def restarted(self) -> None:
        """The job's workers were started again: its next intervals are a warm-up."""
        self.unwatched_intervals = self.params.warmup_intervals

    def ended(self) -> None:
        """A worker of the job left its loop (finishing, stopped, exited): the interval now
        open, up to the next advance, is no step interval."""
        self.open_interval_ended = True

    def observe(self, node: str, step: int, now: float, ending: bool = False) -> bool:
        """Record the newest step a node reports. True when the job advanced. `ending`: the
        job is in its end phase, so the interval this closes is no step interval."""
        previous = self.node_steps.get(node)
        self.node_steps[node] = step
        if step < self.max_step and (previous is None or step < previous):
            # The job was restarted from a checkpoint (a node going back, or a node that
            # just joined, e.g. a hot-swapped spare, behind the others): measure afresh.
            self.max_step = step
            self.last_progress = now
            self.open_interval_ended = False  # measured afresh from here
            return True
        if step <= self.max_step:
            return False
        if self.open_interval_ended or ending:
            self.open_interval_ended = False
        elif self.max_step >= 0:
            interval = now - self.last_progress
            if self.unwatched_intervals:
                self.unwatched_intervals -= 1
            elif self.intervals_seen >= self.params.warmup_intervals:
                self.longest_interval_s = max(self.longest_interval_s, interval)
            self.intervals_seen += 1
        self.max_step = step
        self.last_progress = now
        return True

    def forget(self, node: str) -> None:
        self.node_steps.pop(node, None)

    def laggard(self) -> tuple[str, int] | None:
        """The node with the lowest reported step, when nodes disagree."""
        if len(self.node_steps) < 2:
            return None
        node, step = min(self.node_steps.items(), key=lambda item: (item[1], item[0]))
        return (node, step) if step < self.max_step else None
