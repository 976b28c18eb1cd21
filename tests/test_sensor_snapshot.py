"""The controller's snapshot before each decision visits only the nodes changed since the
one before (an unchanged node is not even looked at), and a burst of losses builds again
only what changed.

Each loss has the controller take the sensor's snapshot (`Sensor.snapshot`, every node's
view). A steady node's workers are held as its last heartbeat's bytes; its view, and the
decoding of those bytes, are kept until the node changes. On the sensor alone, on a real
event loop, with the losses coming from the heartbeat deadlines themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

import supervisor.sensor.nodes as sensor_nodes
from resiliency_protocol.heartbeat import HostHeartbeat, parse_heartbeat
from supervisor.domain import EventType, NodeView
from supervisor.sensor import Sensor
from tests.test_sensor import SensorFactory, hb, make_sensor, stepping, until, worker

__all__ = ["make_sensor"]  # the fixture, used by name

NODES = 60


def _beat(sensor_ingest: Callable[..., object], hb: HostHeartbeat) -> None:
    """Ingest `hb` as the route does: parsed from its bytes, the bytes kept."""
    body = msgspec.json.encode(hb)
    sensor_ingest(parse_heartbeat(body), body)


async def test_a_loss_bursts_snapshots_build_and_decode_only_what_changed(
    make_sensor: SensorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.5, heartbeat_polling_period_s=0.01)
    names = [f"n{i:03d}" for i in range(NODES)]
    for i, name in enumerate(names):
        _beat(sensor.ingest, stepping(name, 1, ranks=(i,)))
    for i, name in enumerate(names):  # steady beats: the workers held as bytes
        _beat(sensor.ingest, stepping(name, 2, ranks=(i,)))
    decoded: list[bytes] = []
    parse = sensor_nodes.parse_heartbeat

    def counting(body: bytes) -> HostHeartbeat:
        decoded.append(body)
        return parse(body)

    monkeypatch.setattr(sensor_nodes, "parse_heartbeat", counting)
    before, _ = sensor.snapshot()
    assert len(decoded) == NODES  # each node's last heartbeat, once
    again, _ = sensor.snapshot()
    assert len(decoded) == NODES  # nothing changed: nothing decoded or built again
    assert all(again[name] is before[name] for name in names)
    decoded.clear()

    # A third of the nodes beat once more; then every node falls silent: a burst of losses.
    heard = names[::3]
    for name in heard:
        _beat(sensor.ingest, stepping(name, 3, ranks=(names.index(name),)))
    await until(lambda: len(emitted.of(EventType.HOST_HEARTBEAT_LOST)) == NODES, patience=10)
    snapshots = [sensor.snapshot()[0] for _ in emitted.of(EventType.HOST_HEARTBEAT_LOST)]
    # Decoded, by the losses' events and the burst's snapshots together: only the
    # heartbeats that came after the last snapshot, once each.
    assert sorted(decoded) == sorted(set(decoded)) and len(decoded) == len(heard)
    first = snapshots[0]
    assert not any(first[name] is before[name] for name in names)  # each node lost since
    assert all(not view.alive for view in first.values())
    assert {name for name in names if first[name].workers[0].step == 3} == set(heard)
    # The burst's next snapshots: every view the same object, nothing built again.
    for later in snapshots[1:]:
        assert all(later[name] is first[name] for name in names)


def _fresh(sensor: Sensor) -> dict[str, NodeView]:
    """Every node's view read one by one, each checked against its record."""
    return {name: view for name in sensor.node_names() if (view := sensor.node_view(name))}


async def test_a_snapshot_visits_only_the_nodes_changed_since_the_last_and_sees_every_change(
    make_sensor: SensorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.5, heartbeat_polling_period_s=0.01)
    names = [f"n{i:03d}" for i in range(NODES)]
    for step in (1, 2):
        for i, name in enumerate(names):
            _beat(sensor.ingest, stepping(name, step, ranks=(i,)))
    sensor.snapshot()
    visited: list[str] = []
    inputs = sensor_nodes._view_inputs  # read for each node looked at

    def counting(record: sensor_nodes.NodeRecord) -> tuple[object, ...]:
        visited.append(record.name)
        return inputs(record)

    monkeypatch.setattr(sensor_nodes, "_view_inputs", counting)

    def visits(change: Callable[[], object]) -> list[str]:
        """The nodes the snapshot after `change` looked at; and it shows what a node's
        own read shows, for every node."""
        change()
        visited.clear()
        nodes, _ = sensor.snapshot()
        seen = sorted(visited)
        assert nodes == _fresh(sensor)
        return seen

    assert visits(lambda: None) == []
    assert visits(lambda: _beat(sensor.ingest, stepping(names[0], 3, ranks=(0,)))) == [names[0]]
    assert sensor.snapshot()[0][names[0]].workers[0].step == 3
    exited = hb(names[1], workers=[worker(1, 2, "exited", local_rank=0, exit_code=1)])
    assert visits(lambda: _beat(sensor.ingest, exited)) == [names[1]]
    assert visits(lambda: sensor.set_cordoned(names[2], True)) == [names[2]]
    assert sensor.snapshot()[0][names[2]].cordoned
    assert visits(lambda: sensor.swapped_out(names[3])) == [names[3]]
    assert sensor.snapshot()[0][names[3]].job is None
    assert visits(lambda: sensor.answered(names[4])) == [names[4]]
    assert visits(lambda: None) == []

    # Every node falls silent: each one lost is visited once, then nothing.
    await until(lambda: len(emitted.of(EventType.HOST_HEARTBEAT_LOST)) == NODES, patience=10)
    assert visits(lambda: None) == names
    assert not any(view.alive for view in sensor.snapshot()[0].values())
    assert visits(lambda: _beat(sensor.ingest, stepping(names[5], 4, ranks=(5,)))) == [names[5]]
    assert sensor.snapshot()[0][names[5]].alive
    assert visits(lambda: None) == []

    # A sensor started again from the persisted picture hands out that picture.
    persisted = sensor.snapshot()[0]
    restarted, _ = make_sensor()
    restarted.restore(persisted.values(), [])
    assert restarted.snapshot()[0] == persisted


async def test_a_read_of_the_clocks_cut_by_the_scheduler_moves_no_nodes_last_heartbeat(
    make_sensor: SensorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler interrupting the sensor right after its read of Unix time, before its
    read of the loop's clock (for 5 ms, as on a loaded machine), moves no node's last
    heartbeat and builds no view again. Time is scripted here: no real machine preempts a
    process between two given instructions on demand."""
    sensor, _ = make_sensor(heartbeat_timeout_s=60, heartbeat_polling_period_s=5)
    now, offset = [1000.0], 1.7e9  # Unix time = loop time + offset, exactly
    preempt_s = [0.0]

    def wall() -> float:
        read = now[0] + offset
        now[0] += preempt_s[0]  # the process loses the CPU right after this read
        preempt_s[0] = 0.0
        return read

    monkeypatch.setattr(sensor, "_clock", lambda: now[0])
    monkeypatch.setattr("supervisor.sensor.clock.wall_time", wall)
    _beat(sensor.ingest, stepping("n000", 1, ranks=(0,)))
    before, _ = sensor.snapshot()
    preempt_s[0] = 0.005
    after, _ = sensor.snapshot()
    assert after["n000"].last_heartbeat == before["n000"].last_heartbeat
    assert after["n000"] is before["n000"]
