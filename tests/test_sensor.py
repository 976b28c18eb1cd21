"""The sensor on a real event loop: heartbeats in, events out (returned or emitted)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from resiliency_protocol.heartbeat import HeartbeatError, decode_heartbeat
from supervisor.config import Settings
from supervisor.domain import (
    Event,
    EventType,
    JobView,
    NodeState,
    NodeView,
    WorkerState,
    WorkerView,
)
from supervisor.sensor import Changes, GpuReport, HostHeartbeat, Sensor, WorkerReport
from supervisor.sensor.sensor import RankClaimed
from tests.timing import scaled

E = EventType
# Generous upper bound for "it happens eventually" on a shared, noisy machine.
PATIENCE_S = 5.0


# --- builders -----------------------------------------------------------------------------


def worker(
    rank: int,
    step: int | None = 10,
    state: str = "running",
    *,
    local_rank: int | None = None,
    exit_code: int | None = None,
) -> WorkerReport:
    return WorkerReport(
        rank=rank,
        local_rank=rank if local_rank is None else local_rank,
        pid=1000 + rank,
        state=WorkerState(state),
        step=step,
        exit_code=exit_code,
    )


def hb(
    node: str = "n1",
    job: str | None = "j1",
    *,
    state: str = "running",
    workers: Iterable[WorkerReport] | None = None,
    gpu: Iterable[GpuReport] = (),
) -> HostHeartbeat:
    if workers is None:
        workers = [] if job is None else [worker(0)]
    return HostHeartbeat(
        node=node,
        state=NodeState(state),
        job=job,
        workers=list(workers),
        gpu_reports=list(gpu),
    )


def stepping(node: str, step: int, ranks: Iterable[int] = (0,)) -> HostHeartbeat:
    return hb(node, workers=[worker(r, step, local_rank=i) for i, r in enumerate(ranks)])


def xid(code: int, gpu: int | None = 0) -> GpuReport:
    return GpuReport(kind="xid", code=code, gpu=gpu, message=f"Xid {code}")


def ecc(count: int, gpu: int | None = 0) -> GpuReport:
    return GpuReport(kind="ecc", count=count, gpu=gpu)


def types(events: Iterable[Event]) -> list[EventType]:
    return [e.type for e in events]


# --- harness ------------------------------------------------------------------------------


class Emitted:
    """The sensor's `emit` callback: collects timer-driven changes."""

    def __init__(self) -> None:
        self.changes: list[Changes] = []

    def __call__(self, changes: Changes) -> None:
        self.changes.append(changes)

    @property
    def events(self) -> list[Event]:
        return [e for c in self.changes for e in c.events]

    def of(self, type_: EventType) -> list[Event]:
        return [e for e in self.events if e.type is type_]


async def until(predicate: Callable[[], bool], patience: float = PATIENCE_S) -> None:
    """Wait (polling) until `predicate()` holds; fail after `patience` seconds (scaled)."""
    give_up = now() + scaled(patience)
    while not predicate():
        if now() > give_up:
            raise AssertionError(f"condition not met within {scaled(patience):g} s")
        await asyncio.sleep(0.005)


class Pump:
    """Sends heartbeats every `period` seconds in the background, like host monitors.

    `beat(tick)` returns the heartbeats to send on that tick; what `ingest` returned is kept.
    """

    def __init__(
        self,
        sensor: Sensor,
        beat: Callable[[int], Iterable[HostHeartbeat]],
        period: float = 0.02,
    ) -> None:
        self.sensor = sensor
        self.beat = beat
        self.period = period
        self.changes: list[Changes] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def events(self) -> list[Event]:
        return [e for c in self.changes for e in c.events]

    async def _run(self) -> None:
        tick = 0
        while True:
            for heartbeat in self.beat(tick):
                self.changes.append(self.sensor.ingest(heartbeat))
            tick += 1
            await asyncio.sleep(self.period)

    def start(self) -> Pump:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


SensorFactory = Callable[..., tuple[Sensor, Emitted]]


@pytest.fixture
async def make_sensor(make_settings: Callable[..., Settings]) -> AsyncIterator[SensorFactory]:
    made: list[Sensor] = []

    def build(**overrides: Any) -> tuple[Sensor, Emitted]:
        values: dict[str, Any] = {
            "heartbeat_polling_period_s": 0.01,
            "heartbeat_timeout_s": 0.15,
        }
        values.update(overrides)
        emitted = Emitted()
        settings = make_settings(**values)
        sensor = Sensor(settings.sensing, settings.workload, emitted)
        made.append(sensor)
        return sensor, emitted

    yield build
    for sensor in made:
        sensor.close()


def now() -> float:
    return asyncio.get_running_loop().time()


# --- registration -------------------------------------------------------------------------


async def test_first_heartbeat_of_running_node_raises_nothing_but_persists_node(
    make_sensor: SensorFactory,
) -> None:
    sensor, emitted = make_sensor()
    changes = sensor.ingest(hb("n1", "j1", workers=[worker(0, 5), worker(1, 5)]))

    assert changes.events == []
    [node] = changes.nodes
    assert (node.name, node.state, node.job, node.alive) == ("n1", NodeState.RUNNING, "j1", True)
    assert [w.rank for w in node.workers] == [0, 1]
    assert node.last_heartbeat is not None and node.last_heartbeat.tzinfo is not None
    [job] = changes.jobs
    assert job.name == "j1" and job.nodes == ("n1",)

    # The same heartbeat again changes nothing worth persisting.
    again = sensor.ingest(hb("n1", "j1", workers=[worker(0, 5), worker(1, 5)]))
    assert not again
    # A second node of the known job persists the node but not the job again.
    second = sensor.ingest(hb("n2", "j1", workers=[worker(2, 5)]))
    assert second.events == [] and [n.name for n in second.nodes] == ["n2"]
    assert second.jobs == []
    job_view = sensor.job_view("j1")
    assert job_view is not None and job_view.nodes == ("n1", "n2")
    assert emitted.changes == []


async def test_spare_raises_spare_available(make_sensor: SensorFactory) -> None:
    sensor, _ = make_sensor()
    changes = sensor.ingest(hb("s1", None, state="spare"))
    [event] = changes.events
    assert event.type is E.SPARE_AVAILABLE
    assert event.node == "s1" and event.job is None
    assert [n.name for n in changes.nodes] == ["s1"]
    view = sensor.node_view("s1")
    assert view is not None and view.is_usable_spare

    # Staying a spare raises nothing more.
    assert sensor.ingest(hb("s1", None, state="spare")).events == []


async def test_running_node_turning_spare_raises_spare_available(
    make_sensor: SensorFactory,
) -> None:
    sensor, _ = make_sensor()
    sensor.ingest(hb("n1", "j1"))
    changes = sensor.ingest(hb("n1", None, state="spare"))
    assert types(changes.events) == [E.SPARE_AVAILABLE]
    view = sensor.node_view("n1")
    assert view is not None and view.state is NodeState.SPARE and view.job is None
    job = sensor.job_view("j1")
    assert job is not None and job.nodes == ()


# --- node liveness ------------------------------------------------------------------------


