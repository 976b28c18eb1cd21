"""In-process recovery of the PyTorch workload on the local cluster, with real processes.

The survivors of a fault keep their processes and their state: they leave the failed
process group, join a new world with the replaced rank, and train on. Checked here: the
path falls back to a full restart when it takes longer than its bound (and says why),
and six recoveries in a row leave the surviving process with the same threads and
file descriptors, every rank in the newest world, and weights bit-identical to a run
without faults.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from supervisor.actuator.backend import ActionError
from supervisor.domain import ActionRecord, ActionStatus, ActionType
from supervisor.local.backend import LocalBackend
from supervisor.local.cluster_state import ClusterState
from supervisor.local.demo import LocalDemo
from tests.conftest import SettingsFactory
from tests.http import http
from tests.test_local_cluster import (
    STEPS,
    demos,
    finished_actions,
    inject,
    job_step,
    output,
    reference_weights,
    wait_for,
)

pytest.importorskip("torch")

UNBOUNDED = {
    "SUPERVISOR_MAX_RESTARTS_IN_WINDOW": "1000",
    "SUPERVISOR_MAX_IN_JOB_RESTARTS": "1000",
    "SUPERVISOR_FLAP_MAX_LOSSES": "1000",
}


@pytest.fixture
def start_demo(tmp_path: Path) -> Iterator[Callable[..., LocalDemo]]:
    yield from demos(tmp_path, "torch")


def node_status(demo: LocalDemo, node: str) -> dict[str, Any]:
    response = http.get(
        f"http://127.0.0.1:{demo.node_ports[node]}/v1/status",
        headers={"Authorization": f"Bearer {demo.actuator_token}"},
        timeout=5,
    )
    response.raise_for_status()
    status: dict[str, Any] = response.json()
    return status


def process_resources(pid: int, samples: int = 5) -> tuple[int, int]:
    """(threads, open file descriptors) of a process: the fewest of a few samples 0.1 s
    apart, so that a checkpoint writer's thread or file caught at one moment is not
    counted."""
    seen = []
    for _ in range(samples):
        seen.append((len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))))
        time.sleep(0.1)
    return min(t for t, _ in seen), min(f for _, f in seen)


def test_an_in_process_restart_past_its_bound_falls_back_to_a_full_restart(
    start_demo: Callable[..., LocalDemo], tmp_path: Path
) -> None:
    expected = reference_weights(tmp_path, 2, 1, STEPS, "torch")
    demo = start_demo(supervisor_env={"SUPERVISOR_IN_PROCESS_RESTART_TIMEOUT_S": "0.01"})
    wait_for(lambda: job_step(demo) >= 20, what="training to reach step 20")
    inject(demo, kind="worker_crash", node=demo.options.nodes[0])
    actions = wait_for(lambda: finished_actions(demo, 2), what="the remediation")
    assert [(a["type"], a["status"]) for a in actions] == [
        ("emergency_checkpoint", "succeeded"),
        ("restart_in_place", "succeeded"),
    ], actions
    result = actions[1]["result"]
    assert result["path"] == "full_restart", result
    assert "did not join" in result["in_process_error"]
    weights = wait_for(lambda: output(demo), within=180, what="the job to finish")
    assert weights == expected


def test_a_replaced_rank_that_ends_before_it_joins_falls_back_at_once(
    start_demo: Callable[..., LocalDemo], tmp_path: Path
) -> None:
    """The crashed rank's replacement dies while it starts: the new world cannot form, so
    the in-process restart gives way to a full restart at once, not after its bound (a
    minute here: the action's attempt timed out first, once, under load)."""
    expected = reference_weights(tmp_path, 2, 1, STEPS, "torch")
    # No standby: the replacement starts from nothing, slow enough to be caught starting.
    demo = start_demo(
        warm_standby=False, supervisor_env={"SUPERVISOR_IN_PROCESS_RESTART_TIMEOUT_S": "60"}
    )
    victim = demo.options.nodes[0]
    wait_for(lambda: job_step(demo) >= 20, what="training to reach step 20")
    (old,) = node_status(demo, victim)["workers"]
    inject(demo, kind="worker_crash", node=victim)

    def replacement() -> list[dict[str, Any]]:
        return [
            w
            for w in node_status(demo, victim)["workers"]
            if w["host_pid"] != old["host_pid"] and w["state"] == "starting"
        ]

    (new,) = wait_for(replacement, what="the replacement starting")
    os.kill(new["host_pid"], 9)
    actions = wait_for(lambda: finished_actions(demo, 2), what="the remediation")
    result = actions[1]["result"]
    assert (actions[1]["type"], actions[1]["status"]) == ("restart_in_place", "succeeded")
    assert result["path"] == "full_restart", result
    assert f"rank 0 on {victim} ended before it joined" in result["in_process_error"], result
    weights = wait_for(lambda: output(demo), within=180, what="the job to finish")
    assert weights == expected


def remedy_of(demo: LocalDemo, fault_id: int) -> list[dict[str, Any]]:
    """The finished actions of the fault's remedy (its emergency checkpoint and restart)."""
    items = [a for a in demo.api("/api/v1/actions")["items"] if a["fault_id"] == fault_id]
    done = [a for a in items if a["status"] in ("succeeded", "failed")]
    return done if len(done) >= 2 and len(done) == len(items) else []


def test_six_recoveries_in_a_row_leak_nothing_and_lose_nothing(
    start_demo: Callable[..., LocalDemo], tmp_path: Path
) -> None:
    # Six: a leak of one thread or descriptor per recovery shows three more between the
    # first three and the last three, past the room left for a moment's writer (two).
    faults = 6
    # Enough steps that the job is still training at the last fault, however slowly the
    # recoveries go on a loaded machine (each lets it train some 20-30 steps).
    steps = 60 + faults * 50
    expected = reference_weights(tmp_path, 2, 1, steps, "torch")
    # Crashes only, no hang: a worker's progress bound of 5 s, not 2, so that a
    # replacement starved of the CPU for 2 s on a loaded machine is not lost besides
    # (seen once in CI: one more recovery than faults).
    demo = start_demo(total_steps=steps, supervisor_env=UNBOUNDED, worker_heartbeat_timeout_s=5.0)
    survivor_node, victim_node = demo.options.nodes[1], demo.options.nodes[0]
    wait_for(lambda: job_step(demo) >= 15, what="training to reach step 15")
    (survivor,) = node_status(demo, survivor_node)["workers"]
    pid = survivor["host_pid"]
    before = process_resources(pid)
    seen: list[tuple[int, int]] = []
    for n in range(faults):
        # The victim's rank of the newest world is up before the next crash (a crash of
        # a rank still starting would be a fault of another kind).
        wait_for(
            lambda: [
                w for w in node_status(demo, victim_node)["workers"] if w["state"] == "running"
            ],
            what=f"the victim's rank running before fault {n + 1}",
        )
        fault = inject(demo, kind="worker_crash", node=victim_node)
        done = wait_for(lambda f=fault["id"]: remedy_of(demo, f), what=f"recovery {n + 1}")
        # Trained in the new world: past the step the survivor held (the emergency
        # checkpoint's), which the job's last step, reported late, may not yet show.
        (saved,) = [a["result"]["step"] for a in done if a["type"] == "emergency_checkpoint"]
        wait_for(lambda s=saved: job_step(demo) > s + 3, what=f"training after recovery {n + 1}")
        seen.append(process_resources(pid))
    actions = demo.api("/api/v1/actions", limit=1000)["items"]
    restarts = [a for a in actions if a["type"] == "restart_in_place"]
    assert len(restarts) == faults
    assert all(a["status"] == "succeeded" for a in actions)
    assert {a["result"]["path"] for a in restarts} == {"in_process"}
    # The survivor is the same process throughout, and in the newest world.
    (survivor,) = node_status(demo, survivor_node)["workers"]
    assert survivor["host_pid"] == pid
    attempts = {
        w["attempt"]
        for node in (survivor_node, victim_node)
        for w in node_status(demo, node)["workers"]
        if w["state"] == "running"
    }
    assert len(attempts) == 1, attempts
    # Threads and descriptors do not grow with the recoveries: the first one may open
    # what later ones reuse (its new process group's), after that nothing accumulates. A
    # sample may still catch a checkpoint's writer or a pooled connection for a moment
    # (seen on a loaded machine: fds between 14 and 17 at any point of twenty): the
    # quietest of the last three against the quietest of the first three, with room for
    # two such. A leak of one per recovery would show five more.
    threads, fds = zip(*seen, strict=True)
    assert min(threads[-3:]) <= min(threads[:3]) + 2, (before, seen)
    assert min(fds[-3:]) <= min(fds[:3]) + 2, (before, seen)
    weights = wait_for(lambda: output(demo), within=300, what="the job to finish")
    assert weights == expected


def test_a_swap_retried_after_its_full_restart_failed_starts_that_world_again(
    start_demo: Callable[..., LocalDemo], make_settings: SettingsFactory, tmp_path: Path
) -> None:
    """A hot-swap's in-process heal fails (the survivor's host monitor is gone), and so
    does the full restart after it (that node cannot be started). Once the node is back,
    the action's retry sends the starts of the world the full restart began, which the
    spare that got its start answers again, and the job trains on to the weights of a run
    without faults. (It used to try in-process again, in one more world, and sent the
    spare another start under the same request id: 409, failed again.)"""
    expected = reference_weights(tmp_path, 2, 1, STEPS, "torch")
    # The supervisor only tells the step, then is killed: it must not act on its own
    # first. With the fixture's 1 s timeouts, a heartbeat late on a loaded machine had it
    # swap a node for the spare before the kill, which left the test's swap no spare.
    demo = start_demo(heartbeat_timeout_s=120.0, worker_heartbeat_timeout_s=120.0)
    wait_for(lambda: job_step(demo) >= 20, what="training to reach step 20")
    survivor, victim, spare = demo.options.nodes
    demo.kill_supervisor()  # the test's backend acts instead, one try at a time
    booted = ClusterState.load(demo.run_dir)
    assert (booted.job and booted.job.placement, booted.cordoned) == ([survivor, victim], [])
    settings = make_settings(
        backend="local",
        local_run_dir=str(demo.run_dir),
        local_stop_grace_s=2,
        in_process_restart_timeout_s=30,
    )
    swap = ActionRecord(
        id=1,
        type=ActionType.HOT_SWAP,
        status=ActionStatus.RUNNING,
        idempotency_key="drill-hot_swap",
        source="test",
        created_at=datetime.now(UTC),
        job=demo.options.job,
        node=victim,
        params={"spare": spare, "in_process": True},
    )
    monitor = demo.monitors[survivor]
    monitor.kill()
    monitor.wait(10)

    async def tries() -> tuple[str, dict[str, Any]]:
        backend = LocalBackend(demo.run_dir, settings)
        try:
            with pytest.raises(ActionError) as first:
                await backend.execute(swap)
            assert first.value.retryable
            demo.start_monitor(survivor)  # back, with no worker
            demo.wait_ready(f"{demo._node_url(survivor)}/healthz")
            return str(first.value), dict(await backend.execute(swap))
        finally:
            await backend.close()

    error, result = asyncio.run(tries())
    assert f"could not start workers on {{'{survivor}'" in error, error
    assert (result["path"], result["replaced"], result["by"]) == ("full_restart", victim, spare)
    assert result["placement"] == [survivor, spare], result
    attempt = str(result["attempt"])
    wait_for(
        lambda: all(
            [(w["attempt"], w["state"]) for w in node_status(demo, node)["workers"]]
            == [(attempt, "running")]
            for node in (survivor, spare)
        ),
        what=f"a rank on each node, training in world {attempt}",
    )
    weights = wait_for(lambda: output(demo), within=180, what="the job to finish")
    assert weights == expected
