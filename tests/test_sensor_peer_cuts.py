"""A node cut off from its peers while the supervisor still hears it (supervisor/sensor/
peer_cuts.py): judged from what each side says it cannot reach, spares the third view."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from resiliency_protocol.heartbeat import HostHeartbeat
from supervisor.config import Settings
from supervisor.domain import Event, EventType
from supervisor.sensor.peer_cuts import peer_cut_confirm_s
from supervisor.sensor.sensor import Sensor
from tests.test_sensor import SensorFactory, hb, make_sensor, worker

__all__ = ["make_sensor"]  # the fixture, used by name

#: The job's two nodes (ranks 0 and 1) and a spare, as in the local cluster.
JOB = {"node-0": 0, "node-1": 1}
SPARE = "node-2"


def beat(node: str, unreachable: Iterable[str] = ()) -> HostHeartbeat:
    base = (
        hb(node, "j1", workers=[worker(JOB[node])])
        if node in JOB
        else hb(node, None, state="spare")
    )
    return HostHeartbeat(
        node=base.node,
        state=base.state,
        job=base.job,
        workers=base.workers,
        address=f"http://{node}:7000",
        unreachable_peers=list(unreachable),
    )


def cut_offs(sensor: Sensor, reports: dict[str, list[str]]) -> list[Event]:
    """Every node reports (in the order given); the `node_cut_off` events raised."""
    events = []
    for node, unreachable in reports.items():
        events += [
            e
            for e in sensor.ingest(beat(node, unreachable)).events
            if e.type is EventType.NODE_CUT_OFF
        ]
    return events


def cluster(make_sensor: SensorFactory, confirm_s: float = 0.0) -> Sensor:
    sensor, _ = make_sensor(heartbeat_timeout_s=30, peer_cut_confirm_s=confirm_s)
    for node in (*JOB, SPARE):
        sensor.ingest(beat(node))
    return sensor


async def test_a_node_cut_from_every_peer_is_named_whichever_report_comes_first(
    make_sensor: SensorFactory,
) -> None:
    for order in (["node-1", "node-0", SPARE], ["node-0", SPARE, "node-1"]):
        sensor = cluster(make_sensor)
        reports = {"node-1": ["node-0", SPARE], "node-0": ["node-1"], SPARE: ["node-1"]}
        events = cut_offs(sensor, {n: reports[n] for n in order})
        assert [(e.node, e.job) for e in events] == [("node-1", "j1")], order
        details = events[0].details
        assert details["cannot_reach"] == ["node-0", SPARE]
        assert set(details["unreachable_from"]) <= {"node-0", SPARE}
        # Raised once: the same reports again say nothing new.
        assert cut_offs(sensor, reports) == []


async def test_rank_zeros_node_cut_off_is_named_by_the_spares_view(
    make_sensor: SensorFactory,
) -> None:
    sensor = cluster(make_sensor)
    events = cut_offs(
        sensor, {"node-1": ["node-0"], "node-0": ["node-1", SPARE], SPARE: ["node-0"]}
    )
    assert [e.node for e in events] == ["node-0"]


async def test_one_cut_link_inside_the_job_takes_out_the_higher_ranks_node(
    make_sensor: SensorFactory,
) -> None:
    sensor = cluster(make_sensor)
    assert [e.node for e in cut_offs(sensor, {"node-0": ["node-1"], "node-1": ["node-0"]})] == [
        "node-1"
    ]


async def test_what_does_not_stall_a_job_raises_nothing(make_sensor: SensorFactory) -> None:
    # One side's word alone: the prober may be the one at fault.
    sensor = cluster(make_sensor)
    assert cut_offs(sensor, {"node-0": ["node-1"]}) == []
    # A spare cut off: no job's collective needs it.
    sensor = cluster(make_sensor)
    assert (
        cut_offs(sensor, {SPARE: ["node-0", "node-1"], "node-0": [SPARE], "node-1": [SPARE]}) == []
    )
    # A link between a job's node and a spare: the job trains on.
    sensor = cluster(make_sensor)
    assert cut_offs(sensor, {SPARE: ["node-1"], "node-1": [SPARE]}) == []


async def test_a_node_that_reaches_its_peers_again_is_judged_anew_at_the_next_cut(
    make_sensor: SensorFactory,
) -> None:
    sensor = cluster(make_sensor)
    cut = {"node-1": ["node-0", SPARE], "node-0": ["node-1"]}
    assert [e.node for e in cut_offs(sensor, cut)] == ["node-1"]
    assert cut_offs(sensor, {"node-1": [], "node-0": []}) == []
    assert [e.node for e in cut_offs(sensor, cut)] == ["node-1"]


async def test_probe_targets_are_ring_neighbours_among_live_nodes(
    make_sensor: SensorFactory,
) -> None:
    sensor, _ = make_sensor(heartbeat_timeout_s=30)
    names = [f"n{i}" for i in range(7)]
    for name in names:
        sensor.ingest(
            HostHeartbeat(
                node=name, state=hb(name, None, state="spare").state, address=f"http://{name}:1"
            )
        )
    targets = {name: [peer for peer, _ in sensor.probe_targets(name, 2)] for name in names}
    assert targets["n0"] == ["n1", "n6", "n2", "n5"]
    assert dict(sensor.probe_targets("n3", 2))["n4"] == "http://n4:1"
    # Each node is probed by as many as it probes.
    probed_by = {name: sum(name in t for t in targets.values()) for name in names}
    assert set(probed_by.values()) == {4}
    assert sensor.probe_targets("unknown", 2) == []


async def test_a_judgement_is_reported_only_once_it_held_for_the_confirmation_time(
    make_sensor: SensorFactory,
) -> None:
    """node-1 was cut from everyone, the supervisor included, for a moment: the reports it
    sends once heard again are older than its next probes. Retracted within the
    confirmation time, they raise nothing; held past it, they do."""
    sensor = cluster(make_sensor, confirm_s=0.3)
    stale = {"node-0": ["node-1"], "node-1": ["node-0", SPARE]}
    assert cut_offs(sensor, stale) == []
    await asyncio.sleep(0.1)
    assert cut_offs(sensor, {"node-1": [], "node-0": []}) == []  # its probes answer again
    await asyncio.sleep(0.3)
    assert cut_offs(sensor, {"node-1": [], "node-0": []}) == []
    # A real cut: the same reports, held.
    assert cut_offs(sensor, stale) == []
    await asyncio.sleep(0.15)
    assert cut_offs(sensor, {"node-1": ["node-0", SPARE]}) == []
    await asyncio.sleep(0.2)
    assert [e.node for e in cut_offs(sensor, {"node-1": ["node-0", SPARE]})] == ["node-1"]


def test_the_confirmation_time_outlasts_a_probe_round_and_a_heartbeat_by_default(
    make_settings: Callable[..., Settings],
) -> None:
    def settings(period_s: float, **given: float) -> Settings:
        return make_settings(
            heartbeat_polling_period_s=period_s, heartbeat_timeout_s=3 * period_s, **given
        )

    assert peer_cut_confirm_s(settings(5).sensing) == 15.0
    assert peer_cut_confirm_s(settings(0.2).sensing) == 2.2
    assert peer_cut_confirm_s(settings(5, peer_cut_confirm_s=4).sensing) == 4.0
