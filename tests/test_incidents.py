"""One incident, one remedy: events a remedy's fault goes on raising while it runs are
attached to its incident (recorded, no action of their own, listed on the remedy); another
node's failure gets its own remedy after it; a new failure after it escalates. Over HTTP,
as host monitors report and operators read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from supervisor.actuator import ActionError
from supervisor.domain import ActionRecord, ActionType, utcnow
from tests.acting_stand_in import RecordingBackend
from tests.conftest import SettingsFactory
from tests.test_api import Api, running
from tests.timing import scaled


class HeldRestarts(RecordingBackend):
    """Does nothing, as a dry run, but a restart runs until the test releases it: the
    failures meant to come while it runs do, however slow the machine."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        if action.type in (ActionType.RESTART_IN_PLACE, ActionType.RESTART_WORKLOAD):
            await self.release.wait()
        return await super().execute(action)


def beat(node: str, step: int, state: str = "running", pid: int = 0, **worker: Any) -> Any:
    rank = int(node.lstrip("n"))
    report = {
        "rank": rank,
        "local_rank": 0,
        "pid": pid or 100 + rank,
        "state": state,
        "step": step,
        **worker,
    }
    return {"node": node, "state": "running", "job": "j1", "workers": [report]}


async def send(api: Api, *bodies: Any) -> None:
    for body in bodies:
        assert (await api.beat(body)).status_code in (202, 204), body


async def train(api: Api, steps: int, nodes: tuple[str, ...] = ("n0", "n1")) -> None:
    for step in range(1, steps + 1):
        await send(api, *(beat(n, step) for n in nodes))
        await asyncio.sleep(0.02)


async def until(predicate: Any, within: float = 60.0) -> Any:
    # Generous: on a loaded machine each round (beats sent, actions listed) is slow.
    deadline = time.monotonic() + scaled(within)
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def actions(api: Api) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = (await api.get("/api/v1/actions", limit=100))["items"]
    return items[::-1]


#: A job that hangs soon after it stops stepping, and whose hosts are never lost.
HANGS: dict[str, Any] = {
    "heartbeat_polling_period_s": 0.05,
    "heartbeat_timeout_s": 30,
    "hang_timeout_s": 0.3,
    "hang_warmup_intervals": 0,
}


async def hang_remedy_running(api: Api) -> dict[str, Any]:
    """Train 8 steps, then stop stepping: the hang's restart in place, once it runs."""
    await train(api, 8)

    async def remedy_running() -> Any:
        await send(api, beat("n0", 8), beat("n1", 8))
        return [a for a in await actions(api) if a["type"] == "restart_in_place"]

    (restart,) = await until(remedy_running)
    return restart  # type: ignore[no-any-return]


async def test_a_worker_that_hangs_then_crashes_gets_one_remedy(
    make_settings: SettingsFactory,
) -> None:
    backend = HeldRestarts()
    async with running(make_settings(**HANGS), backend=backend) as api:
        restart = await hang_remedy_running(api)
        # The hung worker then crashes, while its remedy runs.
        await send(api, beat("n0", 8, state="exited", exit_code=137), beat("n1", 8))
        backend.release.set()
        await api.settle()
        (hang,) = (await api.get("/api/v1/events", type="hang"))["items"]
        (crash,) = (await api.get("/api/v1/events", type="worker_exited"))["items"]
        assert [a["type"] for a in await actions(api)] == [
            "emergency_checkpoint",
            "restart_in_place",
        ]
        assert restart["event_id"] == hang["id"]
        assert crash["incident_action_id"] == restart["id"]
        listed = await api.get(f"/api/v1/actions/{restart['id']}")
        assert listed["attached_events"] == [crash["id"]]

        # The worker the remedy started (another pid) fails afterwards: a new failure,
        # which escalates as usual.
        await send(api, beat("n0", 8, pid=500), beat("n1", 8))
        await send(api, beat("n0", 8, state="exited", exit_code=1, pid=500), beat("n1", 8))
        await api.settle()
        kinds = [a["type"] for a in await actions(api)]
        assert kinds.count("restart_in_place") == 2, kinds
        newest = (await api.get("/api/v1/events", type="worker_exited"))["items"][0]
        assert newest["incident_action_id"] is None


async def test_a_world_the_remedy_started_that_fails_before_it_is_recorded_finished_escalates(
    make_settings: SettingsFactory,
) -> None:
    """A script that exits at once fails again before its restart is recorded finished:
    its workers' exits (pids the remedy did not find) are the new world's failure, not
    the old one's end. Attached, they left the job with every worker gone and nothing
    more to come: `supervisor run` waited for ever."""
    backend = HeldRestarts()
    async with running(make_settings(**HANGS), backend=backend) as api:
        restart = await hang_remedy_running(api)
        # The remedy's world starts (other pids) and fails, all before it finishes.
        await send(api, beat("n0", 8, pid=500), beat("n1", 8, pid=501))
        await send(
            api,
            beat("n0", 8, state="exited", exit_code=3, pid=500),
            beat("n1", 8, state="exited", exit_code=3, pid=501),
        )
        backend.release.set()
        await api.settle()
        kinds = [a["type"] for a in await actions(api)]
        assert kinds.count("restart_in_place") == 2, kinds
        exits = (await api.get("/api/v1/events", type="worker_exited"))["items"][::-1]
        assert len(exits) == 2, exits
        first, second = exits
        assert first["incident_action_id"] is None  # it drove the second remedy
        newest = [a for a in await actions(api) if a["type"] == "restart_in_place"][-1]
        assert newest["event_id"] == first["id"] and newest["id"] != restart["id"]
        assert second["incident_action_id"] == newest["id"]


