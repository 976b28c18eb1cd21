"""A node's status over the HTTP API says what it is: lost, draining, cordoned, spare,
running; its marks say what to watch (flapping, with the time it clears in; late); a
dry run's would-cordon is never shown as a cordon."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from supervisor.api.node_status import NodeStatus, node_marks, node_status
from supervisor.domain import NodeState, NodeView, WorkerState, WorkerView
from tests.conftest import SettingsFactory
from tests.test_api import OPERATOR, Api, heartbeat, running
from tests.timing import scaled


async def node(api: Api, name: str) -> dict[str, Any]:
    found: dict[str, Any] = await api.get(f"/api/v1/nodes/{name}")
    return found


async def until(api: Api, name: str, check: Any, within: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + scaled(within)
    while True:
        found = await node(api, name)
        if check(found):
            return found
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.05)


async def test_a_lost_node_reads_lost_and_so_do_its_workers(make_settings: SettingsFactory) -> None:
    # A timeout long enough that the first read, on a loaded machine, is not yet `late`.
    async with running(make_settings(heartbeat_timeout_s=2.0, flap_max_losses=5)) as api:
        assert (await api.beat(heartbeat("n1"))).status_code in (202, 204)
        alive = await node(api, "n1")
        assert (alive["status"], alive["state"], alive["marks"]) == ("running", "running", [])
        lost = await until(api, "n1", lambda n: not n["alive"])
        assert (lost["status"], lost["state"]) == ("lost", "running")
        assert {(w["state"], w["reported_state"]) for w in lost["workers"]} == {("lost", "running")}
        only_lost = await api.get("/api/v1/nodes", status="lost")
        assert [n["name"] for n in only_lost] == ["n1"]
        assert await api.get("/api/v1/nodes", status=["running", "spare"]) == []
        bad = await api.client.get("/api/v1/nodes", params={"status": "gone"}, headers=OPERATOR)
        assert bad.status_code == 422 and "status" in bad.text


async def test_flapping_clears_after_the_stated_steady_time(
    make_settings: SettingsFactory,
) -> None:
    # Margins scaled (tests/timing.py): the beats and the sensor share this test's event
    # loop, and on a loaded machine a stall longer than the heartbeat timeout between two
    # steady beats is a third loss, and two losses slower than the window no flapping.
    window = scaled(2.0)
    settings = make_settings(
        heartbeat_timeout_s=scaled(0.3), flap_window_s=window, flap_max_losses=2
    )
    async with running(settings) as api:
        for _ in range(2):  # lost twice within the window: flapping
            await api.beat(heartbeat("n1"))
            await until(api, "n1", lambda n: not n["alive"])
        await api.beat(heartbeat("n1"))
        flapping = await node(api, "n1")
        assert flapping["marks"] == ["flapping"] and flapping["status"] == "running"
        assert 0 < flapping["flapping_clears_in_s"] <= window
        # Steady heartbeats for the window: the mark clears, and says so with an event.
        deadline = time.monotonic() + scaled(20)
        while (await node(api, "n1"))["flapping"]:
            assert time.monotonic() < deadline, "the flapping mark never cleared"
            await api.beat(heartbeat("n1"))
            await asyncio.sleep(0.05)
        cleared = await node(api, "n1")
        # Only the flapping mark: on a loaded machine the last beat may already be over
        # half the (short) timeout old when read, which marks the node `late` as it should.
        assert "flapping" not in cleared["marks"] and cleared["flapping_clears_in_s"] is None
        recovered = await api.get("/api/v1/events", type="node_recovered", node="n1")
        assert any(e["details"].get("was_flapping") for e in recovered["items"])


async def test_cordons_drain_and_a_dry_run_cordons_nothing(
    make_settings: SettingsFactory,
) -> None:
    for dry_run in (False, True):
        async with running(make_settings(heartbeat_timeout_s=30, dry_run=dry_run)) as api:
            await api.beat(heartbeat("n1"))
            await api.beat(heartbeat("s1", job=None))
            for name in ("n1", "s1"):
                r = await api.client.post(
                    "/api/v1/actions", json={"type": "cordon", "node": name}, headers=OPERATOR
                )
                assert r.status_code in (200, 201, 202), r.text
            await api.settle()
            n1 = await until(api, "n1", lambda n: n["cordoned"] or n["dry_run_cordoned"])
            s1 = await until(api, "s1", lambda n: n["cordoned"] or n["dry_run_cordoned"])
            if dry_run:
                assert (n1["status"], n1["cordoned"], n1["dry_run_cordoned"]) == (
                    "running",
                    False,
                    True,
                )
                assert (s1["status"], s1["cordoned"]) == ("spare", False)
            else:
                # Its workers still run: being drained. The idle spare is just cordoned.
                assert (n1["status"], n1["cordoned"], n1["dry_run_cordoned"]) == (
                    "draining",
                    True,
                    False,
                )
                assert s1["status"] == "cordoned"


def view(**changes: Any) -> NodeView:
    base: dict[str, Any] = {
        "name": "n1",
        "state": NodeState.RUNNING,
        "job": "j1",
        "alive": True,
        "last_heartbeat": None,
        "workers": (WorkerView(0, 0, 10, WorkerState.RUNNING, 5),),
    }
    return NodeView(**{**base, **changes})


def test_status_words_in_their_order_of_precedence() -> None:
    assert node_status(view(alive=False, state=NodeState.FAILED), cordoned=True) == "lost"
    assert node_status(view(state=NodeState.FAILED), cordoned=True) == NodeStatus.FAILED
    assert node_status(view(), cordoned=True) == NodeStatus.DRAINING
    idle = view(state=NodeState.SPARE, job=None, workers=())
    assert node_status(idle, cordoned=True) == NodeStatus.CORDONED
    assert node_status(idle, cordoned=False) == NodeStatus.SPARE
    assert node_status(view(state=NodeState.COMPLETE), cordoned=False) == NodeStatus.COMPLETE
    # Late: alive, its heartbeat over half the timeout old; a lost node is not "late".
    assert node_marks(view(flapping=True), 6.0, timeout_s=10) == ["flapping", "late"]
    assert node_marks(view(), 4.0, timeout_s=10) == []
    assert node_marks(view(alive=False), 60.0, timeout_s=10) == []
