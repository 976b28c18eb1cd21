"""A dry-run supervisor shadows the acting one: its actions are marked and counted apart,
on Kubernetes it watches the cluster (read only) and writes nothing, and host monitors
copy their heartbeats to it without it ever slowing the acting supervisor's."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.actuator import ActionError, DryRunBackend
from supervisor.api import create_app
from supervisor.domain import ActionRequest, ActionType
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.runtime import Supervisor, make_backend
from supervisor.store import ActionFilter, open_store
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN, SettingsFactory
from tests.http import http
from tests.kube import FakeKube
from tests.kube.harness import action, kube_settings, mutations, setup_cluster
from tests.test_host_monitor import Cluster, wait_for
from tests.test_host_monitor import Supervisor as ServedSupervisor
from tests.timing import scaled

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


def test_dry_run_actions_are_marked_and_counted_apart(database_url: str) -> None:
    """Two supervisors' records in one database: neither counts the other's actions
    toward its restart budget or its in-job restarts."""
    live, dry = open_store(database_url), open_store(database_url, dry_run=True)
    try:
        restart = ActionRequest(ActionType.RESTART_WORKLOAD, job="j1", reason="t")
        in_place = ActionRequest(ActionType.RESTART_IN_PLACE, job="j1", node="n1", reason="t")
        done, _ = live.create_action(restart, key="live-1", source="operator")
        would, _ = dry.create_action(restart, key="dry-1", source="operator")
        dry.create_action(in_place, key="dry-2", source="operator")
        dry.create_action(in_place, key="dry-3", source="operator")
        assert not done.dry_run and would.dry_run
        assert live.get_action(would.id).dry_run  # type: ignore[union-attr]
        start = done.created_at.replace(year=2000)
        live_counts, dry_counts = live.policy_counts(start), dry.policy_counts(start)
        assert live_counts.restarts_in_window == {"j1": 1}
        assert dry_counts.restarts_in_window == {"j1": 3}
        assert live_counts.action_counts == {("j1", ActionType.RESTART_WORKLOAD): 1}
        assert dry_counts.action_counts == {
            ("j1", ActionType.RESTART_WORKLOAD): 1,
            ("j1", ActionType.RESTART_IN_PLACE): 2,
        }
        only_dry = live.list_actions(ActionFilter(dry_run=True)).items
        only_live = live.list_actions(ActionFilter(dry_run=False)).items
        assert sorted(a.idempotency_key for a in only_dry) == ["dry-1", "dry-2", "dry-3"]
        assert [a.idempotency_key for a in only_live] == ["live-1"]
    finally:
        live.close()
        dry.close()


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(time_scale=0.01, bookmark_interval=0.1, tick=0.02) as k:
        yield k


async def test_dry_run_on_kubernetes_builds_a_read_only_watcher(
    kube: FakeKube, make_settings: SettingsFactory, tmp_path: Path
) -> None:
    """The supervisor's own factory: dry run with `backend: kubernetes` keeps the
    Kubernetes backend, read only, under the recording one; it refuses to act."""
    kube.add_node("gpu-0", gpus=8, labels={"gpu": "true"})
    config = tmp_path / "kubeconfig"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "ctx", "context": {"cluster": "fake", "user": "u"}}],
                "current-context": "ctx",
            }
        )
    )
    backend = make_backend(kube_settings(make_settings, dry_run=True, kube_config=str(config)))
    assert isinstance(backend, DryRunBackend)
    watching = backend.watching
    assert isinstance(watching, KubeBackend) and watching.read_only
    since = len(kube.requests)
    try:
        cordon = action(ActionType.CORDON, node="gpu-0", job=None)
        assert await backend.execute(cordon) == {"dry_run": True}
        with pytest.raises(ActionError, match="only watches"):
            await watching.execute(cordon)
    finally:
        await backend.close()
    assert mutations(kube, since) == []
    assert not kube.get("Node", "gpu-0")["spec"].get("unschedulable")


async def _wait(predicate: Any, timeout: float = 10.0) -> Any:
    # Scaled: under both sessions' load the cluster watch and the policy's loop took
    # longer than 10 s (seen once in a clean-clone run).
    deadline = asyncio.get_running_loop().time() + scaled(timeout)
    while True:
        value = await predicate()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.05)


async def test_a_dry_run_supervisor_decides_from_the_cluster_and_writes_nothing(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """The real app in dry run with the Kubernetes backend: the JobSet's bounds and the
    spare come from the cluster watch, a node going NotReady is sensed, a lost node is
    'hot-swapped' to the spare on record only, and the fake API server sees no write."""
    pods = setup_cluster(kube, nodes=3, annotations={o.MIN_REPLICAS: "1"})
    used = sorted(p["spec"]["nodeName"] for p in pods)
    spare = next(n for n in ("gpu-0", "gpu-1", "gpu-2") if n not in used)
    bad = used[0]
    settings = kube_settings(
        make_settings,
        dry_run=True,
        heartbeat_timeout_s=1.5,
        heartbeat_polling_period_s=0.2,
        max_workload_restarts=0,
    )
    watching = KubeBackend(
        settings, kube.client(), request_timeout_s=2.0, watch_timeout_s=2, read_only=True
    )
    supervisor = Supervisor(settings, backend=DryRunBackend(watching=watching))
    app = create_app(settings, supervisor)
    since = len(kube.requests)

    def beat(node: str, step: int) -> dict[str, Any]:
        if node == spare:
            return {"node": node, "state": "spare", "address": "http://127.0.0.1:9"}
        rank = used.index(node)
        worker = {"rank": rank, "local_rank": 0, "pid": 10 + rank, "state": "running", "step": step}
        return {
            "node": node,
            "state": "running",
            "job": "train",
            "workers": [worker],
            "address": "http://127.0.0.1:9",
        }

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            silent: set[str] = set()

            async def beating() -> None:
                step = 0
                while True:
                    step += 1
                    for node in (*used, spare):
                        if node not in silent:
                            await http.post(
                                "/api/v1/heartbeats", json=beat(node, step), headers=AGENT
                            )
                    await asyncio.sleep(0.2)

            beats = asyncio.create_task(beating())
            try:

                async def job() -> dict[str, Any] | None:
                    r = await http.get("/api/v1/jobs/train", headers=OPERATOR)
                    body: dict[str, Any] = r.json()
                    return body if r.status_code == 200 and body["nodes"] else None

                view = await _wait(job)
                assert view["min_num_dp_replicas"] == 1  # from the JobSet's annotation
                # Kubernetes sensing stays on in dry run.
                kube.set_node_ready(used[1], False)

                async def not_ready() -> list[dict[str, Any]]:
                    r = await http.get(
                        "/api/v1/events", params={"type": "node_not_ready"}, headers=OPERATOR
                    )
                    items: list[dict[str, Any]] = r.json()["items"]
                    return items

                [event] = await _wait(not_ready)
                assert event["node"] == used[1]

                async def swaps(count: int) -> list[dict[str, Any]] | None:
                    r = await http.get(
                        "/api/v1/actions",
                        params={"type": "hot_swap", "dry_run": "true"},
                        headers=OPERATOR,
                    )
                    done = [a for a in r.json()["items"] if a["status"] == "succeeded"]
                    return done[::-1] if len(done) >= count else None

                # The default policy's answer to a node gone NotReady, on record only.
                [first] = await _wait(lambda: swaps(1))
                assert first["node"] == used[1] and first["params"]["spare"] == spare
                assert first["dry_run"] is True and first["result"] == {"dry_run": True}
                kube.set_node_ready(used[1], True)
                silent.add(bad)  # its host monitor stops: lost, swapped (on record)
                second = (await _wait(lambda: swaps(2)))[1]
                assert second["node"] == bad and second["params"]["spare"] == spare
                assert second["dry_run"] is True
                live = await http.get(
                    "/api/v1/actions", params={"dry_run": "false"}, headers=OPERATOR
                )
                assert live.json()["items"] == []
            finally:
                beats.cancel()
                await asyncio.gather(beats, return_exceptions=True)
    # Nothing was written: no cordon, no taint, no eviction, no Kubernetes event.
    assert mutations(kube, since) == []
    node = kube.objects("Node", None)
    assert not any(n["spec"].get("unschedulable") for n in node)


class ActingSupervisor(ServedSupervisor):
    """`supervisor serve` whose default backend stands in for one that acts (the dry-run
    backend would make it a dry run too): tests/acting_stand_in.py."""

    def start(self) -> None:
        command = [sys.executable, "-m", "tests.acting_stand_in", "serve", "--port", str(self.port)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                return http.get(f"{self.url}/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, 30, "supervisor ready")


def test_host_monitors_copy_heartbeats_to_a_shadow_supervisor(tmp_path: Path) -> None:
    """The acting supervisor and a dry-run shadow both see the node and its GPU error;
    the shadow records what it would do, marked so. Stopping the shadow changes nothing
    for the acting supervisor."""
    main_dir, shadow_dir, nodes = tmp_path / "main", tmp_path / "shadow", tmp_path / "cluster"
    for directory in (main_dir, shadow_dir, nodes):
        directory.mkdir()
    main = ActingSupervisor(main_dir)
    shadow = ServedSupervisor(shadow_dir, env={"SUPERVISOR_DRY_RUN": "true"})
    main.start()
    shadow.start()
    cluster = Cluster(nodes)
    try:
        agent = cluster.start_agent(
            main.url, env={"HOST_MONITOR_SHADOW_SUPERVISOR_URLS": shadow.url}
        )
        for server in (main, shadow):
            wait_for(partial(server.node, agent.node), 10, f"{server.url} hearing of the node")
        agent.fault(kind="xid", code=79, gpu=1)  # bad hardware on a spare: cordon it
        for server in (main, shadow):
            server.wait_event(agent.node, "gpu_xid")

        def cordons(server: ServedSupervisor) -> list[dict[str, Any]]:
            r = server.http.get("/api/v1/actions", params={"type": "cordon"})
            return [a for a in r.json()["items"] if a["status"] == "succeeded"]

        wait_for(lambda: cordons(main) and cordons(shadow), 10, "a cordon decided")
        assert [a["dry_run"] for a in cordons(main)] == [False]
        assert [a["dry_run"] for a in cordons(shadow)] == [True]
        # The shadow goes away: the acting supervisor keeps hearing the node.
        logged = len(agent.log.read_bytes())
        shadow.stop()
        seen = main.node(agent.node)["last_heartbeat"]  # type: ignore[index]
        time.sleep(2.5)  # past the heartbeat timeout (1 s)
        after = main.node(agent.node)
        assert after is not None and after["alive"] and after["last_heartbeat"] > seen
        # Said in the host monitor's log once per problem, not once per heartbeat: the
        # copies fail a dozen times meanwhile. (A copy cut off as the shadow stops is
        # a problem of its own before the refused connections.)
        since = agent.log.read_bytes()[logged:].decode()
        said = re.findall(rf"heartbeat copy to shadow {shadow.url}\S* failed \((.*)\)", since)
        assert said and len(set(said)) == len(said), said
    finally:
        for a in cluster.agents:
            a.proc.terminate()
            a.proc.wait(10)
            a.close()
        main.stop()
        shadow.stop()
