"""Runs the real supervisor (sensor, store, controller, policy, actuator) against the
simulated cluster on a virtual clock, once per variant, on the same faults."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from supervisor.config import ConfigError, Settings, load_settings
from supervisor.config_parts import SensingSettings, WorkloadSettings
from supervisor.domain import ActionRecord, Event
from supervisor.goodput.breakdown import compute_goodput
from supervisor.goodput.history import failures_by_incident
from supervisor.goodput.model import GoodputReport, Remediation, Timeline
from supervisor.runtime import Supervisor
from supervisor.sensor import Changes, HostHeartbeat
from supervisor.simulate.backend import SimulatedBackend
from supervisor.simulate.clock import run_virtual
from supervisor.simulate.cluster import Counters, SimulatedCluster
from supervisor.simulate.fault_sources import Fault, map_nodes, read_trace, sample_mix
from supervisor.simulate.scenario import Scenario, ScenarioError
from supervisor.simulate.sensor import SimulatedSensor
from supervisor.store import ActionFilter, EventFilter
from supervisor.store.roles import HistoryPages

log = logging.getLogger(__name__)

#: Loop time 0 of every run is this Unix time (2026-01-01T00:00:00Z): runs repeat exactly.
EPOCH = 1767225600.0
#: What is no business of a simulation, whatever the settings say.
_FORCED: dict[str, Any] = {
    "backend": "dry_run",  # unused: the simulated backend is passed in
    "dry_run": False,
    "leader_election": False,
    "notification_routes": [],
    "history_retention_days": 0,
    "goodput_retention_days": None,
    "enable_fault_injection": False,
}


@dataclass
class RunResult:
    """One variant's run."""

    name: str
    goodput: GoodputReport
    actions: dict[str, dict[str, int]]
    events: dict[str, int]
    counters: Counters
    faults: int
    simulated_s: float
    wall_s: float
    settings: dict[str, Any] = field(default_factory=dict)


def scenario_faults(scenario: Scenario, nodes: Sequence[str]) -> list[Fault]:
    """The scenario's faults on its cluster's nodes: the trace's, then the mix's."""
    faults: list[Fault] = []
    if scenario.trace is not None:
        faults += map_nodes(read_trace(scenario.trace), nodes)
    if scenario.failures is not None:
        mix = scenario.failures
        faults += sample_mix(
            mix.rates,
            per_gpu=mix.per == "gpu_hour",
            nodes=nodes,
            gpus_per_node=scenario.cluster.gpus_per_node,
            duration_s=scenario.duration_s,
            seed=scenario.seed,
            network_outage_s=mix.network_outage_s,
        )
    return sorted(f for f in faults if f.time < scenario.duration_s)


def variant_settings(
    scenario: Scenario, overrides: dict[str, Any], database_url: str, config: Path | None
) -> Settings:
    cluster = scenario.cluster
    values: dict[str, Any] = {**scenario.settings, **overrides}
    values.update(_FORCED)
    values.update(
        database_url=database_url,
        num_dp_replicas=cluster.num_dp_replicas,
        max_num_dp_replicas=cluster.num_dp_replicas,
        min_num_dp_replicas=cluster.min_num_dp_replicas or cluster.num_dp_replicas,
        num_nodes_per_dp=cluster.num_nodes_per_dp,
        # One sample a simulated hour: the simulation keeps its own record of steps.
        goodput_sample_period_s=3600.0,
    )
    try:
        return load_settings(config, **values)
    except ConfigError as exc:
        raise ScenarioError(str(exc)) from None


def run_variant(
    scenario: Scenario,
    faults: Sequence[Fault],
    name: str,
    overrides: dict[str, Any],
    *,
    config: Path | None = None,
) -> RunResult:
    # In memory where the machine has it: the history is the run's, its commits need
    # no disk (on a disk each would wait for the fsync).
    shm = Path("/dev/shm")
    where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="supervisor-simulate-", dir=where) as tmp:
        settings = variant_settings(
            scenario, overrides, f"sqlite:///{Path(tmp) / 'history.db'}", config
        )
        started = time.perf_counter()
        result = run_virtual(_run(scenario, faults, name, settings), epoch=EPOCH)
        result.wall_s = time.perf_counter() - started
        result.settings = {k: settings.model_dump(mode="json")[k] for k in sorted(overrides)}
        return result


