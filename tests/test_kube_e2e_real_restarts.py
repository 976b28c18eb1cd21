"""Restarts end to end on the real Kubernetes control plane (tests/control_plane.py), with
the set-up of tests/test_kube_e2e_real.py (`supervisor serve` with the chart's
ServiceAccount token, a real host monitor per node, the chart's example JobSet whose
pods' processes tests/kube_real_kubelet.py runs): every worker crashing at once, an
operator's workload restart, and a node that keeps its job while one pod of it is
replaced by another.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.control_plane import ControlPlane, Identity
from tests.http import http
from tests.kube_real_fixtures import (
    HEARTBEAT_PERIOD_S,
    HEARTBEAT_TIMEOUT_S,
    env_fixture,
    tags,
    wait_for,
)
from tests.test_host_monitor import OPERATOR
from tests.test_host_monitor_lifecycle import Workers
from tests.test_kube_e2e_real import FAILURES, RESUMED, RealE2E, trains

e2e = env_fixture(RealE2E, "e2e")


def test_workers_crashing_together_restart_the_jobset_once(e2e: RealE2E) -> None:
    """Every worker dies at once (a NCCL error takes all ranks down): the real JobSet
    controller restarts the JobSet once; the four worker_exited events the supervisor
    hears must not add restarts of their own."""
    trains(e2e, None, attempt="0", steps=10)
    first = set(e2e.placement())
    for node in sorted(first):
        e2e.crash_worker(node)
    wait_for(lambda: len(e2e.events("worker_exited")) == 4, 20, "four worker_exited")
    trains(e2e, None, attempt="1", steps=10)
    actions = wait_for(e2e.settled, 30, "actions settled")
    restarts = [a for a in actions if a["type"] in ("restart_in_place", "restart_workload")]
    assert restarts, actions
    status = e2e.jobset_status()
    for action in restarts:
        assert action["status"] == "succeeded", action
        skipped = (action["result"] or {}).get("skipped", "")
        if not skipped:
            # The supervisor heard an exit before the kubelet reported it and restarted
            # that pod (see test_a_crash_restarts_the_jobset_once): the JobSet restarted
            # once all the same.
            assert status["restarts"] == 1, (status, actions)
        else:
            assert "already restarted" in skipped, action
    time.sleep(2 * HEARTBEAT_TIMEOUT_S)
    assert e2e.jobset_status()["restarts"] == 1
    assert set(e2e.placement().values()) == {"1"} and len(e2e.placement()) == 4


def operator_restart(e2e: RealE2E) -> None:
    r = http.post(
        f"{e2e.supervisor.url}/api/v1/actions",
        json={"type": "restart_workload", "job": e2e.job, "reason": "e2e: operator restart"},
        headers={**OPERATOR, "Idempotency-Key": "e2e-restart-1"},
    )
    assert r.status_code in (200, 201, 202), r.text


def test_a_workload_restart_stops_pods_without_a_storm_and_training_resumes(
    e2e: RealE2E,
) -> None:
    """An operator restarts the workload through the API: the supervisor evicts the
    JobSet's pods, each worker gets SIGTERM and tells its host monitor it is stopping, so
    its host monitor records it `stopped` and the supervisor sees no failure: no
    worker_exited event, no worker it saw `exited`, no further action. The real JobSet
    controller restarts the JobSet by the rule for the supervisor's restarts
    (restart-attempt 1, not counted toward maxRestarts); the new workers agree on the
    newest checkpoint every rank can load (the durable one at step 20 at least) and
    train on."""
    trains(e2e, None, attempt="0", steps=25)
    placed = set(e2e.placement())
    first = {c.uid for c in e2e.bridge.running()}
    old = {n: {w["pid"] for w in (e2e.node(n) or {}).get("workers") or []} for n in placed}
    assert all(old.values()), old
    operator_restart(e2e)
    seen: dict[str, set[str]] = {n: set() for n in placed}

    def all_stopped() -> bool:
        for name in placed:
            for worker in (e2e.node(name) or {}).get("workers") or []:
                seen[name].add(worker["state"])
        # Each old worker's end as its host monitor recorded it. In the supervisor's view
        # `stopped` lasts only until the node releases the worker (seconds): the polls of
        # a loaded machine missed it once, when the supervisor had seen it all the same
        # (no failure event, below).
        return all(
            f"(pid {pid}) stopped with exit code" in e2e.agents[name].log.read_text()
            for name, pids in old.items()
            for pid in pids
        )

    try:
        wait_for(all_stopped, 30, "every old worker stopped")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the states seen by node: {seen}") from None
    wait_for(
        lambda: (
            len({c.uid for c in e2e.bridge.running()} - first) == 4
            and e2e.training_on(set(e2e.placement()), "1")
        ),
        60,
        "new workers registered",
    )
    old = [c for c in e2e.bridge.containers.values() if c.uid in first]
    assert all(c.exit_code == 143 for c in old), [(c.pod, c.exit_code) for c in old]
    assert e2e.logs().count("terminated by SIGTERM") == 4
    status = e2e.jobset_status()
    assert status["restarts"] == 1 and status.get("restartsCountTowardsMax", 0) == 0, status
    resumed = wait_for(
        lambda: len(RESUMED.findall(e2e.logs())) == 4 and RESUMED.findall(e2e.logs()),
        15,
        "4 ranks resumed",
    )
    assert all(int(step) >= 20 for step, _ in resumed), resumed
    before = e2e.step()
    wait_for(lambda: e2e.step() >= before + 10, 20, "training goes on")
    actions = wait_for(e2e.settled, 30, "actions settled")
    assert [a["type"] for a in actions] == ["restart_workload"], actions
    (restart,) = actions
    assert restart["status"] == "succeeded" and restart["result"]["method"] == "evict", restart
    assert [e for e in e2e.events() if e["type"] in FAILURES] == []
    assert not any("exited" in states for states in seen.values()), seen


@pytest.fixture
def supervisor_only(
    control_plane: ControlPlane, kube_supervisor: Identity, tmp_path: Path
) -> Iterator[RealE2E]:
    """The supervisor on the real plane, with no node and no JobSet of its own."""
    env = RealE2E(control_plane, kube_supervisor, tmp_path, f"r{next(tags)}")
    env.supervisor.env.update(env.supervisor_env())
    try:
        env.supervisor.start()
        yield env
    finally:
        env.supervisor.stop()
        env.bridge.stop()
        env.cluster.teardown()


def test_a_node_forgets_the_workers_of_a_pod_replaced_on_it(supervisor_only: RealE2E) -> None:
    """A restart may put another rank on a node that keeps the job: once the supervisor
    has seen the old worker stopped, the node lists only the new one (not the old one as
    `stopped` for as long as it serves the job)."""
    e2e = supervisor_only
    side = f"{e2e.pool}-side-0"
    agent = e2e.cluster.start_agent(
        e2e.supervisor.url,
        node=side,
        heartbeat_polling_period_s=HEARTBEAT_PERIOD_S,
        idle_release_s=60.0,  # the node keeps its job between the two pods
    )
    (e2e.tmp / "side").mkdir()
    workers = Workers(e2e.tmp / "side", agent)
    try:

        def states() -> list[tuple[int, str]]:
            view = e2e.node(side) or {}
            return [(w["rank"], w["state"]) for w in view.get("workers") or []]

        first, _ = workers.start(0, "side-job")
        wait_for(lambda: states() == [(0, "running")], 20, "rank 0 running")
        first.send_signal(signal.SIGTERM)
        first.wait(10)
        wait_for(lambda: states() == [(0, "stopped")], 20, "rank 0 seen stopped")
        workers.start(1, "side-job")
        wait_for(lambda: states() == [(1, "running")], 20, "only rank 1 listed")
        assert (e2e.node(side) or {}).get("job") == "side-job"
        assert [e for e in e2e.events() if e["node"] == side and e["type"] in FAILURES] == []
    finally:
        workers.close()
