"""What the controller knows of a job outlives the supervisor that learned it: a job given up
stays given up, and an incident's later signals still attach to its remedy, across a
`kill -9` of `supervisor serve` (restarted on the same SQLite file) and across a change of
leader (two replicas on PostgreSQL, the leader killed, the standby elected on the Lease of
the real Kubernetes API server, with the chart's ServiceAccount).

Real processes over real HTTP, as host monitors report and operators read; whether the
supervisor has decided on an event is read from its database (the event handled), since
"no remedy" shows nowhere else.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.failover import NAMESPACE, Replica
from bench.failover import OPERATOR_TOKEN as REPLICA_OPERATOR_TOKEN
from supervisor.domain import utcnow
from supervisor.store import BudgetRecord, IncidentRecord, Store, make_engine, open_store
from tests.chart_rbac import chart_identity
from tests.control_plane import ControlPlane
from tests.forked_services import start_service
from tests.test_e2e import AGENT, OPERATOR, Server
from tests.test_leader_election_real import LEASE_URL, LOADED_TIMING
from tests.timing import scaled, wait_until

#: The nodes' host monitors are never judged lost here: what is tested is what a worker's
#: exit leads to. Also the detection lag in which an old worker's late end still belongs to
#: its remedy's incident (heartbeat timeout plus a polling period).
SETTINGS: dict[str, Any] = {"heartbeat_timeout_s": 60.0, "max_no_progress_restarts": 1}


def beat(node: str, step: int, pid: int, state: str = "running", **extra: Any) -> dict[str, Any]:
    rank = int(node.lstrip("n"))
    worker = {"rank": rank, "local_rank": 0, "pid": pid, "state": state, "step": step, **extra}
    return {"node": node, "state": "running", "job": "j1", "workers": [worker]}


class Nodes:
    """Job j1 on n0 and n1 and a spare s1, as their host monitors report them to the
    supervisor at `url`; `store` reads its database."""

    def __init__(
        self, url: str, database_url: str, agent: dict[str, str], operator: dict[str, str]
    ) -> None:
        self.client = httpx.Client(base_url=url, timeout=10)
        self.store = Store(make_engine(database_url))
        self.agent = agent
        self.operator = operator
        self.pids = {"n0": 100, "n1": 101}
        self.step = 0

    def close(self) -> None:
        self.client.close()
        self.store.close()

    def send(self, body: dict[str, Any]) -> list[int]:
        r = self.client.post("/api/v1/heartbeats", json=body, headers=self.agent)
        assert r.status_code in (202, 204), r.text
        return list(r.json()["events"]) if r.status_code == 202 else []

    def beat(self, **workers: dict[str, Any]) -> list[int]:
        events: list[int] = []
        for node in ("n0", "n1"):
            events += self.send(beat(node, self.step, self.pids[node], **workers.get(node, {})))
        self.send({"node": "s1", "state": "spare"})
        return events

    def train_to(self, step: int) -> None:
        while self.step < step:
            self.step += 1
            self.beat()

    def decided(self, event_ids: list[int]) -> None:
        """Wait until the supervisor has handled these events (its decision recorded)."""
        assert event_ids

        def handled() -> bool:
            pending = {e.id for e in self.store.unhandled_events()}
            return not pending.intersection(event_ids)

        wait_until(handled, f"events {event_ids} handled", 30)

    def crash(self, node: str = "n0", exit_code: int = 1) -> list[int]:
        """`node`'s worker exits; once decided, the remedy (if any) starts a new one."""
        events = self.beat(**{node: {"state": "exited", "exit_code": exit_code}})
        self.decided(events)
        self.pids[node] += 100
        self.beat()
        return events

    def get(self, path: str, **params: Any) -> Any:
        r = self.client.get(path, params=params, headers=self.operator)
        assert r.status_code == 200, r.text
        return r.json()

    def actions(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("/api/v1/actions", limit=200)["items"]
        return items[::-1]

    def all_finished(self) -> list[dict[str, Any]]:
        return wait_until(
            lambda: (
                (done := self.actions())
                and all(a["status"] in ("succeeded", "failed") for a in done)
                and done
            ),
            "every action finished",
            30,
        )

    def given_up(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("/api/v1/events", type="job_given_up")["items"]
        return items


def give_up(nodes: Nodes) -> str:
    """Train, crash and be restarted, crash again before any progress: given up. The
    reason it says."""
    nodes.train_to(3)
    nodes.crash()
    assert nodes.all_finished()[-1]["type"].startswith("restart")
    nodes.crash()
    (said,) = wait_until(nodes.given_up, "the job given up", 30)
    reason: str = said["details"]["reason"]
    assert reason.startswith("1 remedies in a row were not followed by progress"), reason
    assert nodes.get("/api/v1/jobs/j1")["state"] == "given_up"
    return reason


def still_given_up(nodes: Nodes, reason: str) -> None:
    """The supervisor now serving still holds the job given up: a failure gets no remedy,
    and it is not said again."""
    before = [a["id"] for a in nodes.actions()]
    nodes.crash()
    assert [a["id"] for a in nodes.actions()] == before, "a remedy for a job given up"
    job = nodes.get("/api/v1/jobs/j1")
    assert (job["state"], job["given_up_reason"]) == ("given_up", reason), job
    assert len(nodes.given_up()) == 1


def test_a_job_given_up_stays_given_up_across_a_kill_9(tmp_path: Path) -> None:
    server = Server(tmp_path, **SETTINGS)
    server.start()
    nodes = Nodes(server.url, f"sqlite:///{tmp_path}/supervisor.db", AGENT, OPERATOR)
    try:
        reason = give_up(nodes)
        server.kill()
        server.start()
        still_given_up(nodes, reason)

        # An operator's reset is kept too: after the next kill the job is healed again.
        r = nodes.client.post("/api/v1/jobs/j1/reset-budget", headers=OPERATOR)
        assert r.status_code == 200 and r.json()["job"]["state"] != "given_up", r.text
        server.kill()
        server.start()
        assert nodes.get("/api/v1/jobs/j1")["state"] != "given_up"
        before = len(nodes.actions())
        nodes.crash()
        assert nodes.all_finished()[before:][-1]["type"].startswith("restart")
    finally:
        nodes.close()
        server.stop()


def test_an_incidents_late_signal_after_a_kill_9_starts_no_second_remedy(
    tmp_path: Path,
) -> None:
    """n0's worker crashes and the job is restarted. n1's old worker ends too (a collective
    timeout once its peer was gone), but its end is only reported after the supervisor was
    killed and restarted: it belongs to the same incident, within the detection lag."""
    server = Server(tmp_path, **SETTINGS)
    server.start()
    nodes = Nodes(server.url, f"sqlite:///{tmp_path}/supervisor.db", AGENT, OPERATOR)
    try:
        nodes.train_to(3)
        nodes.crash()
        done = nodes.all_finished()
        remedy = done[-1]
        assert remedy["type"].startswith("restart"), done
        server.kill()
        server.start()
        late = nodes.beat(n1={"state": "exited", "exit_code": 3})  # pid 101, as decided
        nodes.decided(late)
        assert [a["id"] for a in nodes.actions()] == [a["id"] for a in done]  # no second remedy
        (event,) = [e for e in nodes.get("/api/v1/events", node="n1")["items"] if e["id"] in late]
        assert event["incident_action_id"] == remedy["id"], event
        assert nodes.get(f"/api/v1/actions/{remedy['id']}")["attached_events"] == late
    finally:
        nodes.close()
        server.stop()


# --- a change of leader ---------------------------------------------------------------------


class ActingReplica(Replica):
    """A replica of `supervisor serve` with leader election on whose backend answers as one
    that acts (tests/acting_stand_in.py), not as a dry run."""

    def start(self, timeout_s: float = 30.0) -> ActingReplica:
        args = ["serve", "--port", str(self.port)]
        self.proc = start_service("tests.acting_stand_in", args, self.env, self.log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_text()
            try:
                if self.http.get("/healthz").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"replica {self.identity} did not serve:\n{self.log_text()}")


@pytest.fixture
def kubeconfig(control_plane: ControlPlane) -> Iterator[Path]:
    """The chart's ServiceAccount on the real control plane (its RBAC as Helm renders it),
    and no Lease of the chart's name before or after the test."""

    def no_lease() -> None:
        with control_plane.client() as admin:
            assert admin.delete(LEASE_URL).status_code in (200, 404)

    no_lease()
    yield chart_identity(control_plane, NAMESPACE).kubeconfig
    no_lease()


def test_a_job_given_up_stays_given_up_when_the_standby_takes_over(
    tmp_path: Path, pg_url: str, kubeconfig: Path
) -> None:
    replicas = [ActingReplica(name, tmp_path, kubeconfig, LOADED_TIMING) for name in ("a", "b")]
    for replica in replicas:
        replica.env["SUPERVISOR_DATABASE_URL"] = pg_url
        replica.env.update({f"SUPERVISOR_{k.upper()}": str(v) for k, v in SETTINGS.items()})
    operator = {"Authorization": f"Bearer {REPLICA_OPERATOR_TOKEN}"}
    agent = {"Authorization": f"Bearer {replicas[0].env['SUPERVISOR_AGENT_TOKEN']}"}
    try:
        for replica in replicas:
            replica.start(scaled(60))
        leader = wait_until(
            lambda: next((r for r in replicas if r.readyz()[0] == 200), None), "a leader", 30
        )
        standby = next(r for r in replicas if r is not leader)
        nodes = Nodes(leader.url, pg_url, agent, operator)
        try:
            reason = give_up(nodes)
        finally:
            nodes.close()

        leader.kill()
        wait_until(lambda: standby.readyz()[0] == 200, "the standby leading", 30)
        nodes = Nodes(standby.url, pg_url, agent, operator)
        nodes.step, nodes.pids = 3, {"n0": 300, "n1": 101}
        try:
            still_given_up(nodes, reason)
        finally:
            nodes.close()
    finally:
        for replica in replicas:
            replica.close()


# --- the store ------------------------------------------------------------------------------


def test_the_store_gives_back_what_was_kept_and_a_dry_run_keeps_its_own(database_url: str) -> None:
    live = open_store(database_url)
    dry = Store(make_engine(database_url), dry_run=True)
    try:
        now = utcnow()
        assert live.save_budget("j1", BudgetRecord(2, 7, 41, None, now), epoch=1)
        assert live.save_budget("j1", BudgetRecord(3, 9, 42, "spent", now), epoch=1)
        incident = IncidentRecord(42, 5, frozenset({"n0"}), frozenset({("n0", 0, 100)}), now)
        assert live.save_incident("j1", incident, epoch=1)
        assert dry.save_budget("j1", BudgetRecord(1), epoch=None)
        assert live.load_budgets() == {"j1": BudgetRecord(3, 9, 42, "spent", now)}
        assert live.load_incidents() == {"j1": incident}
        assert dry.load_budgets() == {"j1": BudgetRecord(1)} and dry.load_incidents() == {}
    finally:
        dry.close()
        live.close()


def test_an_older_leaders_write_never_wins(database_url: str) -> None:
    """A replica deposed while a decision of its own was on its way writes after the new
    leader: its write is refused, and the new leader's give-up stands."""
    store = open_store(database_url)
    try:
        newer = BudgetRecord(1, 3, 8, "spent")
        assert store.save_budget("j1", newer, epoch=7)
        assert not store.save_budget("j1", BudgetRecord(2, 3, 9), epoch=6)
        assert store.load_budgets() == {"j1": newer}
        incident = IncidentRecord(8, 4, frozenset({"n0"}), frozenset(), utcnow())
        assert store.save_incident("j1", incident, epoch=7)
        assert not store.save_incident("j1", replace(incident, action_id=9), epoch=6)
        assert store.load_incidents() == {"j1": incident}
        assert store.save_budget("j1", BudgetRecord(), epoch=8)  # a newer one's write does
        assert store.load_budgets() == {"j1": BudgetRecord()}
    finally:
        store.close()