async def test_silent_node_is_lost_once_after_timeout(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.1)
    before_wall = datetime.now(UTC)
    # Read before the heartbeat is taken: its deadline runs from a clock read inside
    # `ingest`, which a loaded machine may take milliseconds to return from.
    sent_at = now()
    sensor.ingest(hb("n1", "j1"))

    await until(lambda: bool(emitted.events))
    lost_at = now()
    await asyncio.sleep(0.3)  # room for a (wrong) second event

    [event] = emitted.events
    assert event.type is E.HOST_HEARTBEAT_LOST
    assert (event.node, event.job, event.fault_id) == ("n1", "j1", None)
    assert lost_at - sent_at >= 0.1
    assert event.details["lateness_ms"] >= 0
    assert event.details["heartbeat_timeout_s"] == 0.1
    last = datetime.fromisoformat(event.details["last_heartbeat"])
    assert before_wall - timedelta(seconds=1) <= last <= datetime.now(UTC)
    # The node's new state is handed over for persistence with the event.
    [node] = emitted.changes[0].nodes
    assert node.name == "n1" and not node.alive
    view = sensor.node_view("n1")
    assert view is not None and not view.alive


async def test_heartbeats_keep_node_alive(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.15)
    pump = Pump(sensor, lambda _: [hb("n1", "j1")]).start()
    await asyncio.sleep(0.6)  # four heartbeat timeouts
    assert emitted.events == []
    assert pump.events == []
    await pump.stop()

    await until(lambda: bool(emitted.events))
    assert types(emitted.events) == [E.HOST_HEARTBEAT_LOST]


async def test_a_steady_node_is_lost_one_timeout_after_its_last_heartbeat(
    make_sensor: SensorFactory,
) -> None:
    """Steady heartbeats move the loss deadline without re-arming a timer: the loss is
    due at the last of them plus the timeout, and reported as such."""
    from supervisor.sensor.sensor import UNCHANGED

    sensor, emitted = make_sensor(heartbeat_timeout_s=0.2)
    sensor.ingest(stepping("n1", 1))
    step, stop = 1, now() + 0.6  # three timeouts of steady heartbeats
    learned = 0
    while now() < stop:
        step += 1
        changes = sensor.ingest(stepping("n1", step))
        if changes is not UNCHANGED:  # only the job's learned step interval, to persist
            assert changes.events == [] and changes.nodes == []
            [job] = changes.jobs
            assert job.step_interval_s == sensor._jobs["j1"].progress.longest_interval_s
            learned += 1
        last, last_wall = now(), datetime.now(UTC)
        await asyncio.sleep(0.02)
    assert emitted.events == []
    assert learned < (step - 1) / 2  # a new longest interval now and then, not every step

    await until(lambda: bool(emitted.events))
    lost_at = now()
    [event] = emitted.events
    assert event.type is E.HOST_HEARTBEAT_LOST
    assert lost_at >= last + 0.2
    reported = datetime.fromisoformat(event.details["last_heartbeat"])
    assert abs((reported - last_wall).total_seconds()) < 0.005
    assert 0 <= event.details["lateness_ms"] < 1000 * (lost_at - last - 0.2) + 5


async def test_a_nodes_silence_counts_from_when_its_heartbeat_was_answered(
    make_sensor: SensorFactory,
) -> None:
    """A host monitor sends its next heartbeat once the last one is answered. When the
    supervisor took a while to record what a heartbeat changed (a first heartbeat, a slow
    commit), the node's loss is due one timeout after the answer: the time it had to send
    again, not the time the supervisor spent."""
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.3)
    sensor.ingest(stepping("n1", 1))  # a new node: its record is committed, then answered
    await asyncio.sleep(0.2)  # the commit
    answered_wall = datetime.now(UTC)
    answered = now()
    sensor.answered("n1")
    await until(lambda: bool(emitted.events))
    [event] = emitted.events
    assert event.type is E.HOST_HEARTBEAT_LOST
    assert now() >= answered + 0.3
    reported = datetime.fromisoformat(event.details["last_heartbeat"])
    assert reported >= answered_wall - timedelta(milliseconds=5), (reported, answered_wall)


async def test_lost_node_that_comes_back_raises_node_recovered(
    make_sensor: SensorFactory,
) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.08)
    sensor.ingest(hb("n1", "j1"))
    await until(lambda: bool(emitted.events))

    changes = sensor.ingest(hb("n1", "j1"))
    [event] = changes.events
    assert event.type is E.NODE_RECOVERED
    assert (event.node, event.job) == ("n1", "j1")
    assert event.details["state"] == "running"
    assert "was_flapping" not in event.details
    [node] = changes.nodes
    assert node.alive
    # Once back, it is watched again.
    await until(lambda: len(emitted.events) == 2)
    assert types(emitted.events) == [E.HOST_HEARTBEAT_LOST, E.HOST_HEARTBEAT_LOST]


async def test_flapping_node_is_reported_once_then_quiet_then_recovered(
    make_sensor: SensorFactory,
) -> None:
    window = 0.8
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.1, flap_max_losses=3, flap_window_s=window)
    returned: list[Event] = []
    sensor.ingest(hb("n1", "j1"))

    def is_down() -> bool:
        view = sensor.node_view("n1")
        return view is not None and not view.alive

    # Losses 1 and 2 are plain losses, each followed by a recovery.
    for i in (1, 2):
        await until(is_down)
        assert len(emitted.events) == i
        returned.extend(sensor.ingest(hb("n1", "j1")).events)
    assert types(emitted.events) == [E.HOST_HEARTBEAT_LOST] * 2
    assert types(returned) == [E.NODE_RECOVERED] * 2

    # Loss 3 within the window: flapping, reported once.
    await until(is_down)
    assert types(emitted.events) == [E.HOST_HEARTBEAT_LOST] * 2 + [E.NODE_FLAPPING]
    flap = emitted.events[-1]
    assert flap.node == "n1" and flap.details["losses"] == 3
    assert flap.details["window_s"] == window
    view = sensor.node_view("n1")
    assert view is not None and view.flapping and not view.is_usable_spare

    # Further recoveries and losses raise nothing: no event storm.
    for _ in range(2):
        changes = sensor.ingest(hb("n1", "j1"))
        assert changes.events == []
        assert [n.alive for n in changes.nodes] == [True]  # still persisted
        await until(is_down)
    assert len(emitted.events) == 3

    # Up again and staying up for the whole window: recovered, flagged as was_flapping.
    up_at = now()
    pump = Pump(sensor, lambda _: [hb("n1", "j1")]).start()
    try:
        await until(lambda: bool(pump.events))
    finally:
        await pump.stop()
    recovered = pump.events
    assert types(recovered) == [E.NODE_RECOVERED]
    assert recovered[0].details["was_flapping"] is True
    assert now() - up_at >= window
    assert len(emitted.events) == 3
    view = sensor.node_view("n1")
    assert view is not None and not view.flapping


# --- workers ------------------------------------------------------------------------------


async def test_worker_transitions(make_sensor: SensorFactory) -> None:
    sensor, _ = make_sensor(heartbeat_timeout_s=5.0)

    def beat(state4: str = "running", state5: str = "running") -> HostHeartbeat:
        exit_code = 137 if state4 == "exited" else None
        return hb(
            "n1",
            "j1",
            workers=[
                worker(4, 11, state4, local_rank=0, exit_code=exit_code),
                worker(5, 11, state5, local_rank=1),
            ],
        )

    assert sensor.ingest(beat()).events == []

    exited = sensor.ingest(beat("exited"))
    [event] = exited.events
    assert event.type is E.WORKER_EXITED
    assert (event.node, event.job, event.rank) == ("n1", "j1", 4)
    assert event.details["exit_code"] == 137
    assert event.details["local_rank"] == 0

    # The same exited report again raises nothing new.
    assert sensor.ingest(beat("exited")).events == []

    lost = sensor.ingest(beat("exited", "lost"))
    [event] = lost.events
    assert event.type is E.WORKER_HEARTBEAT_LOST
    assert (event.node, event.job, event.rank) == ("n1", "j1", 5)
    assert event.details["local_rank"] == 1
    assert "exit_code" not in event.details
    assert sensor.ingest(beat("exited", "lost")).events == []


