"""A host monitor speaks only for its own node: node credentials, Kubernetes service
account tokens (against the fake API server of tests/kube), refusals (403, 401, 409) and
their counter, and the ranks two alive nodes cannot run at once, over HTTP against the
real app."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bench.failover import write_kubeconfig
from supervisor.config import Settings
from supervisor.identity.node_keys import node_credential
from tests.conftest import SettingsFactory
from tests.kube import FakeKube
from tests.test_api import AGENT, Api, heartbeat, running
from tests.test_host_monitor import Cluster, wait_for
from tests.test_host_monitor import Supervisor as SupervisorProcess

NODE_KEY = "node-key-for-tests-0123456789abcdef"
KUBE_TOKEN = "supervisor-kube-token"
NS = "training"
HOST_MONITOR_SA = f"system:serviceaccount:{NS}:rs-host-monitor"
AUDIENCE = "resiliency-supervisor"


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


# --- Kubernetes service account tokens -----------------------------------------------------------


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(token=KUBE_TOKEN, run_controllers=False) as k:
        k.add_node("gpu-0")
        k.add_node("gpu-1")
        for pod, node in (("hm-a", "gpu-0"), ("hm-b", "gpu-1")):
            k.create(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod, "namespace": NS},
                    "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]},
                }
            )
        yield k


def kube_settings(
    make_settings: SettingsFactory, kube: FakeKube, tmp_path: Path, **overrides: Any
) -> Settings:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", kube.url, KUBE_TOKEN)
    values: dict[str, Any] = {
        "agent_auth": ["kubernetes"],
        "kube_config": str(kubeconfig),
        "agent_kube_service_account": HOST_MONITOR_SA,
        "heartbeat_timeout_s": 30,
        "heartbeat_polling_period_s": 5,
        **overrides,
    }
    return make_settings(**values)


def reviews(kube: FakeKube) -> int:
    return sum(1 for r in kube.requests if r.path.endswith("/tokenreviews"))


async def test_a_service_account_token_speaks_for_the_node_of_its_pod(
    make_settings: SettingsFactory, kube: FakeKube, tmp_path: Path
) -> None:
    async with running(kube_settings(make_settings, kube, tmp_path)) as api:
        token = kube.service_account_token(NS, "rs-host-monitor", audiences=[AUDIENCE], pod="hm-a")
        for _ in range(3):
            r = await api.beat(heartbeat("gpu-0", job=None), headers=bearer(token))
            assert r.status_code in (202, 204), r.text
        assert reviews(kube) == 1  # reviewed once, then taken from the cache
        # The node comes from the review, not from what the body says.
        r = await api.beat(heartbeat("gpu-1", job=None), headers=bearer(token))
        assert r.status_code == 403
        assert r.json()["message"] == "node: 'gpu-1' is not the node of this credential ('gpu-0')"
        assert not api.supervisor.sensor.has_node("gpu-1")
        r = await api.client.post(
            "/api/v1/checkpoints",
            json={"reports": [checkpoint("gpu-1", "c")]},
            headers=bearer(token),
        )
        assert r.status_code == 403

        wrong = {
            "another audience": kube.service_account_token(
                NS, "rs-host-monitor", audiences=["https://kubernetes.default.svc"], pod="hm-b"
            ),
            "another service account": kube.service_account_token(
                NS, "default", audiences=[AUDIENCE], pod="hm-b"
            ),
            "no pod, so no node": kube.service_account_token(
                NS, "rs-host-monitor", audiences=[AUDIENCE]
            ),
            "not a token at all": "a.b.c",
        }
        for why, bad in wrong.items():
            r = await api.beat(heartbeat("gpu-1", job=None), headers=bearer(bad))
            assert r.status_code == 401, why
        assert not api.supervisor.sensor.has_node("gpu-1")
        assert (await refused(api)) == {
            "invalid_credential": len(wrong),
            "other_node": 2,
            "rank_claimed": 0,
        }


async def test_reviews_expire_and_an_api_server_outage_spares_known_tokens(
    make_settings: SettingsFactory, kube: FakeKube, tmp_path: Path
) -> None:
    settings = kube_settings(make_settings, kube, tmp_path, agent_kube_review_ttl_s=0.2)
    async with running(settings) as api:
        a = kube.service_account_token(NS, "rs-host-monitor", audiences=[AUDIENCE], pod="hm-a")
        b = kube.service_account_token(NS, "rs-host-monitor", audiences=[AUDIENCE], pod="hm-b")
        assert (await api.beat(heartbeat("gpu-0", job=None), headers=bearer(a))).status_code == 202
        await asyncio.sleep(0.3)  # past the TTL: reviewed again
        assert (await api.beat(heartbeat("gpu-0", job=None), headers=bearer(a))).status_code == 204
        assert reviews(kube) == 2

        # The API server cannot answer: a token it accepted before stays accepted; a new
        # one gets 503 (send it again), not 401.
        await asyncio.sleep(0.3)
        outage = kube.fail_next("create", "tokenreviews", 503, times=100)
        assert (await api.beat(heartbeat("gpu-0", job=None), headers=bearer(a))).status_code == 204
        r = await api.beat(heartbeat("gpu-1", job=None), headers=bearer(b))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "cannot check the token now" in r.json()["message"]
        outage.times = outage.hits  # the API server answers again

        # A token whose pod is gone is refused at its next review.
        kube.delete("Pod", "hm-a", namespace=NS, gracePeriodSeconds=0)
        await asyncio.sleep(0.3)
        assert (await api.beat(heartbeat("gpu-0", job=None), headers=bearer(a))).status_code == 401
        assert (await api.beat(heartbeat("gpu-1", job=None), headers=bearer(b))).status_code == 202


async def test_concurrent_first_requests_share_one_review_that_stalls_no_one(
    make_settings: SettingsFactory, kube: FakeKube, tmp_path: Path
) -> None:
    async with running(kube_settings(make_settings, kube, tmp_path)) as api:
        a = kube.service_account_token(NS, "rs-host-monitor", audiences=[AUDIENCE], pod="hm-a")
        b = kube.service_account_token(NS, "rs-host-monitor", audiences=[AUDIENCE], pod="hm-b")
        assert (await api.beat(heartbeat("gpu-1", job=None), headers=bearer(b))).status_code == 202
        kube.fail_next("create", "tokenreviews", None, delay=0.5)  # a slow API server
        first = asyncio.gather(
            *(api.beat(heartbeat("gpu-0", job=None), headers=bearer(a)) for _ in range(5))
        )
        await asyncio.sleep(0.05)
        # Meanwhile the node whose token is already verified is not held up.
        loop = asyncio.get_running_loop()
        started = loop.time()
        known = await api.beat(heartbeat("gpu-1", job=None), headers=bearer(b))
        assert known.status_code == 204 and loop.time() - started < 0.2
        assert not first.done()
        assert {r.status_code for r in await first} <= {202, 204}
        assert reviews(kube) == 2  # b's, then one for the five requests with a


def test_a_host_monitor_heartbeats_with_its_rotating_service_account_token(
    kube: FakeKube, tmp_path: Path
) -> None:
    """A real supervisor (agent_auth kubernetes, the fake API server through a kubeconfig)
    and a real host monitor reading its projected token from a file, which the kubelet
    rewrites: the new token is sent, reviewed, and the node stays in service."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", kube.url, KUBE_TOKEN)
    server = SupervisorProcess(
        tmp_path,
        env={
            "SUPERVISOR_AGENT_AUTH": "kubernetes",
            "SUPERVISOR_KUBE_CONFIG": str(kubeconfig),
            "SUPERVISOR_AGENT_KUBE_SERVICE_ACCOUNT": HOST_MONITOR_SA,
        },
    )
    cluster = Cluster(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(
        kube.service_account_token(NS, "rs-host-monitor", audiences=[AUDIENCE], pod="hm-a")
    )
    try:
        server.start()
        cluster.start_agent(
            server.url,
            node="gpu-0",
            env={
                "HOST_MONITOR_AGENT_TOKEN": "",
                "HOST_MONITOR_SERVICE_ACCOUNT_TOKEN_FILE": str(token_file),
            },
        )
        wait_for(lambda: server.node("gpu-0"), 10, "gpu-0 at the supervisor")
        assert reviews(kube) == 1
        # The kubelet writes the next token before the first expires (atomically).
        rotated = tmp_path / "token.new"
        rotated.write_text(
            kube.service_account_token(NS, "rs-host-monitor", audiences=[AUDIENCE], pod="hm-a")
        )
        rotated.replace(token_file)
        wait_for(lambda: reviews(kube) == 2, 5, "the new token reviewed")
        time.sleep(0.5)  # a few more heartbeats, from the cache
        assert reviews(kube) == 2
        node = server.node("gpu-0")
        assert node is not None and node["alive"]
        assert server.events("gpu-0", "host_heartbeat_lost") == []
    finally:
        cluster.teardown()
        server.stop()
