"""Straggler detection: the real Sensor, fed heartbeats whose workers report compute times.

Each rank's compute time per report is a base time with jitter (a lognormal of `jitter`:
a report is a mean over the steps of one heartbeat period, so this is the jitter of that
mean). After a warm-up of a few windows one rank slows by a factor; the time until the
`straggler` event is measured, as a multiple of `straggler_window_s` (a rank must stay
slow for one window before it is reported, by design). A fault-free run of many windows,
with the whole job slowing down half-way (a slow data loader), counts false reports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass

from supervisor.config import Settings
from supervisor.domain import EventType, NodeState, WorkerState
from supervisor.sensor import Changes, HostHeartbeat, Sensor, WorkerReport

RANKS_PER_NODE = 8


@dataclass(frozen=True, slots=True)
class StragglerConfig:
    ranks: int
    period_s: float = 0.05
    window_s: float = 1.0
    threshold: float = 1.1
    base_s: float = 0.1
    jitter: float = 0.05
    warmup_windows: float = 2.0
    seed: int = 1


def _heartbeats(
    config: StragglerConfig, rng: random.Random, slow: dict[int, float], step: int
) -> list[HostHeartbeat]:
    out = []
    for first in range(0, config.ranks, RANKS_PER_NODE):
        workers = [
            WorkerReport(
                rank=rank,
                local_rank=rank - first,
                pid=1000 + rank,
                state=WorkerState.RUNNING,
                step=step,
                compute_s=config.base_s
                * slow.get(rank, slow.get(-1, 1.0))
                * rng.lognormvariate(0.0, config.jitter),
            )
            for rank in range(first, min(first + RANKS_PER_NODE, config.ranks))
        ]
        out.append(
            HostHeartbeat(
                node=f"node-{first // RANKS_PER_NODE}",
                state=NodeState.RUNNING,
                job="bench",
                workers=workers,
            )
        )
    return out


async def _run(
    config: StragglerConfig, factor: float | None, duration_windows: float
) -> tuple[float | None, int]:
    """(seconds from the slowdown to the event, or None; straggler events in all)."""
    events: list[tuple[float, EventType]] = []
    loop = asyncio.get_running_loop()

    def emit(changes: Changes) -> None:
        events.extend((loop.time(), e.type) for e in changes.events)

    settings = Settings(
        heartbeat_polling_period_s=config.period_s,
        heartbeat_timeout_s=60.0,
        straggler_window_s=config.window_s,
        straggler_threshold=config.threshold,
    )
    sensor = Sensor(settings.sensing, settings.workload, emit)
    rng = random.Random(config.seed)
    slow: dict[int, float] = {}
    victim = rng.randrange(config.ranks)
    started = loop.time()
    slowed_at: float | None = None
    step = 0
    try:
        while loop.time() - started < duration_windows * config.window_s:
            elapsed = (loop.time() - started) / config.window_s
            if factor is not None and slowed_at is None and elapsed >= config.warmup_windows:
                slow[victim] = factor
                slowed_at = loop.time()
            if factor is None and elapsed >= duration_windows / 2:
                slow[-1] = 1.5  # the whole job slows down: no straggler
            step += 1
            for heartbeat in _heartbeats(config, rng, slow, step):
                sensor.ingest(heartbeat)
            if factor is not None and any(t == EventType.STRAGGLER for _, t in events):
                break
            await asyncio.sleep(config.period_s)
    finally:
        sensor.close()
    stragglers = [t for t, kind in events if kind is EventType.STRAGGLER]
    detected = None
    if slowed_at is not None and stragglers:
        detected = stragglers[0] - slowed_at
    return detected, len(stragglers)


def time_to_detect(config: StragglerConfig, factor: float, trials: int = 3) -> list[float | None]:
    """Seconds from one rank's slowdown by `factor` to its `straggler` event, per trial."""
    out = []
    for trial in range(trials):
        trial_config = dataclasses.replace(config, seed=config.seed + trial)
        detected, _ = asyncio.run(_run(trial_config, factor, config.warmup_windows + 6))
        out.append(detected)
    return out


def false_reports(config: StragglerConfig, windows: float = 60.0) -> int:
    """Straggler events over a fault-free run of `windows` windows."""
    _, count = asyncio.run(_run(config, None, windows))
    return count