async def test_the_last_steps_of_finished_workers_count_but_never_go_back(
    make_sensor: SensorFactory,
) -> None:
    sensor, _ = make_sensor(heartbeat_timeout_s=5.0)
    sensor.ingest(hb("n1", workers=[worker(0, 10), worker(1, 10, local_rank=1)]))
    # The job ended: the steps sent after the loop's end arrive with the workers stopped.
    done = [worker(0, 12, "stopped"), worker(1, 12, "exited", local_rank=1, exit_code=0)]
    sensor.ingest(hb("n1", workers=done))
    view = sensor.job_view("j1")
    assert view is not None and view.last_step == 12
    # A node whose worker of an older attempt stopped at a lower step is no rollback,
    # nor is a crash's last step.
    sensor.ingest(hb("n2", workers=[worker(2, 4, "stopped")]))
    sensor.ingest(hb("n3", workers=[worker(4, 30, "exited", exit_code=1)]))
    view = sensor.job_view("j1")
    assert view is not None and view.last_step == 12


async def test_a_fault_the_node_refused_claims_no_later_failure(
    make_sensor: SensorFactory,
) -> None:
    sensor, _ = make_sensor(heartbeat_timeout_s=5.0)
    sensor.ingest(hb("n1", workers=[worker(0, 10)]))
    sensor.fault_marks.expect("n1", 7, 60.0)
    sensor.fault_marks.withdraw(7)  # e.g. its worker was already down
    [event] = sensor.ingest(hb("n1", workers=[worker(0, 10, "exited", exit_code=1)])).events
    assert event.type is E.WORKER_EXITED and event.fault_id is None
    # One that was injected claims what follows.
    sensor.ingest(hb("n1", workers=[worker(0, 11)]))
    sensor.fault_marks.expect("n1", 8, 60.0)
    [event] = sensor.ingest(hb("n1", workers=[worker(0, 11, "exited", exit_code=9)])).events
    assert event.fault_id == 8


async def test_worker_exited_in_first_heartbeat_is_reported(make_sensor: SensorFactory) -> None:
    sensor, _ = make_sensor(heartbeat_timeout_s=5.0)
    changes = sensor.ingest(hb("n1", "j1", workers=[worker(0, 3, "exited", exit_code=0)]))
    [event] = changes.events
    assert event.type is E.WORKER_EXITED
    assert event.details["exit_code"] == 0


async def test_worker_restarting_then_exiting_again_is_reported_again(
    make_sensor: SensorFactory,
) -> None:
    sensor, _ = make_sensor(heartbeat_timeout_s=5.0)
    sensor.ingest(hb("n1", "j1", workers=[worker(0, 1)]))
    crash = hb("n1", "j1", workers=[worker(0, 1, "exited", exit_code=1)])
    assert types(sensor.ingest(crash).events) == [E.WORKER_EXITED]
    assert sensor.ingest(hb("n1", "j1", workers=[worker(0, 1, "starting")])).events == []
    assert sensor.ingest(hb("n1", "j1", workers=[worker(0, 2)])).events == []
    assert types(sensor.ingest(crash).events) == [E.WORKER_EXITED]


# --- GPU reports --------------------------------------------------------------------------


async def test_gpu_xid_reported_and_repeats_suppressed(make_sensor: SensorFactory) -> None:
    sensor, _ = make_sensor(heartbeat_timeout_s=5.0, gpu_report_cooldown_s=60.0)
    first = sensor.ingest(hb("n1", "j1", gpu=[xid(79, gpu=3)]))
    [event] = first.events
    assert event.type is E.GPU_XID
    assert (event.node, event.job) == ("n1", "j1")
    assert event.details["code"] == 79
    assert event.details["gpu"] == 3
    assert event.details["message"] == "Xid 79"
    assert "observed_at" in event.details
    # Classified by the XID table: what it means, what it points at, what to do.
    assert event.details["meaning"] == "GPU has fallen off the bus"
    assert (event.details["origin"], event.details["response"]) == ("hardware", "replace_node")

    assert sensor.ingest(hb("n1", "j1", gpu=[xid(79, gpu=3)])).events == []
    assert sensor.ingest(hb("n1", "j1", gpu=[xid(79, gpu=3)])).events == []

    other_code = sensor.ingest(hb("n1", "j1", gpu=[xid(48, gpu=3)]))
    assert [(e.type, e.details["code"]) for e in other_code.events] == [(E.GPU_XID, 48)]
    other_gpu = sensor.ingest(hb("n1", "j1", gpu=[xid(79, gpu=1)]))
    assert [(e.type, e.details["gpu"]) for e in other_gpu.events] == [(E.GPU_XID, 1)]
    # The cooldown is per node.
    n2 = hb("n2", "j1", workers=[worker(1)], gpu=[xid(79, gpu=3)])
    assert types(sensor.ingest(n2).events) == [E.GPU_XID]


async def test_gpu_xid_cooldown_expires(make_sensor: SensorFactory) -> None:
    sensor, _ = make_sensor(heartbeat_timeout_s=5.0, gpu_report_cooldown_s=0.05)
    assert types(sensor.ingest(hb(gpu=[xid(13)])).events) == [E.GPU_XID]
    await asyncio.sleep(0.1)
    assert types(sensor.ingest(hb(gpu=[xid(13)])).events) == [E.GPU_XID]


async def test_gpu_ecc_count_increase(make_sensor: SensorFactory) -> None:
    sensor, _ = make_sensor(heartbeat_timeout_s=5.0)
    first = sensor.ingest(hb(gpu=[ecc(2, gpu=0)]))
    [event] = first.events
    assert event.type is E.GPU_ECC
    assert event.details["new_errors"] == 2 and event.details["count"] == 2

    assert sensor.ingest(hb(gpu=[ecc(2, gpu=0)])).events == []
    assert sensor.ingest(hb(gpu=[ecc(0, gpu=0)])).events == []  # counter reset
    more = sensor.ingest(hb(gpu=[ecc(3, gpu=0)]))
    assert [(e.type, e.details["new_errors"]) for e in more.events] == [(E.GPU_ECC, 3)]
    other = sensor.ingest(hb(gpu=[ecc(3, gpu=0), ecc(1, gpu=1)]))
    assert [(e.details["gpu"], e.details["new_errors"]) for e in other.events] == [(1, 1)]


async def test_injected_gpu_report_carries_fault_id(make_sensor: SensorFactory) -> None:
    sensor, _ = make_sensor(heartbeat_timeout_s=5.0)
    sensor.ingest(hb("n1", "j1"))
    changes = sensor.inject_gpu_report("n1", xid(79), fault_id=42)
    [event] = changes.events
    assert event.type is E.GPU_XID and event.fault_id == 42
    with pytest.raises(KeyError):
        sensor.inject_gpu_report("nope", xid(79), fault_id=43)


