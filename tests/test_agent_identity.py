"""A host monitor speaks only for its own node: node credentials, refusals (403, 401, 409)
and their counter, and the ranks two alive nodes cannot run at once, over HTTP against
the real app. Kubernetes service account tokens: tests/test_agent_identity_real.py."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from supervisor.identity.node_keys import node_credential
from tests.conftest import SettingsFactory
from tests.test_api import AGENT, Api, heartbeat, running

NODE_KEY = "node-key-for-tests-0123456789abcdef"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def checkpoint(node: str, report_id: str) -> dict[str, Any]:
    return {
        "id": report_id,
        "node": node,
        "job": "j1",
        "rank": 2,
        "event": "saved",
        "step": 10,
        "duration_s": 0.5,
        "tier": "ram",
        "time": datetime.now(UTC).isoformat(),
    }


async def refused(api: Api) -> dict[str, float]:
    """supervisor_agent_requests_refused_total by reason, as /metrics shows it."""
    text = (await api.client.get("/metrics")).text
    pattern = r'^supervisor_agent_requests_refused_total\{reason="(\w+)"\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


@pytest.fixture
async def api(make_settings: SettingsFactory) -> AsyncIterator[Api]:
    settings = make_settings(
        agent_auth=["node_key"],
        node_key=NODE_KEY,
        heartbeat_timeout_s=30,
        heartbeat_polling_period_s=5,
    )
    async with running(settings) as a:
        yield a


# --- node credentials -------------------------------------------------------------------------


async def test_a_node_credential_speaks_for_its_node_only(api: Api) -> None:
    n1 = bearer(node_credential(NODE_KEY, "n1"))
    ok = await api.beat(heartbeat("n1"), headers=n1)
    assert ok.status_code == 204, ok.text
    assert api.supervisor.sensor.has_node("n1")

    events_before = await api.get("/api/v1/events")
    other = await api.beat(heartbeat("n2", gpu_reports=[{"kind": "xid", "code": 79}]), headers=n1)
    assert other.status_code == 403
    assert other.json()["message"] == "node: 'n2' is not the node of this credential ('n1')"
    assert not api.supervisor.sensor.has_node("n2")
    assert await api.get("/api/v1/events") == events_before  # no XID, no event of any kind
    assert (await refused(api))["other_node"] == 1

    # Checkpoint reports: each names its node, the credential's or refused, all or nothing.
    batch = {"reports": [checkpoint("n1", "a"), checkpoint("n2", "b")]}
    r = await api.client.post("/api/v1/checkpoints", json=batch, headers=n1)
    assert r.status_code == 403
    assert r.json()["message"] == "reports.1.node: 'n2' is not the node of this credential ('n1')"
    assert await api.get("/api/v1/checkpoints") == []
    r = await api.client.post(
        "/api/v1/checkpoints", json={"reports": batch["reports"][:1]}, headers=n1
    )
    assert r.status_code == 200 and r.json() == {"stored": 1, "duplicates": 0}
    assert (await refused(api))["other_node"] == 2


async def test_a_node_asks_whom_to_probe_for_itself_only(api: Api) -> None:
    """GET /api/v1/nodes/{node}/probe-targets: the node's neighbours on the ring of live
    nodes, for the node's own credential; another node's, 403; a node never heard, 404."""
    for n in ("n1", "n2", "n3"):
        body = {**heartbeat(n), "address": f"http://{n}.example:7000"}
        assert (
            await api.beat(body, headers=bearer(node_credential(NODE_KEY, n)))
        ).status_code == 204
    n1 = bearer(node_credential(NODE_KEY, "n1"))
    r = await api.client.get("/api/v1/nodes/n1/probe-targets", headers=n1)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "peers": [
            {"node": "n2", "url": "http://n2.example:7000"},
            {"node": "n3", "url": "http://n3.example:7000"},
        ]
    }
    other = await api.client.get("/api/v1/nodes/n2/probe-targets", headers=n1)
    assert other.status_code == 403
    assert other.json()["message"] == "node: 'n2' is not the node of this credential ('n1')"
    n9 = bearer(node_credential(NODE_KEY, "n9"))
    unknown = await api.client.get("/api/v1/nodes/n9/probe-targets", headers=n9)
    assert unknown.status_code == 404 and "n9" in unknown.json()["message"]
    anonymous = await api.client.get("/api/v1/nodes/n1/probe-targets")
    assert anonymous.status_code == 401


async def test_forged_credentials_and_the_shared_token_are_401_when_not_allowed(api: Api) -> None:
    good = node_credential(NODE_KEY, "n1")
    forged = [
        node_credential("another-key-0123456789abcdef0123456789", "n1"),
        good[:-1] + ("A" if good[-1] != "A" else "B"),  # one character of the MAC
        good.replace("node.n1.", "node.n2."),  # n1's MAC, for n2
        "node.n1.",
    ]
    for token in forged:
        r = await api.beat(heartbeat("n1"), headers=bearer(token))
        assert r.status_code == 401, token
        assert r.headers["www-authenticate"] == "Bearer"
        r = await api.client.post(
            "/api/v1/checkpoints", json={"reports": [checkpoint("n1", "x")]}, headers=bearer(token)
        )
        assert r.status_code == 401, token
    # agent_auth without `shared`: the agent token opens nothing.
    assert (await api.beat(heartbeat("n1"), headers=AGENT)).status_code == 401
    assert api.supervisor.sensor.node_names() == []
    assert (await refused(api))["invalid_credential"] == 2 * len(forged) + 1


async def test_the_shared_token_still_speaks_for_any_node_where_allowed(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(agent_auth=["shared", "node_key"], node_key=NODE_KEY)
    async with running(settings) as api:
        assert (await api.beat(heartbeat("n1"), headers=AGENT)).status_code == 204
        assert (await api.beat(heartbeat("n2"), headers=AGENT)).status_code == 204
        own = bearer(node_credential(NODE_KEY, "n3"))
        assert (await api.beat(heartbeat("n3"), headers=own)).status_code == 204
        assert (await api.beat(heartbeat("n4"), headers=own)).status_code == 403


def test_the_cli_prints_a_credential_that_works(
    tmp_path: Path, make_settings: SettingsFactory
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")},
        "SUPERVISOR_NODE_KEY": NODE_KEY,
    }
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "node-credential", "gpu-7.example"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    credential = done.stdout.strip()
    assert credential.startswith("node.gpu-7.example.") and done.stdout.count("\n") == 1

    async def beat() -> tuple[int, int]:
        settings = make_settings(agent_auth=["node_key"], node_key=NODE_KEY)
        async with running(settings) as api:
            own = await api.beat(heartbeat("gpu-7.example", job=None), headers=bearer(credential))
            other = await api.beat(heartbeat("gpu-8", job=None), headers=bearer(credential))
            return own.status_code, other.status_code

    own, other = asyncio.run(beat())
    assert own in (202, 204) and other == 403
    del env["SUPERVISOR_NODE_KEY"]
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "node-credential", "n1"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "node_key is not set (SUPERVISOR_NODE_KEY" in done.stderr


# --- ranks ------------------------------------------------------------------------------------


def workers(*ranks: int, state: str = "running") -> list[dict[str, Any]]:
    return [
        {"rank": r, "local_rank": i, "pid": 100 + i, "state": state, "step": 10}
        for i, r in enumerate(ranks)
    ]


def running_on(node: str, *ranks: int, state: str = "running") -> dict[str, Any]:
    return {"node": node, "state": "running", "job": "j1", "workers": workers(*ranks, state=state)}


async def test_a_rank_another_alive_node_runs_is_refused_but_a_hot_swap_takes_it(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(heartbeat_timeout_s=1.0, heartbeat_polling_period_s=0.2)
    async with running(settings) as api:
        assert (await api.beat(running_on("n1", 0, 1))).status_code in (202, 204)
        assert (await api.beat(running_on("n2", 2, 3))).status_code in (202, 204)

        # n3 claims rank 1 while n1, alive, runs it: refused, nothing recorded, counted.
        r = await api.beat(running_on("n3", 4, 1, state="starting"))
        assert r.status_code == 409
        assert r.json()["message"] == "workers.1.rank: rank 1 of job j1 is running on node n1"
        assert not api.supervisor.sensor.has_node("n3")
        assert (await refused(api))["rank_claimed"] == 1
        # A node already known is refused the same, and keeps what it had.
        r = await api.beat(running_on("n2", 2, 3, 0))
        assert r.status_code == 409 and "rank 0 of job j1 is running on node n1" in r.text
        assert [w.rank for w in api.supervisor.sensor.node_view("n2").workers] == [2, 3]

        # Once n1 no longer runs rank 1 (stopped on purpose), another node may take it.
        assert (await api.beat(running_on("n1", 0))).status_code in (202, 204)
        assert (await api.beat(running_on("n3", 1, state="starting"))).status_code in (202, 204)

        # Hot swap: n2 goes silent and is lost; the spare s1 takes its ranks.
        async def lost(node: str) -> bool:
            while api.supervisor.sensor.node_view(node).alive:
                await asyncio.sleep(0.05)
                for alive in ("n1", "n3"):  # the others keep beating
                    ranks = (0,) if alive == "n1" else (1,)
                    await api.beat(running_on(alive, *ranks))
            return True

        await asyncio.wait_for(lost("n2"), 5)
        assert (await api.beat({"node": "s1", "state": "spare"})).status_code in (202, 204)
        swapped = await api.beat(running_on("s1", 2, 3, state="starting"))
        assert swapped.status_code in (202, 204), swapped.text
        # n2 comes back still claiming them: refused while s1 runs them...
        r = await api.beat(running_on("n2", 2, 3))
        assert r.status_code == 409 and "rank 2 of job j1 is running on node s1" in r.text
        assert not api.supervisor.sensor.node_view("n2").alive
        # ...and welcome once its workers are stopped.
        assert (await api.beat(running_on("n2", 2, 3, state="stopped"))).status_code == 202
        assert api.supervisor.sensor.node_view("n2").alive
        assert (await refused(api))["rank_claimed"] == 3