async def test_a_node_lost_while_its_job_restarts_gets_one_hot_swap_after_it(
    make_settings: SettingsFactory,
) -> None:
    # Lost after 2 s of silence, while the restart is held: on a loaded machine a round
    # of beats (four nodes, then the actions listed) has taken over 0.5 s, and the nodes
    # still beating were lost too.
    settings = make_settings(heartbeat_polling_period_s=0.05, heartbeat_timeout_s=2.0)
    spare = {"node": "s1", "state": "spare"}
    backend = HeldRestarts()
    async with running(settings, backend=backend) as api:
        await send(api, spare)
        await train(api, 5, ("n0", "n1", "n2"))
        # n0's worker crashes: the job restarts in place (until released here).
        crashed = beat("n0", 5, state="exited", exit_code=1)

        async def restart_running() -> Any:
            await send(api, crashed, beat("n1", 5), beat("n2", 5), spare)
            return [a for a in await actions(api) if a["type"] == "restart_in_place"]

        await until(restart_running)
        # Meanwhile n2's worker ends on a collective timeout (exit 3), and n1 goes silent
        # (lost after 2 s): the first is the same incident, the second a node of its own.
        peer_gone = beat("n2", 5, state="exited", exit_code=3)

        async def n1_lost() -> bool:
            await send(api, crashed, peer_gone, spare)
            view = api.supervisor.sensor.node_view("n1")
            return view is not None and not view.alive

        await until(n1_lost)
        backend.release.set()  # the restart ends

        async def swapped() -> Any:
            await send(api, crashed, peer_gone, spare)
            done = await actions(api)
            return done if any(a["type"] == "hot_swap" for a in done) else None

        done = await until(swapped)
        assert [(a["type"], a["node"]) for a in done] == [
            ("emergency_checkpoint", None),
            ("restart_in_place", "n0"),
            ("emergency_checkpoint", None),
            ("hot_swap", "n1"),
        ], done
        restart, swap = done[1], done[3]
        assert swap["created_at"] >= restart["finished_at"]  # after it, not beside it
        (lost,) = (await api.get("/api/v1/events", type="host_heartbeat_lost", node="n1"))["items"]
        assert lost["incident_action_id"] is None and swap["event_id"] == lost["id"]
        (peer,) = (await api.get("/api/v1/events", type="worker_exited", node="n2"))["items"]
        assert peer["incident_action_id"] is not None


async def test_a_node_failing_again_during_its_remedy_counts_once_against_it(
    make_settings: SettingsFactory,
) -> None:
    """ECC errors that keep coming while the job restarts for the first are one failure
    of the node: the next incident is its second, not its fourth."""
    # Lost after 2 s of silence: on a loaded machine a round of beats (three nodes, then
    # the actions listed) has taken over 0.5 s, and n1, still beating, was lost.
    settings = make_settings(
        heartbeat_polling_period_s=0.05,
        heartbeat_timeout_s=2.0,
        max_workload_restarts=2,
        gpu_report_cooldown_s=0,
    )
    lag = timedelta(seconds=2.0 + 0.05)  # the detection lag: heartbeat timeout + polling
    spare = {"node": "s1", "state": "spare"}
    backend = HeldRestarts()
    async with running(settings, backend=backend) as api:
        await train(api, 5)

        def ecc(count: int) -> Any:
            report = {"kind": "ecc", "gpu": 0, "count": count, "time": utcnow().isoformat()}
            return {**beat("n0", 5), "gpu_reports": [report]}

        async def restarts() -> list[dict[str, Any]]:
            return [a for a in await actions(api) if a["type"] == "restart_workload"]

        await send(api, ecc(1), beat("n1", 5), spare)
        await until(lambda: keep_up(api, restarts, spare))
        await send(api, ecc(2), beat("n1", 5), spare)  # while it restarts
        await send(api, ecc(3), beat("n1", 5), spare)
        backend.release.set()  # the restart ends...

        async def ended() -> list[dict[str, Any]]:
            return [a for a in await restarts() if a["status"] == "succeeded"]

        (first,) = await until(lambda: keep_up(api, ended, spare))
        finished = datetime.fromisoformat(first["finished_at"])
        while utcnow() <= finished + lag:  # ...then the lag, within which its old workers'
            await send(api, beat("n0", 5), beat("n1", 5), spare)  # ends still belong to it
            await asyncio.sleep(0.05)
        await send(api, ecc(4), beat("n1", 5), spare)  # a new incident
        second = await until(lambda: keep_up(api, restarts, spare, count=2))
        assert "2 failures <= max_workload_restarts=2" in second[1]["reason"], second
        events = (await api.get("/api/v1/events", type="gpu_ecc"))["items"][::-1]
        attached = [e["incident_action_id"] for e in events]
        assert attached == [None, second[0]["id"], second[0]["id"], None], events