# --- hangs --------------------------------------------------------------------------------


async def test_hang_fixed_timeout_names_the_laggard(make_sensor: SensorFactory) -> None:
    # Scaled (tests/timing.py): the pump and the sensor share this event loop, and a stall
    # longer than either timeout in the steady phase reads as a loss or a hang.
    hang_s = scaled(0.2)
    sensor, emitted = make_sensor(
        heartbeat_timeout_s=scaled(0.3), hang_timeout_s=hang_s, hang_warmup_intervals=0
    )
    steps = {"n1": 10, "n2": 10}
    advancing = True

    def beat(tick: int) -> list[HostHeartbeat]:
        if advancing:
            steps["n1"] = steps["n2"] = 10 + tick
        return [stepping("n1", steps["n1"], (0, 1)), stepping("n2", steps["n2"], (3, 2))]

    pump = Pump(sensor, beat).start()
    try:
        await asyncio.sleep(3 * hang_s)  # three hang timeouts of steady progress
        assert emitted.events == []
        assert pump.events == []

        # n2 falls behind, then the whole job stalls.
        advancing = False
        steps["n1"] += 1
        stalled_at = now()
        await until(lambda: bool(emitted.events))
        hang_seen = now()
        await asyncio.sleep(2 * hang_s)  # room for a (wrong) repeat
    finally:
        await pump.stop()

    [event] = emitted.events
    assert event.type is E.HANG
    assert event.job == "j1"
    assert event.node == "n2"
    assert event.rank == 2  # the lowest running rank on the laggard node
    assert event.details["suspect_step"] == steps["n2"]
    assert event.details["last_step"] == steps["n1"]
    assert event.details["hang_timeout_s"] == pytest.approx(hang_s)
    assert event.details["timeout_learned"] is False
    assert event.details["stalled_for_s"] >= hang_s - 1e-3
    assert hang_seen - stalled_at >= hang_s - 0.05  # the last advance came at most a tick later


async def test_hang_reported_again_after_progress_resumes_and_stalls(
    make_sensor: SensorFactory,
) -> None:
    sensor, emitted = make_sensor(
        heartbeat_timeout_s=5.0,
        heartbeat_polling_period_s=1.0,
        hang_timeout_s=0.1,
        hang_warmup_intervals=0,
    )
    sensor.ingest(stepping("n1", 1))
    await until(lambda: len(emitted.events) == 1)
    sensor.ingest(stepping("n1", 1))  # no progress: no new deadline
    sensor.ingest(stepping("n1", 2))
    await until(lambda: len(emitted.events) == 2)
    assert types(emitted.events) == [E.HANG, E.HANG]
    assert [e.details["last_step"] for e in emitted.events] == [1, 2]
    # Nodes agree on the step: no suspect.
    assert emitted.events[0].node is None and emitted.events[0].rank is None


async def test_a_hang_is_reported_though_heartbeats_come_slower_than_the_polling_period(
    make_sensor: SensorFactory,
) -> None:
    # The sensor expects a heartbeat every 10 ms; they come every 40 ms. A node last heard
    # from over 15 ms ago looks silent, so the hang check waits for that node's heartbeat
    # deadline (310 ms later: a phase of 30 ms into the next 40 ms beat, silent again).
    # A node heard from since that wait is no reason to wait again.
    sensor, emitted = make_sensor(
        heartbeat_polling_period_s=0.01,
        heartbeat_timeout_s=0.3,
        hang_timeout_s=0.1,
        hang_warmup_intervals=0,
    )
    step = {"n": 1}
    pump = Pump(
        sensor, lambda _: [stepping("n1", step["n"]), stepping("n2", step["n"], (1,))], 0.04
    ).start()
    try:
        await asyncio.sleep(0.1)
        step["n"] = 2  # one advance, then the job stalls
        # The hang timeout, then one wait for a node's deadline: 0.41 s (without the rule,
        # the check waits again on every deadline it finds a node silent at).
        await until(lambda: bool(emitted.events), patience=3.0)
    finally:
        await pump.stop()
    assert types(emitted.events) == [E.HANG]


async def test_hang_learned_timeout(make_sensor: SensorFactory) -> None:
    sensor, _ = make_sensor(
        heartbeat_timeout_s=5.0,
        heartbeat_polling_period_s=1.0,
        hang_timeout_s=None,
        hang_min_timeout_s=0.05,
        hang_safety_factor=3.0,
        hang_warmup_intervals=2,
    )
    sent: list[float] = []

    def send(step: int) -> None:
        sent.append(now())
        sensor.ingest(stepping("n1", step))

    send(1)
    assert sensor.hang_timeout_s("j1") is None
    await asyncio.sleep(0.3)
    send(2)  # warm-up interval 1 (long: compilation), not learned from
    assert sensor.hang_timeout_s("j1") is None
    await asyncio.sleep(0.01)
    send(3)  # warm-up interval 2; watching from now on
    assert sensor.hang_timeout_s("j1") == pytest.approx(0.05)  # nothing learned yet: the floor
    # Intervals long beside the test's clock read and the sensor's (its own, in `ingest`):
    # a loaded machine has put a millisecond between the two, three once learned.
    await asyncio.sleep(0.1)
    send(4)
    first = sent[3] - sent[2]
    assert sensor.hang_timeout_s("j1") == pytest.approx(3.0 * first, abs=0.015)
    await asyncio.sleep(0.2)
    send(5)
    longest = max(first, sent[4] - sent[3])
    assert sensor.hang_timeout_s("j1") == pytest.approx(3.0 * longest, abs=0.015)
    assert 3.0 * first > 0.05 + 0.015 and 3.0 * longest > 3.0 * first + 0.015


async def test_hang_learned_timeout_never_below_the_floor(make_sensor: SensorFactory) -> None:
    sensor, _ = make_sensor(
        heartbeat_timeout_s=5.0,
        heartbeat_polling_period_s=1.0,
        hang_timeout_s=None,
        hang_min_timeout_s=30.0,
        hang_safety_factor=3.0,
        hang_warmup_intervals=0,
    )
    for step in range(1, 5):
        sensor.ingest(stepping("n1", step))
        await asyncio.sleep(0.01)
    assert sensor.hang_timeout_s("j1") == 30.0


