"""Commands from an older supervisor are refused by the host monitors.

Each supervisor that starts acting takes the next epoch from its database (SQLite and
PostgreSQL) and sends it with every command; a real host monitor process obeys no command
of an older epoch than the newest it obeyed (409 `stale_leader`, counted), and the
supervisor's client reads that refusal as `Fenced`, so the action is left to the newer
supervisor instead of failing or being retried.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from resiliency_protocol.leaders import LEADER_EPOCH_HEADER
from supervisor.actuator import Fenced
from supervisor.actuator.leader_epoch import stamp
from supervisor.store import Store, make_engine, open_store
from tests.acting_stand_in import RecordingBackend
from tests.conftest import SettingsFactory
from tests.http import http
from tests.test_api import running
from tests.test_host_monitor import ACTUATOR, Agent, Cluster, _pid_gone, wait_for


class EpochRecorder(RecordingBackend):
    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[int | None] = []

    def act_in_epoch(self, epoch: int | None) -> None:
        self.epochs.append(epoch)


async def epoch_of_a_start(make_settings: SettingsFactory, **settings: Any) -> int | None:
    backend = EpochRecorder()
    async with running(make_settings(**settings), backend=backend) as api:
        assert api.supervisor.leader_epoch == backend.epochs[-1]
    (epoch,) = backend.epochs  # told once, before anything could act
    return epoch


async def test_each_supervisor_that_starts_acting_takes_a_newer_epoch(
    make_settings: SettingsFactory, database_url: str
) -> None:
    first = await epoch_of_a_start(make_settings, database_url=database_url)
    assert first is not None and first >= 1
    assert await epoch_of_a_start(make_settings, database_url=database_url) == first + 1
    # A dry run commands nothing: it takes no epoch, and sends none.
    dry = await epoch_of_a_start(make_settings, database_url=database_url, dry_run=True)
    assert dry is None
    assert await epoch_of_a_start(make_settings, database_url=database_url) == first + 2


def test_supervisors_starting_at_once_never_share_an_epoch(database_url: str) -> None:
    """Four replicas' stores (an engine each, as four processes have) take epochs at once."""
    open_store(database_url).close()  # migrated once, as the first supervisor does
    stores = [Store(make_engine(database_url)) for _ in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            epochs = list(pool.map(lambda s: s[1].take_leader_epoch(f"r{s[0]}"), enumerate(stores)))
    finally:
        for store in stores:
            store.close()
    assert len(set(epochs)) == 4 and max(epochs) - min(epochs) == 3, epochs


# --- a real host monitor ------------------------------------------------------------------


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Cluster, Agent]]:
    cluster = Cluster(tmp_path)
    try:
        yield cluster, cluster.start_agent(None, node="gpu-3")
    finally:
        cluster.teardown()


def command(agent: Agent, path: str, body: dict[str, Any], epoch: str | None) -> httpx.Response:
    headers = {} if epoch is None else {LEADER_EPOCH_HEADER: epoch}
    return agent.api.post(path, json=body, headers=headers)


def world(epoch: str | None, agent: Agent) -> httpx.Response:
    body = {
        "request_id": uuid.uuid4().hex,
        "job": "j1",
        "rank": 0,
        "instance": "pod-a",
        "attempt": "1",
        "env": {"WORKLOAD_ATTEMPT": "1"},
    }
    return command(agent, "/v1/workers/world", body, epoch)


def stale_commands(agent: Agent) -> float:
    text = agent.api.get("/metrics").text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("host_monitor_stale_leader")]
    return float(line.rsplit(" ", 1)[1])


def test_a_command_from_an_older_epoch_is_refused_and_changes_nothing(
    agent: tuple[Cluster, Agent],
) -> None:
    cluster, monitor = agent
    cluster.start_workers(monitor, [0, 1])
    cluster.wait_running(monitor, [0, 1])
    pids = cluster.worker_pids()
    assert world("7", monitor).status_code == 200  # epoch 7 commands this node now
    stop = {"grace_s": 0}
    refused = command(monitor, "/v1/workers/stop", stop, "6")
    assert refused.status_code == 409, refused.text
    body = refused.json()
    assert body["code"] == "stale_leader" and (body["epoch"], body["newest"]) == (6, 7)
    assert "epoch 6, older than epoch 7" in body["message"]
    assert not any(_pid_gone(p) for p in pids)
    assert {w["state"] for w in monitor.workers().values()} == {"running"}
    assert stale_commands(monitor) == 1
    # Reading is not judged; a malformed epoch is a 400 naming the header.
    assert monitor.api.get("/v1/status", headers={LEADER_EPOCH_HEADER: "1"}).status_code == 200
    bad = command(monitor, "/v1/workers/stop", stop, "seven")
    assert bad.status_code == 400 and LEADER_EPOCH_HEADER in bad.json()["message"]
    # Without the actuator's token an epoch counts for nothing: it cannot raise the newest.
    sneaky = http.post(
        f"{monitor.url}/v1/workers/stop", json=stop, headers={LEADER_EPOCH_HEADER: "99"}
    )
    assert sneaky.status_code == 401
    assert world("7", monitor).status_code == 200
    # The newest epoch, and a newer one, are obeyed.
    stopped = command(monitor, "/v1/workers/stop", stop, "8")
    assert stopped.status_code == 200, stopped.text
    wait_for(lambda: all(_pid_gone(p) for p in pids), 10, "the workers to stop")
    assert world("7", monitor).status_code == 409
    assert stale_commands(monitor) == 2


async def test_the_supervisors_client_reads_the_refusal_as_fenced(
    agent: tuple[Cluster, Agent],
) -> None:
    _, monitor = agent
    async with (
        httpx.AsyncClient(base_url=monitor.url, headers=ACTUATOR) as newer,
        httpx.AsyncClient(base_url=monitor.url, headers=ACTUATOR) as older,
    ):
        stamp(newer, 12)
        stamp(older, 11)
        body = {"grace_s": 0}
        assert (await newer.post("/v1/workers/stop", json=body)).status_code == 200
        with pytest.raises(Fenced, match="epoch 11, older than epoch 12"):
            await older.post("/v1/workers/stop", json=body)
        assert (await older.get("/v1/status")).status_code == 200
