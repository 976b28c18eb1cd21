"""Node-loss detection lateness: the real Sensor (deadline queue) against a polling loop.

Lateness of one detection = the time the loss is reported (loop.time() in the callback)
minus (the node's last heartbeat + heartbeat_timeout_s). Both detectors see the same
heartbeat schedule: every node beats once per period with jitter, phases spread over the
period as real agents are; after a warm-up the chosen nodes stop, the rest keep beating.
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec

from bench.loops import run as run_loop
from bench.payload import heartbeat_dict
from bench.stats import summary_ms
from supervisor.config import Settings
from supervisor.domain import EventType
from supervisor.sensor import Changes, HostHeartbeat, Sensor

Ingest = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class DetectionConfig:
    nodes: int
    period_s: float = 0.5
    timeout_s: float = 2.0
    jitter: float = 0.05  # each interval is period x (1 +- jitter)
    stop_fraction: float = 1.0  # nodes that go silent after the warm-up
    warmup_periods: int = 6  # must exceed timeout/period so deadlines reach steady state
    seed: int = 1


@dataclass(frozen=True, slots=True)
class Lateness:
    detector: str
    nodes: int
    stopped: int
    detected: int
    false_alarms: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    gc_full: int = 0  # full (generation 2) collections after the nodes stopped
    gc_full_max_ms: float = 0.0


@contextmanager
def full_gc_pauses() -> Iterator[list[tuple[float, float]]]:
    """Collects (start perf_counter, duration ms) of every generation-2 collection."""
    pauses: list[tuple[float, float]] = []
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((started[0], (time.perf_counter() - started[0]) * 1000))

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


class Driver:
    """Sends every node's heartbeats on its own timer; stops the chosen ones on cue."""

    def __init__(self, config: DetectionConfig, ingest: Ingest) -> None:
        self.config = config
        self.ingest = ingest
        self.loop = asyncio.get_running_loop()
        self.rng = random.Random(config.seed)
        self.last: list[float] = [0.0] * config.nodes
        self.stopped: set[int] = set()
        self.reported: dict[int, float] = {}

    def start(self) -> None:
        period = self.config.period_s
        now = self.loop.time()
        for i in range(self.config.nodes):
            self.loop.call_at(now + self.rng.uniform(0, period), self._beat, i)

    def _beat(self, i: int) -> None:
        if i in self.stopped:
            return
        now = self.loop.time()
        self.last[i] = now
        self.ingest(i)
        spread = self.config.jitter * self.config.period_s
        delay = self.config.period_s + self.rng.uniform(-spread, spread)
        self.loop.call_at(now + delay, self._beat, i)

    def stop_some(self) -> None:
        count = round(self.config.nodes * self.config.stop_fraction)
        self.stopped = set(self.rng.sample(range(self.config.nodes), count))

    def report(self, i: int) -> None:
        """A detector says node i is lost, now."""
        self.reported.setdefault(i, self.loop.time())

    def result(self, detector: str, gc_pauses: list[float]) -> Lateness:
        timeout = self.config.timeout_s
        late = [
            self.reported[i] - (self.last[i] + timeout) for i in self.stopped if i in self.reported
        ]
        return Lateness(
            detector=detector,
            nodes=self.config.nodes,
            stopped=len(self.stopped),
            detected=len(late),
            false_alarms=sum(1 for i in self.reported if i not in self.stopped),
            gc_full=len(gc_pauses),
            gc_full_max_ms=max(gc_pauses, default=0.0),
            **summary_ms(late),
        )


async def _scenario(config: DetectionConfig, driver: Driver) -> list[float]:
    """Warm up, stop the chosen nodes, wait for their losses.

    Returns the full-GC pauses (ms) that began after the nodes stopped: those are the
    ones that can delay a detection.
    """
    with full_gc_pauses() as pauses:
        driver.start()
        await asyncio.sleep(config.warmup_periods * config.period_s)
        driver.stop_some()
        stopped_at = time.perf_counter()
        # Every stopped node's deadline passes within timeout + one period; add slack.
        await asyncio.sleep(config.timeout_s + config.period_s * 1.5 + 0.25)
    return [ms for started, ms in pauses if started >= stopped_at]


async def _sensor_run(config: DetectionConfig) -> Lateness:
    settings = Settings(
        heartbeat_timeout_s=config.timeout_s,
        heartbeat_polling_period_s=config.period_s,
        agent_token="bench-agent-token",
        operator_token="bench-operator-token",
    )
    heartbeats = [msgspec.convert(heartbeat_dict(i, 1), HostHeartbeat) for i in range(config.nodes)]
    index = {hb.node: i for i, hb in enumerate(heartbeats)}
    driver: Driver | None = None

    def emit(changes: Changes) -> None:
        assert driver is not None
        for event in changes.events:
            if event.type is EventType.HOST_HEARTBEAT_LOST and event.node is not None:
                driver.report(index[event.node])

    sensor = Sensor(settings.sensing, settings.workload, emit)

    def ingest(i: int) -> None:
        sensor.ingest(heartbeats[i])  # no events: the same running heartbeat each time

    driver = Driver(config, ingest)
    try:
        pauses = await _scenario(config, driver)
    finally:
        sensor.close()
    return driver.result("sensor (deadline queue)", pauses)


async def _polling_run(config: DetectionConfig) -> Lateness:
    """The approach of Google's resiliency supervisor: scan every node once per polling period."""
    loop = asyncio.get_running_loop()
    last_seen: dict[int, float] = {}
    alive: dict[int, bool] = {}

    def ingest(i: int) -> None:
        last_seen[i] = loop.time()
        alive[i] = True

    driver = Driver(config, ingest)

    async def check() -> None:
        timeout = config.timeout_s
        while True:
            await asyncio.sleep(config.period_s)
            now = loop.time()
            for node, seen in last_seen.items():
                if alive[node] and now - seen > timeout:
                    alive[node] = False
                    driver.report(node)

    checker = asyncio.create_task(check())
    try:
        pauses = await _scenario(config, driver)
    finally:
        checker.cancel()
    return driver.result("polling scan", pauses)


def run(config: DetectionConfig) -> tuple[Lateness, Lateness]:
    """(sensor, polling baseline) for one node count, each on a fresh event loop."""
    results = []
    for scenario in (_sensor_run, _polling_run):
        gc.collect()
        results.append(run_loop(scenario(config)))
    return results[0], results[1]
