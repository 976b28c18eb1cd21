"""A dry-run supervisor shadows the acting one: its actions are marked and counted apart,
and host monitors copy their heartbeats to it without it ever slowing the acting
supervisor's. On Kubernetes (watching read only, writing nothing):
tests/test_dry_run_real.py."""

from __future__ import annotations

import re
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from supervisor.domain import ActionRequest, ActionType
from supervisor.store import ActionFilter, open_store
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN
from tests.forked_services import start_service
from tests.http import http
from tests.test_host_monitor import Cluster, wait_for
from tests.test_host_monitor import Supervisor as ServedSupervisor

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


class ActingSupervisor(ServedSupervisor):
    """`supervisor serve` whose default backend stands in for one that acts (the dry-run
    backend would make it a dry run too): tests/acting_stand_in.py."""

    def start(self) -> None:
        args = ["serve", "--port", str(self.port)]
        self.proc = start_service("tests.acting_stand_in", args, self.env, self.log)

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
