"""A supervisor that a newer one has replaced cannot act on the nodes, and what it had
decided is carried out by the next one: a real local cluster (host monitors, the NumPy
job, the supervisor as a process) and a second supervisor on the same database.

The demo's supervisor acts in epoch 1. A second supervisor starts on the same database
(epoch 2) and commands the nodes once (an emergency checkpoint an operator asks for):
from then on the host monitors obey nothing older. A worker then crashes: the first
supervisor detects it and decides its remedy, but every command it sends is refused
(409 `stale_leader`), so the job is not touched by it and the remedy stays unfinished in
the database. A supervisor started again (epoch 3) resumes that remedy and heals the
job, whose final weights are those of a run without the fault.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.local.backend import LocalBackend
from supervisor.local.demo import LocalDemo
from tests.conftest import SettingsFactory
from tests.http import http
from tests.test_api import OPERATOR, running
from tests.test_in_process_restart import node_status
from tests.test_local_cluster import (
    STEPS,
    assert_same_weights,
    demos,
    job_step,
    output,
    reference_weights,
    wait_for,
)


@pytest.fixture
def start_demo(tmp_path: Path) -> Iterator[Callable[..., LocalDemo]]:
    yield from demos(tmp_path, "numpy")


def stale_commands(demo: LocalDemo, node: str) -> float:
    text = http.get(
        f"http://127.0.0.1:{demo.node_ports[node]}/metrics",
        headers={"Authorization": f"Bearer {demo.actuator_token}"},
        timeout=5,
    ).text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("host_monitor_stale_leader")]
    return float(line.rsplit(" ", 1)[1])


async def command_as_a_newer_supervisor(demo: LocalDemo, make_settings: SettingsFactory) -> int:
    """A second supervisor on the demo's database asks its nodes for an emergency
    checkpoint; its epoch."""
    settings = make_settings(
        database_url=f"sqlite:///{demo.run_dir}/supervisor.db",
        backend="local",
        local_run_dir=str(demo.run_dir),
        # It receives no heartbeats (the nodes send them to the demo's supervisor): it
        # must not judge them lost while it runs.
        heartbeat_timeout_s=3600,
        heartbeat_polling_period_s=60,
    )
    backend = LocalBackend(demo.run_dir, settings)
    async with running(settings, backend=backend) as api:
        epoch = api.supervisor.leader_epoch
        assert epoch is not None
        body = {"type": "emergency_checkpoint", "job": demo.options.job, "reason": "drill"}
        response = await api.client.post("/api/v1/actions", json=body, headers=OPERATOR)
        assert response.status_code == 202, response.text
        await api.settle()
        action = await api.get(f"/api/v1/actions/{response.json()['id']}")
        assert action["status"] == "succeeded", action
    await backend.close()
    return epoch


def actions(demo: LocalDemo) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = demo.api("/api/v1/actions")["items"]
    return items


def test_a_replaced_supervisor_cannot_act_and_the_next_one_carries_out_its_remedy(
    start_demo: Callable[..., LocalDemo], tmp_path: Path, make_settings: SettingsFactory
) -> None:
    expected = reference_weights(tmp_path, 2, 1, STEPS, "numpy")
    # Slow steps (30 s for the job): the second supervisor starts beside it, which took
    # longer than the rest of a 6 s job on a loaded machine, and a job that ended before
    # the fault needs no remedy.
    demo = start_demo(step_time_s=0.2)
    victim = demo.options.nodes[1]
    wait_for(lambda: job_step(demo) >= 15, what="training to reach step 15")
    assert asyncio.run(command_as_a_newer_supervisor(demo, make_settings)) >= 2
    assert job_step(demo) < STEPS - 5, "the job ran out before its fault: slower steps needed"
    attempt = json.loads((demo.run_dir / "cluster.json").read_text())["job"]["attempt"]

    # A worker crashes: the demo's supervisor (epoch 1) decides a remedy, and is refused.
    (worker,) = node_status(demo, victim)["workers"]
    os.kill(worker["host_pid"], signal.SIGKILL)
    wait_for(lambda: stale_commands(demo, demo.options.nodes[0]) >= 1, what="a refused command")
    decided = wait_for(lambda: actions(demo), what="the remedy recorded")
    assert not any(a["status"] == "succeeded" for a in decided if a["reason"] != "drill"), decided
    state = json.loads((demo.run_dir / "cluster.json").read_text())
    assert state["job"]["attempt"] == attempt  # the job was not restarted by it
    assert {w["state"] for w in node_status(demo, victim)["workers"]} != {"running"}

    # The next supervisor (epoch 3) takes the unfinished remedy over and heals the job.
    demo.restart_supervisor()

    def healed() -> bool:
        mine = [a for a in actions(demo) if a["reason"] != "drill"]
        return bool(mine) and all(a["status"] == "succeeded" for a in mine)

    wait_for(healed, within=120, what="the remedy carried out by the next supervisor")
    weights = wait_for(lambda: output(demo), within=180, what="the job to finish")
    assert_same_weights(weights, expected)
