"""End to end over real HTTP against a real `supervisor serve` process.

Nodes heartbeat from this process; the supervisor runs as a child that we can SIGKILL.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.local.ports import free_port
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN
from tests.forked_ranks import RankProcess
from tests.forked_services import start_service
from tests.http import http
from tests.test_api import heartbeat
from tests.timing import scaled

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


class Server:
    def __init__(self, tmp: Path, **settings: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"server-{self.port}.log"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")},
            "SUPERVISOR_DATABASE_URL": f"sqlite:///{tmp}/supervisor.db",
            "SUPERVISOR_AGENT_TOKEN": AGENT_TOKEN,
            "SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN,
            "SUPERVISOR_ENABLE_FAULT_INJECTION": "true",
            "SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S": "0.1",
            "SUPERVISOR_HEARTBEAT_TIMEOUT_S": "1.0",
            **{f"SUPERVISOR_{k.upper()}": str(v) for k, v in settings.items()},
        }
        self.proc: RankProcess | None = None

    def start(self) -> None:
        # The default backend stands in for one that acts (tests/acting_stand_in.py).
        args = ["serve", "--port", str(self.port)]
        self.proc = start_service("tests.acting_stand_in", args, self.env, self.log)
        deadline = time.monotonic() + scaled(30)
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if http.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()  # not left running after the test
        raise AssertionError(f"server did not become ready:\n{self.log.read_text()}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def serving(tmp: Path, **settings: Any) -> Iterator[Server]:
    server = Server(tmp, **settings)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _poll(predicate: Any, within: float = 15.0) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def test_silent_node_is_detected_and_hot_swapped(tmp_path: Path) -> None:
    with serving(tmp_path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            live = {"n1", "n2", "s1"}
            last_beat: dict[str, float] = {}

            async def beat_forever() -> None:
                while True:
                    for node in sorted(live):
                        body = heartbeat(node, job=None if node == "s1" else "j1")
                        r = await client.post("/api/v1/heartbeats", json=body, headers=AGENT)
                        assert r.status_code in (202, 204), r.text
                        last_beat[node] = time.time()
                    await asyncio.sleep(0.1)

            beating = asyncio.create_task(beat_forever())
            try:
                await asyncio.sleep(0.5)
                live.discard("n1")
                silenced_after = last_beat["n1"]

                async def lost() -> list[dict[str, Any]]:
                    r = await client.get(
                        "/api/v1/events", params={"type": "host_heartbeat_lost"}, headers=OPERATOR
                    )
                    items: list[dict[str, Any]] = r.json()["items"]
                    return items

                events = await _poll(lost)
                detected_at = time.time()

                async def finished() -> list[dict[str, Any]]:
                    r = await client.get("/api/v1/actions", headers=OPERATOR)
                    items: list[dict[str, Any]] = r.json()["items"]
                    done = {"succeeded", "failed"}
                    return (
                        items if len(items) == 2 and all(a["status"] in done for a in items) else []
                    )

                actions = (await _poll(finished))[::-1]
            finally:
                beating.cancel()
    assert [e["node"] for e in events] == ["n1"]
    # Declared lost about heartbeat_timeout_s after the last heartbeat, not a period later.
    assert detected_at - silenced_after < 1.0 + 1.0
    assert events[0]["details"]["lateness_ms"] < 100
    assert [(a["type"], a["status"]) for a in actions] == [
        ("emergency_checkpoint", "succeeded"),
        ("hot_swap", "succeeded"),
    ]
    assert actions[1]["node"] == "n1" and actions[1]["params"] == {"spare": "s1"}
    assert all(a["event_id"] == events[0]["id"] for a in actions)


#: Five XIDs may each get a remedy of their own (each arriving once the last remedy
#: finished, as the recording backend finishes at once) or be attached to one: either is
#: handling once. The budget of remedies without progress (3 by default) would give the
#: job up on the fourth, which is not what this test is about.
HANDLED_ONCE = dict(
    heartbeat_timeout_s=60, heartbeat_polling_period_s=5, max_no_progress_restarts=10
)


async def test_acknowledged_events_survive_sigkill_and_are_handled_once(tmp_path: Path) -> None:
    acknowledged: list[int] = []
    with serving(tmp_path, **HANDLED_ONCE) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            for node in ("n1", "n2"):
                await client.post("/api/v1/heartbeats", json=heartbeat(node), headers=AGENT)
            # Distinct codes, so the watchdog cooldown does not merge them.
            for code in (13, 31, 43, 45, 48):
                r = await client.post(
                    "/api/v1/faults",
                    json={"kind": "xid", "node": "n1", "code": code},
                    headers=OPERATOR,
                )
                assert r.status_code == 201
                acknowledged += r.json()["events"]
        server.kill()  # at once, while the policy's actions may be in flight
    assert len(acknowledged) == 5

    with serving(tmp_path, **HANDLED_ONCE) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            for event_id in acknowledged:
                r = await client.get(f"/api/v1/events/{event_id}", headers=OPERATOR)
                assert r.status_code == 200 and r.json()["type"] == "gpu_xid"

            async def all_finished() -> list[dict[str, Any]]:
                r = await client.get("/api/v1/actions", params={"limit": 1000}, headers=OPERATOR)
                items: list[dict[str, Any]] = r.json()["items"]
                handled = {a["event_id"] for a in items}
                handled |= {e for a in items for e in a["attached_events"]}
                done = all(a["status"] in ("succeeded", "failed") for a in items)
                return items if done and handled >= set(acknowledged) else []

            actions = await _poll(all_finished)
            nodes = (await client.get("/api/v1/nodes", headers=OPERATOR)).json()
            events = {
                e: (await client.get(f"/api/v1/events/{e}", headers=OPERATOR)).json()
                for e in acknowledged
            }
    keys = [a["idempotency_key"] for a in actions]
    assert len(keys) == len(set(keys))
    decided = 0
    for event_id in acknowledged:
        mine = [a for a in actions if a["event_id"] == event_id]
        attached = [a["id"] for a in actions if event_id in a["attached_events"]]
        # Each event was handled once: its own decision (a checkpoint, then the remedy),
        # or attached to the incident of a remedy already decided (the same node's XIDs).
        if mine:
            assert len(mine) == 2 and sorted(a["type"] for a in mine)[0] == "emergency_checkpoint"
            assert not attached and events[event_id]["incident_action_id"] is None
            decided += 1
        else:
            assert attached == [events[event_id]["incident_action_id"]], events[event_id]
    assert decided >= 1
    # Taken over after the restart, not declared lost.
    assert {n["name"]: n["alive"] for n in nodes} == {"n1": True, "n2": True}


async def test_heartbeats_arriving_together_each_get_their_own_answer(tmp_path: Path) -> None:
    """Heartbeats that arrive together each get their own answer (204, 202 with its own
    events, 422 naming its field), and only the valid ones change anything."""
    nodes = [f"n{i}" for i in range(1, 41)]
    crashed = set(nodes[7::10])
    invalid = set(nodes[3::10])

    def body(node: str, step: int) -> dict[str, Any]:
        beat = heartbeat(node, step=step)
        if node in crashed:
            beat["workers"][0].update(state="exited", exit_code=9)
        if node in invalid:
            beat["workers"][1]["step"] = -1
        return beat

    with serving(tmp_path, heartbeat_timeout_s=60, heartbeat_polling_period_s=5) as server:
        limits = httpx.Limits(max_connections=len(nodes))
        async with httpx.AsyncClient(base_url=server.url, timeout=10, limits=limits) as client:

            async def beat_all(make: Any) -> list[httpx.Response]:
                return list(
                    await asyncio.gather(
                        *(
                            client.post("/api/v1/heartbeats", json=make(n), headers=AGENT)
                            for n in nodes
                        )
                    )
                )

            registered = await beat_all(lambda n: heartbeat(n, step=10))
            assert {r.status_code for r in registered} == {204}
            for step in (11, 12, 13):
                sent = await beat_all(functools.partial(body, step=step))
                answers = dict(zip(nodes, sent, strict=True))
                for node, r in answers.items():
                    if node in invalid:
                        assert r.status_code == 422, r.text
                        assert r.json()["message"].startswith("workers.1.step:")
                    elif node in crashed and step == 11:
                        assert r.status_code == 202, r.text
                        [event_id] = r.json()["events"]
                        event = await client.get(f"/api/v1/events/{event_id}", headers=OPERATOR)
                        assert event.json()["node"] == node
                        assert event.json()["type"] == "worker_exited"
                    else:
                        assert r.status_code == 204, (node, step, r.text)
            exited = await client.get(
                "/api/v1/events", params={"type": "worker_exited"}, headers=OPERATOR
            )
            views = (await client.get("/api/v1/nodes", headers=OPERATOR)).json()
    assert sorted(e["node"] for e in exited.json()["items"]) == sorted(crashed)
    steps = {v["name"]: max(w["step"] for w in v["workers"]) for v in views}
    assert steps == {n: 10 if n in invalid else 13 for n in nodes}


def test_invalid_setting_stops_startup_with_one_line(tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")},
        "SUPERVISOR_DATABASE_URL": f"sqlite:///{tmp_path}/x.db",
        "SUPERVISOR_NUM_DP_REPLICAS": "many",
    }
    result = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("supervisor: ")
    assert "num_dp_replicas" in lines[0]


@pytest.mark.parametrize("policy", ["no_such_module:Policy", "policies.default:Nope"])
def test_bad_policy_stops_startup_with_one_line(tmp_path: Path, policy: str) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")},
        "SUPERVISOR_DATABASE_URL": f"sqlite:///{tmp_path}/x.db",
        "SUPERVISOR_POLICY": policy,
    }
    result = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("supervisor: policy")


async def test_the_learned_hang_timeout_survives_a_restart_of_the_supervisor(
    tmp_path: Path,
) -> None:
    # The floor above the long interval: no hang (and no restart) is declared meanwhile.
    settings = {"hang_min_timeout_s": 0.6, "hang_safety_factor": 2.0, "hang_warmup_intervals": 2}

    async def job(client: httpx.AsyncClient) -> dict[str, Any]:
        r = await client.get("/api/v1/jobs/j1", headers=OPERATOR)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    server = Server(tmp_path, **settings)
    server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            # Two warm-up intervals, then steps 0.05 s apart and one of 0.5 s.
            for step, pause in enumerate([0.05, 0.05, 0.05, 0.5, 0.05, 0.0], start=1):
                r = await client.post(
                    "/api/v1/heartbeats", json=heartbeat("n1", step=step), headers=AGENT
                )
                assert r.status_code in (202, 204), r.text
                await asyncio.sleep(pause)
            learned = (await job(client))["hang_timeout_s"]
            assert learned >= 2.0 * 0.5  # the long interval, times the safety factor
        server.kill()  # no chance to write anything on the way out
        server.start()
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            r = await client.post("/api/v1/heartbeats", json=heartbeat("n1", step=7), headers=AGENT)
            assert r.status_code in (202, 204), r.text
            # Watching again at once, with what was learned: not from the 0.1 s floor.
            assert (await job(client))["hang_timeout_s"] == learned
    finally:
        server.stop()