async def test_hang_with_learned_timeout_fires(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(
        heartbeat_timeout_s=5.0,
        heartbeat_polling_period_s=1.0,
        hang_timeout_s=None,
        hang_min_timeout_s=0.1,
        hang_safety_factor=2.0,
        hang_warmup_intervals=0,
    )
    sensor.ingest(stepping("n1", 1))
    stalled_at = now()  # before the step that arms the deadline, from a clock read inside
    sensor.ingest(stepping("n1", 2))
    await until(lambda: bool(emitted.events))
    assert now() - stalled_at >= 0.1
    [event] = emitted.events
    assert event.type is E.HANG and event.job == "j1"
    assert event.details["timeout_learned"] is True
    assert event.details["hang_timeout_s"] == pytest.approx(0.1, abs=2e-3)


# A job's end, as its nodes report it: (node, workers) heartbeats, and _WORK, the end's
# work (hashing, saving). The torch workload says `finishing` first, and its last step
# comes with its exit (flushed by its client's close).
_WORK = None
_ENDS: dict[str, list[tuple[str, list[WorkerReport]] | None]] = {
    "finishing, then exited": [
        ("n1", [worker(0, 4, "finishing"), worker(1, 4, "finishing", local_rank=1)]),
        _WORK,
        ("n1", [worker(r, 5, "exited", local_rank=r, exit_code=0) for r in (0, 1)]),
    ],
    "exited": [_WORK, ("n1", [worker(r, 5, "exited", local_rank=r, exit_code=0) for r in (0, 1)])],
    "stopped": [_WORK, ("n1", [worker(r, 5, "stopped", local_rank=r) for r in (0, 1)])],
    # A node still in its loop while another's worker finishes: its steps span that end.
    "another node finishing": [
        ("n2", [worker(2, 4, "finishing")]),
        _WORK,
        ("n1", [worker(r, 5, local_rank=r) for r in (0, 1)]),
    ],
}


@pytest.mark.parametrize("end", list(_ENDS), ids=list(_ENDS))
async def test_the_time_a_job_takes_to_end_is_no_step_interval(
    make_sensor: SensorFactory, end: str
) -> None:
    """Its final hashing and saving took minutes: learned as a step interval, it made the
    next run's hang timeout as long."""
    sensor, _ = make_sensor(
        heartbeat_timeout_s=5.0,
        hang_timeout_s=None,
        hang_min_timeout_s=0.01,
        hang_safety_factor=2.0,
        hang_warmup_intervals=0,
    )
    for step in range(1, 5):
        sensor.ingest(stepping("n1", step, (0, 1)))
        sensor.ingest(stepping("n2", step, (2,)))
        await asyncio.sleep(0.01)
    before = sensor.job_view("j1")
    assert before is not None and before.step_interval_s is not None
    assert before.step_interval_s < 0.3  # else the end would be no longer than a step
    for beat in _ENDS[end]:
        if beat is None:  # _WORK
            await asyncio.sleep(0.3)
        else:
            sensor.ingest(hb(beat[0], workers=beat[1]))
    after = sensor.job_view("j1")
    assert after is not None and after.last_step == 5  # its last step counts, as progress
    assert after.step_interval_s == before.step_interval_s
    assert sensor.hang_timeout_s("j1") == pytest.approx(2.0 * before.step_interval_s)

    # Restarted, the job's steps are step intervals again.
    sensor.job_restarted("j1")
    sensor.ingest(stepping("n1", 3, (0, 1)))  # back to a checkpoint
    await asyncio.sleep(0.3)
    sensor.ingest(stepping("n1", 4, (0, 1)))
    again = sensor.job_view("j1")
    assert again is not None and again.step_interval_s is not None
    assert again.step_interval_s >= 0.3


async def test_restart_from_checkpoint_is_not_a_hang(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(
        heartbeat_timeout_s=5.0,
        heartbeat_polling_period_s=1.0,
        hang_timeout_s=0.2,
        hang_warmup_intervals=0,
    )
    sensor.ingest(stepping("n1", 100))
    await asyncio.sleep(0.05)
    # Restarted from the step-50 checkpoint; progresses again, but stays below 100 for
    # three hang timeouts.
    for step in range(50, 65):
        sensor.ingest(stepping("n1", step))
        await asyncio.sleep(0.04)
    assert emitted.events == []

    # Progress is measured afresh: a stall after the restart is still a hang.
    await until(lambda: bool(emitted.events))
    [event] = emitted.events
    assert event.type is E.HANG and event.details["last_step"] == 64


async def test_lost_node_disarms_the_jobs_hang_check(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(
        heartbeat_timeout_s=0.1, hang_timeout_s=0.5, hang_warmup_intervals=0
    )
    sensor.ingest(stepping("n2", 10, (1,)))
    armed_at = now()  # the first step arms the job's hang deadline at armed_at + 0.5
    # n1 keeps beating at the same step; n2 goes silent.
    pump = Pump(sensor, lambda _: [stepping("n1", 10, (0,))]).start()
    try:
        await until(lambda: bool(emitted.events))
        await asyncio.sleep(max(0.0, armed_at + 0.9 - now()))  # well past the hang deadline
    finally:
        await pump.stop()
    assert types(emitted.events) == [E.HOST_HEARTBEAT_LOST]
    assert emitted.events[0].node == "n2"


@pytest.mark.parametrize(
    "end", [{"state": "exited", "exit_code": 0}, {"state": "stopped"}], ids=["exited", "stopped"]
)
async def test_a_job_whose_workers_finished_does_not_hang(
    make_sensor: SensorFactory, end: dict[str, Any]
) -> None:
    sensor, emitted = make_sensor(
        heartbeat_timeout_s=0.5, hang_timeout_s=0.1, hang_warmup_intervals=0
    )
    done_at = 5

    def beat(tick: int) -> list[HostHeartbeat]:
        if tick < done_at:
            return [stepping("n1", 10 + tick, (0, 1))]
        # The host monitor stays up and keeps beating; its workers are done.
        return [hb("n1", workers=[worker(r, 10 + done_at - 1, **end) for r in (0, 1)])]

    pump = Pump(sensor, beat).start()
    try:
        await asyncio.sleep(0.02 * done_at + 0.5)  # five hang timeouts after the end
    finally:
        await pump.stop()
    assert emitted.events == []
    if end["state"] == "exited":  # each exit is an event of its own, as it came in
        assert types(pump.events) == [E.WORKER_EXITED, E.WORKER_EXITED]
    else:
        assert pump.events == []


async def test_a_stall_while_a_node_is_silent_is_that_nodes_loss_not_a_hang(
    make_sensor: SensorFactory,
) -> None:
    """The hang timeout is shorter than the heartbeat timeout: the job stalls because a
    node died, and the stall is noticed first. One event, the node's loss, follows."""
    sensor, emitted = make_sensor(
        heartbeat_polling_period_s=0.02,
        heartbeat_timeout_s=0.6,
        hang_timeout_s=0.1,
        hang_warmup_intervals=0,
    )
    steps = {"n1": 10}
    n2_alive = True

    def beat(tick: int) -> list[HostHeartbeat]:
        if n2_alive:
            steps["n1"] = 10 + tick
            return [stepping("n1", steps["n1"], (0,)), stepping("n2", steps["n1"], (1,))]
        return [stepping("n1", steps["n1"], (0,))]  # n1 waits for n2 in a collective

    pump = Pump(sensor, beat).start()
    try:
        await asyncio.sleep(0.2)
        n2_alive = False
        await until(lambda: bool(emitted.events))
        await asyncio.sleep(0.3)  # room for a (wrong) hang after the loss
    finally:
        await pump.stop()
    assert types(emitted.events) == [E.HOST_HEARTBEAT_LOST]
    assert emitted.events[0].node == "n2"


async def test_a_stall_after_a_node_came_back_is_still_a_hang(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(
        heartbeat_polling_period_s=0.02,
        heartbeat_timeout_s=0.6,
        hang_timeout_s=0.1,
        hang_warmup_intervals=0,
    )
    quiet = False

    def beat(tick: int) -> list[HostHeartbeat]:
        beats = [stepping("n1", 10, (0,))]
        if not quiet:
            beats.append(stepping("n2", 10, (1,)))
        return beats

    sensor.ingest(stepping("n1", 9, (0,)))
    pump = Pump(sensor, beat).start()
    try:
        await asyncio.sleep(0.05)
        quiet = True  # n2 misses a few heartbeats as the job stalls, then is back
        await asyncio.sleep(0.2)
        quiet = False
        await until(lambda: bool(emitted.events))
    finally:
        await pump.stop()
    assert types(emitted.events) == [E.HANG]


def computing(node: str, rank: int, compute_s: float, step: int = 10) -> HostHeartbeat:
    """A node of one rank whose worker reports its compute time per step."""
    report = WorkerReport(
        rank=rank,
        local_rank=0,
        pid=1000 + rank,
        state=WorkerState.RUNNING,
        step=step,
        compute_s=compute_s,
    )
    return hb(node, workers=[report])


async def test_a_rank_that_stays_slow_is_a_straggler_until_it_is_fast_again(
    make_sensor: SensorFactory,
) -> None:
    sensor, emitted = make_sensor(
        heartbeat_polling_period_s=0.02,
        heartbeat_timeout_s=5.0,
        straggler_window_s=0.2,
        straggler_threshold=1.2,
    )
    rng = random.Random(0)
    slow = {"n2": 1.0}

    def beat(tick: int) -> list[HostHeartbeat]:
        # 5% jitter on every rank: no sample alone says anything.
        return [
            computing(f"n{r}", r, 0.1 * slow.get(f"n{r}", 1.0) * rng.uniform(0.95, 1.05), tick)
            for r in range(4)
        ]

    pump = Pump(sensor, beat).start()
    try:
        await asyncio.sleep(0.6)  # three windows of a healthy job
        assert emitted.events == []
        slow["n2"] = 1.5
        slowed_at = now()
        await until(lambda: bool(emitted.events))
        detected_after = now() - slowed_at
        slow["n2"] = 1.0
        await until(lambda: len(emitted.events) == 2)
    finally:
        await pump.stop()
    straggler, recovered = emitted.events
    assert (straggler.type, straggler.node, straggler.rank) == (E.STRAGGLER, "n2", 2)
    assert straggler.details["score"] == pytest.approx(1.5, abs=0.1)
    assert straggler.details["slowdown_pct"] == pytest.approx(50, abs=10)
    assert straggler.details["typical_s"] == pytest.approx(0.1, rel=0.06)
    assert straggler.details["for_s"] >= 0.2
    assert detected_after >= 0.2  # it stayed slow for the window first
    assert (recovered.type, recovered.node, recovered.rank) == (E.STRAGGLER_RECOVERED, "n2", 2)


async def test_a_whole_job_slowing_down_has_no_straggler(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(
        heartbeat_polling_period_s=0.02, heartbeat_timeout_s=5.0, straggler_window_s=0.1
    )
    pace = {"factor": 1.0}

    def beat(tick: int) -> list[HostHeartbeat]:
        return [computing(f"n{r}", r, 0.1 * pace["factor"], tick) for r in range(4)]

    pump = Pump(sensor, beat).start()
    try:
        await asyncio.sleep(0.3)
        pace["factor"] = 2.0  # a slow data loader: every rank at once
        await asyncio.sleep(0.5)
    finally:
        await pump.stop()
    assert emitted.events == []
    assert set(sensor.stragglers.scores("j1", now()).values()) == {1.0}


async def test_two_ranks_are_too_few_to_tell_a_straggler(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(
        heartbeat_polling_period_s=0.02, heartbeat_timeout_s=5.0, straggler_window_s=0.1
    )
    pump = Pump(sensor, lambda t: [computing("n0", 0, 0.1, t), computing("n1", 1, 0.3, t)])
    pump.start()
    try:
        await asyncio.sleep(0.5)
    finally:
        await pump.stop()
    assert emitted.events == []


async def test_a_stalled_job_makes_no_straggler_of_a_rank_whose_last_step_was_slow(
    make_sensor: SensorFactory,
) -> None:
    """The job stops stepping (its ranks wait for a new world) just after one slow
    forward on rank 2, a preemption on a busy machine: its heartbeats go on saying that
    step's time for windows on end, which is one sample, not a rank that stays slow."""
    sensor, emitted = make_sensor(
        heartbeat_polling_period_s=0.02,
        heartbeat_timeout_s=5.0,
        straggler_window_s=0.1,
        straggler_threshold=1.2,
    )
    pace = {"tick": 0, "stalled_at": -1}

    def beat(tick: int) -> list[HostHeartbeat]:
        pace["tick"] = tick
        stalled = pace["stalled_at"] >= 0
        step = pace["stalled_at"] if stalled else tick  # the last step, said again
        return [computing(f"n{r}", r, 1.5 if stalled and r == 2 else 0.1, step) for r in range(4)]

    pump = Pump(sensor, beat).start()
    try:
        await asyncio.sleep(0.3)
        pace["stalled_at"] = pace["tick"] + 1  # a new step: rank 2's slow one, the last
        await asyncio.sleep(0.6)  # six windows of the stall
        assert sensor.stragglers.scores("j1", now()) == {}  # nothing stepped to score
    finally:
        await pump.stop()
    assert emitted.events == []


# --- fault injection ----------------------------------------------------------------------


async def test_injected_heartbeat_loss_and_end_fault(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.1)
    pump = Pump(sensor, lambda _: [hb("n1", "j1")]).start()
    try:
        await asyncio.sleep(0.05)
        sensor.fault_marks.mute("n1", 7, duration_s=None)
        await until(lambda: bool(emitted.events))
        [event] = emitted.events
        assert event.type is E.HOST_HEARTBEAT_LOST
        assert event.node == "n1" and event.fault_id == 7
        # Heartbeats keep being dropped while the fault is active.
        await asyncio.sleep(0.15)
        assert pump.events == []
        view = sensor.node_view("n1")
        assert view is not None and not view.alive

        sensor.fault_marks.end(99)  # some other fault: no effect
        await asyncio.sleep(0.1)
        assert pump.events == []

        sensor.fault_marks.end(7)
        await until(lambda: bool(pump.events))
    finally:
        await pump.stop()
    [recovered] = pump.events
    # The recovery is attributed to the fault that caused the loss.
    assert recovered.type is E.NODE_RECOVERED and recovered.fault_id == 7
    assert len(emitted.events) == 1


async def test_injected_heartbeat_loss_with_duration_ends_by_itself(
    make_sensor: SensorFactory,
) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.1)
    sensor.ingest(hb("n1", "j1"))
    injected_at = now()  # before the mute, which reads its own start
    sensor.fault_marks.mute("n1", 3, duration_s=0.3)
    pump = Pump(sensor, lambda _: [hb("n1", "j1")]).start()
    try:
        await until(lambda: bool(pump.events))
    finally:
        await pump.stop()
    assert now() - injected_at >= 0.3
    assert [(e.type, e.fault_id) for e in emitted.events] == [(E.HOST_HEARTBEAT_LOST, 3)]
    assert types(pump.events) == [E.NODE_RECOVERED]


async def test_a_node_muted_before_it_is_known_is_heard_once_the_fault_ends(
    make_sensor: SensorFactory,
) -> None:
    sensor, _ = make_sensor()
    sensor.fault_marks.mute("ghost", 1, duration_s=None)
    assert not sensor.ingest(hb("ghost"))
    assert sensor.node_view("ghost") is None
    sensor.fault_marks.end(1)
    assert sensor.ingest(hb("ghost")).events == []
    assert sensor.node_view("ghost") is not None


# --- restore ------------------------------------------------------------------------------


def _node_view(name: str, job: str | None, *, alive: bool, **kw: Any) -> NodeView:
    return NodeView(
        name=name,
        state=NodeState.RUNNING if job else NodeState.SPARE,
        job=job,
        alive=alive,
        last_heartbeat=datetime.now(UTC) - timedelta(hours=1),
        **kw,
    )


async def test_restore_gives_alive_nodes_a_grace_period(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.2)
    job = JobView("j1", num_dp_replicas=3, min_num_dp_replicas=1, max_num_dp_replicas=5,
                  num_nodes_per_dp=2)  # fmt: skip
    # Read before the restore: its grace period starts inside it, so a time read after
    # it (3 ms later on a loaded machine) made the grace look shorter than it was.
    restored_at = now()
    sensor.restore([_node_view("n1", "j1", alive=True), _node_view("n2", "j1", alive=True)], [job])
    view = sensor.job_view("j1")
    assert view is not None
    assert (view.num_dp_replicas, view.min_num_dp_replicas, view.max_num_dp_replicas) == (3, 1, 5)
    assert view.nodes == ("n1", "n2")

    # Their last heartbeats are an hour old, but they are not declared lost at once.
    await asyncio.sleep(0.05)
    assert emitted.events == []

    # n1 beats within the grace period: nothing to report. n2 stays silent: lost.
    pump = Pump(sensor, lambda _: [hb("n1", "j1")]).start()
    try:
        await until(lambda: bool(emitted.events))
        lost_at = now()
        await asyncio.sleep(0.1)
    finally:
        await pump.stop()
    assert [(e.type, e.node) for e in emitted.events] == [(E.HOST_HEARTBEAT_LOST, "n2")]
    assert lost_at - restored_at >= 0.2
    assert pump.events == []


async def test_restore_dead_and_flapping_nodes(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.1)
    sensor.restore(
        [
            _node_view("dead", "j1", alive=False),
            _node_view("flappy", None, alive=True, flapping=True),
        ],
        [],
    )
    # A node that was already lost is not lost again; a flapping one is watched, but its
    # loss stays quiet (only its new state is persisted).
    await until(lambda: bool(emitted.changes))
    await asyncio.sleep(0.2)
    assert emitted.events == []
    assert [(n.name, n.alive) for c in emitted.changes for n in c.nodes] == [("flappy", False)]

    back = sensor.ingest(hb("dead", "j1"))
    assert types(back.events) == [E.NODE_RECOVERED]
    view = sensor.node_view("flappy")
    assert view is not None and view.flapping


# --- heartbeat validation -----------------------------------------------------------------


def test_minimal_heartbeat_from_the_contract_parses() -> None:
    raw = (
        '{"node": "n1", "state": "running", "job": "j1", "workers": '
        '[{"rank": 0, "local_rank": 0, "pid": 123, "state": "running", "step": 10}]}'
    )
    beat = decode_heartbeat(raw.encode())
    assert beat.node == "n1" and beat.state is NodeState.RUNNING and beat.job == "j1"
    [w] = beat.workers
    assert (w.rank, w.local_rank, w.pid, w.state, w.step) == (
        0,
        0,
        123,
        WorkerState.RUNNING,
        10,
    )
    assert beat.gpu_reports == []


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        pytest.param(
            {"node": "n1", "state": "running"},
            "('job',) required when state is running",
            id="running-no-job",
        ),
        pytest.param(
            {"node": "n1", "state": "spare", "job": "j1"},
            "('job',) a spare node reports no job",
            id="spare-with-job",
        ),
        pytest.param(
            {
                "node": "n1",
                "state": "spare",
                "workers": [{"rank": 0, "local_rank": 0, "state": "running"}],
            },
            "('workers',) a spare node reports no workers",
            id="spare-with-workers",
        ),
        pytest.param(
            {
                "node": "n1",
                "state": "running",
                "job": "j1",
                "workers": [
                    {"rank": 0, "local_rank": 0, "state": "running"},
                    {"rank": 0, "local_rank": 1, "state": "running"},
                ],
            },
            "('workers', 1, 'rank') rank 0 is reported twice",
            id="duplicate-ranks",
        ),
        pytest.param(
            {
                "node": "n1",
                "state": "running",
                "job": "j1",
                "workers": [{"rank": 0, "local_rank": 0, "state": "running", "step": -1}],
            },
            "step",
            id="negative-step",
        ),
        pytest.param(
            {"node": "n1", "state": "running", "job": "j1", "gpu_reports": [{"kind": "xid"}]},
            "code is required",
            id="xid-without-code",
        ),
        pytest.param(
            {"node": "n1", "state": "running", "job": "j1", "gpu_reports": [{"kind": "ecc"}]},
            "count is required",
            id="ecc-without-count",
        ),
        pytest.param({"node": "", "state": "spare"}, "node", id="empty-node-name"),
        pytest.param({"node": "n 1", "state": "spare"}, "node", id="bad-node-name"),
        pytest.param({"node": "n1", "state": "sleeping"}, "state", id="unknown-state"),
        pytest.param(
            {"node": "n1", "state": "spare", "surprise": 1}, "surprise", id="unknown-field"
        ),
    ],
)
def test_invalid_heartbeats_are_rejected(payload: dict[str, Any], fragment: str) -> None:
    with pytest.raises(HeartbeatError) as info:
        decode_heartbeat(json.dumps(payload).encode())
    assert fragment in f"{info.value.loc} {info.value.message}"


async def test_restored_worker_states_are_not_reported_again(make_sensor: SensorFactory) -> None:
    """After a supervisor restart, a worker that had already exited is not a new event;
    one that exited while the supervisor was down is."""
    sensor, _ = make_sensor()
    exited = worker(0, 5, "exited", exit_code=-9)
    running = worker(1, 5, "running")
    view = NodeView(
        "n1",
        NodeState.RUNNING,
        "j1",
        True,
        None,
        workers=tuple(
            WorkerView(w.rank, w.local_rank, w.pid, w.state, w.step, w.exit_code)
            for w in (exited, running)
        ),
    )
    sensor.restore([view], [])
    same = sensor.ingest(hb("n1", workers=[exited, running]))
    assert same.events == []
    crashed_meanwhile = sensor.ingest(
        hb("n1", workers=[exited, worker(1, 5, "exited", exit_code=1)])
    )
    assert [(e.type, e.rank) for e in crashed_meanwhile.events] == [(E.WORKER_EXITED, 1)]


def test_a_swapped_in_node_behind_the_others_restarts_progress() -> None:
    from supervisor.sensor.progress import HangParams, JobProgress

    progress = JobProgress(HangParams(None, 1.0, 5.0, 0))
    progress.observe("a", 50, now=1.0)
    progress.observe("b", 50, now=1.0)
    progress.forget("a")  # a is swapped out; c joins, resumed from step 40
    assert progress.observe("c", 40, now=2.0) is True
    assert progress.max_step == 40 and progress.last_progress == 2.0


# --- the steady-state fast path -------------------------------------------------------------


async def test_steady_heartbeats_change_nothing_yet_changes_still_surface(
    make_sensor: SensorFactory,
) -> None:
    """Steady heartbeats take the sensor's fast path; every kind of change still leaves it."""
    from supervisor.sensor.sensor import UNCHANGED

    sensor, _ = make_sensor(heartbeat_timeout_s=5.0)
    sensor.ingest(stepping("n1", 1, ranks=(0, 1)))
    for step in range(2, 6):
        assert sensor.ingest(stepping("n1", step, ranks=(0, 1))) is UNCHANGED
    assert not UNCHANGED and UNCHANGED.events == []
    assert sensor.job_view("j1").last_step == 5  # steps still move the job on the fast path
    assert sensor.node_view("n1").workers[0].step == 5

    # A worker's state change, a GPU report and a new job each take the full path.
    crash = hb("n1", workers=[worker(0, 6, "exited", exit_code=9), worker(1, 6, local_rank=1)])
    assert types(sensor.ingest(crash).events) == [E.WORKER_EXITED]
    assert sensor.ingest(crash) is UNCHANGED
    with_xid = hb(
        "n1",
        workers=[worker(0, 6, "exited", exit_code=9), worker(1, 6, local_rank=1)],
        gpu=[xid(79)],
    )
    assert types(sensor.ingest(with_xid).events) == [E.GPU_XID]
    moved = sensor.ingest(hb("n1", "j2", workers=[worker(0, 1), worker(1, 1, local_rank=1)]))
    assert [j.name for j in moved.jobs] == ["j2"]
    assert sensor.node_view("n1").job == "j2"


async def test_a_steady_heartbeat_is_kept_as_its_body_and_read_back_exactly(
    make_sensor: SensorFactory,
) -> None:
    """The fast path keeps a steady heartbeat's bytes, not its parsed reports; whatever
    reads the node's workers (views, the full path's comparison) gets the latest ones."""
    import msgspec

    from supervisor.sensor.sensor import UNCHANGED

    sensor, _ = make_sensor(heartbeat_timeout_s=5.0)

    def sent(beat: HostHeartbeat) -> Changes:
        body = msgspec.json.encode(beat)
        return sensor.ingest(decode_heartbeat(body), body)

    sent(stepping("n1", 1, ranks=(0, 1)))
    restarted = [worker(0, 7), WorkerReport(rank=1, local_rank=1, pid=4242, state="running")]
    restarted[1] = msgspec.structs.replace(restarted[1], step=8)
    assert sent(hb("n1", workers=restarted)) is UNCHANGED  # a new pid, steps: still steady
    node = sensor._nodes["n1"]  # its record: how the heartbeat is kept
    assert node.body is not None  # kept undecoded
    assert [(w.pid, w.step) for w in sensor.node_view("n1").workers] == [(1000, 7), (4242, 8)]
    assert node.body is not None  # reading changes nothing: still held as its bytes
    assert sensor.job_view("j1").last_step == 8

    sent(hb("n1", workers=[worker(0, 9), worker(1, 9, local_rank=1)]))
    crash = [worker(0, 9), worker(1, 9, "exited", local_rank=1, exit_code=3)]
    [event] = sent(hb("n1", workers=crash)).events  # compared with the kept body's workers
    assert (event.type, event.rank, event.details["exit_code"]) == (E.WORKER_EXITED, 1, 3)


def test_heartbeats_are_encoded_without_their_defaults_and_decode_the_same() -> None:
    import msgspec

    beat = hb("n1", workers=[worker(0, 5), worker(1, None, local_rank=1)])
    body = msgspec.json.encode(beat)
    assert b"null" not in body and b"[]" not in body and b"{}" not in body
    assert b"exit_code" not in body and b"gpu_reports" not in body
    assert decode_heartbeat(body) == beat
    crashed = hb("n1", workers=[worker(0, 5, "exited", exit_code=0)], gpu=[xid(79)])
    assert decode_heartbeat(msgspec.json.encode(crashed)) == crashed  # 0 is not a default


def test_names_are_checked_on_every_field_even_when_seen_before() -> None:
    good = {"node": "n-ok", "state": "running", "job": "j-ok", "workers": []}
    decode_heartbeat(json.dumps(good).encode())
    # A trailing newline too: the operator API could never name such a node again.
    for field, bad in (("node", "n ok"), ("job", "-j"), ("node", "j-ok!"), ("node", "n1\n")):
        body = json.dumps({**good, field: bad}).encode()
        with pytest.raises(HeartbeatError) as info:
            decode_heartbeat(body)
        assert info.value.loc == (field,)


def test_changes_merge_keeps_every_event_and_each_latest_record() -> None:
    from dataclasses import replace

    from supervisor.sensor.sensor import Changes

    up = NodeView("n1", NodeState.RUNNING, "j1", True, None)
    down, other = replace(up, alive=False), replace(up, name="n2")
    lost = Event(type=E.HOST_HEARTBEAT_LOST, time=datetime.now(UTC), node="n1")
    back = Event(type=E.NODE_RECOVERED, time=datetime.now(UTC), node="n1")
    merged = Changes.merged(
        [Changes(events=[lost], nodes=[down, other]), Changes(events=[back], nodes=[up])]
    )
    assert merged.events == [lost, back]
    assert merged.nodes == [other, up]  # n1's latest record, after n2's


async def test_a_rank_moves_only_once_its_holder_lets_it_go(make_sensor: SensorFactory) -> None:
    """Two alive nodes cannot run one rank: the second claim is refused, changing nothing.
    It moves once the holder reports it stopped, or is lost; a node that comes back
    holds what it runs again, also after a restart of the supervisor."""
    sensor, _ = make_sensor(heartbeat_timeout_s=2.0)
    sensor.ingest(hb("n1", workers=[worker(0), worker(1)]))
    with pytest.raises(RankClaimed) as refused:
        sensor.ingest(hb("n2", workers=[worker(2), worker(1, state="starting")]))
    assert str(refused.value) == "workers.1.rank: rank 1 of job j1 is running on node n1"
    assert (refused.value.rank, refused.value.holder) == (1, "n1")
    assert not sensor.has_node("n2")
    # Exited and lost workers hold nothing; stopped ones neither.
    sensor.ingest(hb("n2", workers=[worker(0, state="exited", exit_code=1)]))
    sensor.ingest(hb("n1", workers=[worker(0, state="stopped"), worker(1)]))
    sensor.ingest(hb("n2", workers=[worker(0)]))
    with pytest.raises(RankClaimed):
        sensor.ingest(hb("n1", workers=[worker(0), worker(1)]))
    # n2 is lost: n3 takes rank 0; n2 back with it running is refused, stopped is not.
    # n1 beats on while n2 goes silent: on a loaded machine fixed sleeps of a fraction of
    # the timeout lost n1 too, or not yet n2.
    deadline = asyncio.get_running_loop().time() + scaled(10)
    while sensor.node_view("n2").alive:
        assert asyncio.get_running_loop().time() < deadline, "n2 was never lost"
        sensor.ingest(hb("n1", workers=[worker(1)]))
        await asyncio.sleep(0.05)
    assert sensor.node_view("n1").alive
    sensor.ingest(hb("n3", workers=[worker(0, state="starting")]))
    with pytest.raises(RankClaimed):
        sensor.ingest(hb("n2", workers=[worker(0)]))
    assert not sensor.node_view("n2").alive
    sensor.ingest(hb("n2", workers=[worker(0, state="stopped")]))
    assert sensor.node_view("n2").alive

    # After a restart, the nodes that were alive hold their ranks again.
    nodes, jobs = sensor.snapshot()
    again, _ = make_sensor(heartbeat_timeout_s=5.0)
    again.restore(nodes.values(), jobs.values())
    with pytest.raises(RankClaimed):
        again.ingest(hb("n4", workers=[worker(1)]))
    # Another job's rank 1 is another rank.
    again.ingest(hb("n4", "j2", workers=[worker(1)]))