async def keep_up(api: Api, find: Any, spare: Any, count: int = 1) -> Any:
    """Heartbeats go on while waiting for `count` actions `find` returns."""
    await send(api, beat("n0", 5), beat("n1", 5), spare)
    found = await find()
    return found if len(found) >= count else None


class FailingHeldRestartsInPlace(HeldRestarts):
    """A restart in place runs until released, then fails (its workers never joined);
    anything else does nothing, as a dry run."""

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        result = await super().execute(action)
        if action.type is ActionType.RESTART_IN_PLACE:
            raise ActionError("the new world did not join", retryable=False)
        return result


async def test_a_remedy_that_fails_while_every_worker_exits_is_followed_by_another(
    make_settings: SettingsFactory,
) -> None:
    """The events that came while a remedy ran are no longer answered by it once it
    failed: the first goes to the policy (the whole job is restarted, the in-job rung
    having failed), the others attach to that new remedy. Without it the job would stay
    down: its workers are gone, and nothing else would ever be reported."""
    backend = FailingHeldRestartsInPlace()
    async with running(make_settings(**HANGS), backend=backend) as api:
        in_place = await hang_remedy_running(api)
        # While it runs, every worker of the job exits. The hosts go on beating: nothing
        # else is ever raised (no worker runs to hang or fall silent, no host is lost).
        exited = (
            beat("n0", 8, state="exited", exit_code=1),
            beat("n1", 8, state="exited", exit_code=1),
        )
        await send(api, *exited)
        backend.release.set()

        async def restarted_whole() -> Any:
            await send(api, *exited)
            done = await actions(api)
            return done if any(a["type"] == "restart_workload" for a in done) else None

        done = await until(restarted_whole)
        await api.settle()
        done = await actions(api)
        assert [(a["type"], a["status"]) for a in done] == [
            ("emergency_checkpoint", "succeeded"),
            ("restart_in_place", "failed"),
            ("emergency_checkpoint", "succeeded"),
            ("restart_workload", "succeeded"),
        ], done
        whole = done[3]
        assert "last remedy failed" in whole["reason"], whole
        crashes = (await api.get("/api/v1/events", type="worker_exited"))["items"][::-1]
        assert len(crashes) == 2, crashes
        first, second = crashes
        # Neither is attached to the failed remedy: the first drove the new one, the
        # second is attached to it.
        assert whole["event_id"] == first["id"] and first["incident_action_id"] is None
        assert second["incident_action_id"] == whole["id"]
        listed = await api.get(f"/api/v1/actions/{in_place['id']}")
        assert listed["attached_events"] == []


class FailingFirstHotSwap(RecordingBackend):
    """The first hot-swap fails (its spare never joined); anything else does nothing, as a
    dry run."""

    def __init__(self) -> None:
        super().__init__()
        self.swaps = 0

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        if action.type is ActionType.HOT_SWAP:
            self.swaps += 1
            if self.swaps == 1:
                raise ActionError("the spare did not join", retryable=False)
        return await super().execute(action)


async def test_after_a_failed_hot_swap_the_node_still_down_is_swapped_before_any_restart(
    make_settings: SettingsFactory,
) -> None:
    """n1 is lost and its hot-swap fails: the job holds a node that is down. The next
    failure of the job does not restart it whole on that node (it would fail there
    again): n1 is swapped for the spare once more, every rank started afresh."""
    settings = make_settings(
        heartbeat_polling_period_s=0.05, heartbeat_timeout_s=2.0, max_workload_restarts=0
    )
    spare = {"node": "s2", "state": "spare"}
    async with running(settings, backend=FailingFirstHotSwap()) as api:
        await send(api, spare)
        await train(api, 5)

        async def remedied_twice() -> Any:
            # n1 is silent from now on; n0 and the spare beat on, and after the failed
            # swap n0's worker crashes.
            done = await actions(api)
            failed = [a for a in done if a["type"] == "hot_swap" and a["status"] == "failed"]
            n0 = beat("n0", 5, state="exited", exit_code=1) if failed else beat("n0", 5)
            await send(api, n0, spare)
            remedies = [
                a
                for a in done
                if a["type"] != "emergency_checkpoint" and a["status"] in ("succeeded", "failed")
            ]
            return len(remedies) >= 2

        await until(remedied_twice)
        await api.settle()
        done = await actions(api)
        disruptive = [a for a in done if a["type"] != "emergency_checkpoint"]
        assert [(a["type"], a["node"], a["status"]) for a in disruptive] == [
            ("hot_swap", "n1", "failed"),
            ("hot_swap", "n1", "succeeded"),
        ], done
        again = disruptive[1]
        assert again["params"] == {"spare": "s2", "in_process": False}, again
        assert "last remedy failed and its node n1 is down" in again["reason"], again