async def _run(
    scenario: Scenario, faults: Sequence[Fault], name: str, settings: Settings
) -> RunResult:
    cluster = SimulatedCluster(scenario, faults)
    duration = scenario.duration_s
    horizon = duration + 10 * settings.heartbeat_timeout_s + 1.0

    def sensor(
        settings: SensingSettings, workload: WorkloadSettings, emit: Any, metrics: Any
    ) -> SimulatedSensor:
        return SimulatedSensor(
            settings, workload, emit, metrics, cluster, horizon=horizon, step_s=scenario.job.step_s
        )

    backend = SimulatedBackend(cluster)
    supervisor = Supervisor(settings, backend=backend, sensor=sensor)
    await supervisor.start()

    async def ingest(hb: HostHeartbeat) -> None:
        changes: Changes = supervisor.sensor.ingest(hb)
        if changes:
            await supervisor.record_or_hold(changes)

    async def register(heartbeats: list[HostHeartbeat]) -> None:
        """Every node's first heartbeat, recorded in one transaction."""
        batch = [supervisor.sensor.ingest(hb) for hb in heartbeats]
        await supervisor.record_or_hold(Changes.merged(batch))

    assert isinstance(supervisor.sensor, SimulatedSensor)
    try:
        assert backend.hooks is not None
        await cluster.start(supervisor.sensor, backend.hooks, ingest, register)
        await asyncio.sleep(duration)
        cluster.close(duration)
        events = list(_all(supervisor.store, "events"))
        actions = list(_all(supervisor.store, "actions"))
    finally:
        await supervisor.stop()
    timeline = _timeline(cluster, events, actions, duration)
    report = compute_goodput(timeline, reference_step_time_s=scenario.job.step_s)
    by_action: dict[str, dict[str, int]] = {}
    for action in actions:
        by_action.setdefault(action.type.value, Counter())[action.status.value] += 1
    return RunResult(
        name=name,
        goodput=report,
        actions={k: dict(v) for k, v in sorted(by_action.items())},
        events=dict(sorted(Counter(e.type.value for e in events).items())),
        counters=cluster.counters,
        faults=len(faults),
        simulated_s=duration,
        wall_s=0.0,
    )


def _all(store: HistoryPages, what: str) -> Iterator[Any]:
    cursor: str | None = None
    while True:
        if what == "events":
            page: Any = store.list_events(EventFilter(), cursor, limit=1000)
        else:
            page = store.list_actions(ActionFilter(), cursor, limit=1000)
        yield from page.items
        cursor = page.next_cursor
        if cursor is None:
            return


def _timeline(
    cluster: SimulatedCluster,
    events: Sequence[Event],
    actions: Sequence[ActionRecord],
    end: float,
) -> Timeline:
    """The job's timeline: steps, saves, loads, starts and replicas from the simulated
    job; failures and remediations from what the supervisor recorded (one failure per
    incident, as the live goodput counts them)."""
    records = [r for r in cluster.records if getattr(r, "time", 0.0) <= end]
    starts = sorted(r.time for r in records if type(r).__name__ == "JobStarted")
    failures = [
        replace(f, fault_at=None if f.fault_at is None else max(0.0, f.fault_at))
        for f in failures_by_incident(events, starts, origin=EPOCH)
        if f.detected_at <= end
    ]
    remediations = []
    for action in actions:
        if action.started_at is None:
            continue
        start = action.started_at.timestamp() - EPOCH
        finish = action.finished_at.timestamp() - EPOCH if action.finished_at else end
        if start <= end:
            remediations.append(Remediation(start, min(end, max(start, finish)), action.type.value))
    return Timeline.from_records(
        [*records, *failures, *remediations], job=cluster.job.name, start=0.0, end=end
    )
