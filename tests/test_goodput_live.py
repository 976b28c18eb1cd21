"""Live goodput: checkpoint reports stored and forwarded, the goodput and advice endpoints,
and the CLI against a running supervisor.

- The store on SQLite and PostgreSQL: reports idempotent by id, history per job.
- The API over HTTP against the real app and database (ASGI, real lifespan): the
  checkpoint batch endpoint (tokens, validation, idempotency), and the goodput and advice
  of the worked example of tests/test_goodput_history.py, put in the database.
- Real processes: a host monitor and `supervisor serve`; a worker using the real worker
  client reports checkpoints, which reach the supervisor's database and its goodput; with
  the supervisor down (and the host monitor SIGKILLed and started again meanwhile) the
  reports still arrive, once each.
- `supervisor goodput` / `supervisor advise` with `--url` against `supervisor serve`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from host_monitor.checkpoint_forwarder import CheckpointForwarder
from resiliency_protocol.checkpoint_reports import CheckpointReport as WorkerReport
from resiliency_protocol.checkpoint_reports import Tier
from supervisor.api import create_app
from supervisor.config import Settings
from supervisor.domain import (
    ActionRequest,
    ActionStatus,
    ActionType,
    CheckpointReport,
    Event,
    EventType,
    ProgressSample,
)
from supervisor.goodput.service import ResultCache
from supervisor.local.ports import free_port
from supervisor.runtime import Supervisor
from supervisor.store import Store, open_store
from supervisor.store.models import ActionRow, JobRow
from tests.acting_stand_in import RecordingBackend
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN, SettingsFactory
from tests.test_host_monitor import AGENT_TOKEN as HM_AGENT_TOKEN
from tests.test_host_monitor import OPERATOR_TOKEN as HM_OPERATOR_TOKEN
from tests.test_host_monitor import Cluster, wait_for
from tests.test_host_monitor import Supervisor as ServerProcess

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
approx = pytest.approx
T0 = datetime(2026, 1, 5, 12, 0, 0, tzinfo=UTC)
ROOT = Path(__file__).parent.parent


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def checkpoint(
    report_id: str,
    *,
    job: str | None = "j1",
    event: str = "saved",
    step: int = 10,
    t: float = 10.0,
    duration_s: float = 0.5,
    tier: str = "local",
    rank: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "id": report_id,
        "node": f"n{rank}",
        "job": job,
        "rank": rank,
        "event": event,
        "step": step,
        "duration_s": duration_s,
        "tier": tier,
        "time": at(t).isoformat(),
        **extra,
    }


# --- the store --------------------------------------------------------------------------


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    s = open_store(database_url)
    try:
        yield s
    finally:
        s.close()


def _report(report_id: str, step: int, t: float, job: str = "j1") -> CheckpointReport:
    return CheckpointReport(report_id, "n1", job, 0, "saved", step, 0.5, "local", at(t))


def test_checkpoint_reports_are_stored_once_by_id(store: Store) -> None:
    assert store.record_checkpoint_reports([_report("a", 10, 10), _report("b", 20, 20)]) == (2, 0)
    # A retried batch, with one new report and one repeated inside the batch.
    again = [_report("a", 10, 10), _report("b", 20, 20), _report("c", 30, 30)]
    assert store.record_checkpoint_reports([*again, _report("c", 30, 30)]) == (1, 3)
    stored = store.list_checkpoint_reports("j1")
    assert [r.report_id for r in stored] == ["c", "b", "a"]  # newest first
    assert stored[0] == _report("c", 30, 30)  # round trip, time zone included
    assert store.record_checkpoint_reports([]) == (0, 0)


def test_job_history_summarises_the_ranks_reports_of_one_checkpoint(store: Store) -> None:
    def rank_report(rank: int, step: int, t: float, duration_s: float) -> CheckpointReport:
        return CheckpointReport(
            f"r{rank}-{step}-{t}", f"n{rank}", "j1", rank, "saved", step, duration_s, "local", at(t)
        )

    # Step 10 by 3 ranks within 2 s; step 20 saved at 20 and again 100 s later (after a
    # rollback): those come one by one.
    store.record_checkpoint_reports(
        [rank_report(r, 10, 10 + r, 0.5 + r) for r in range(3)]
        + [rank_report(0, 20, 20, 1.0), rank_report(1, 20, 120, 2.0)]
    )
    history = store.job_history("j1", group_window_s=30)
    assert history.checkpoint_reports == 5
    summary = [(r.node, r.step, r.time, r.duration_s) for r in history.checkpoints]
    assert summary == [
        ("*", 10, at(12), 2.5),  # the latest time, the longest duration
        ("n0", 20, at(20), 1.0),
        ("n1", 20, at(120), 2.0),
    ]


def test_sizes_and_total_times_round_trip_and_are_summarised(store: Store) -> None:
    def sized(rank: int, step: int, t: float, size: int | None, total: float | None) -> Any:
        return CheckpointReport(
            f"s{rank}-{step}-{t}", f"n{rank}", "j1", rank, "saved", step, 0.25, "ram", at(t),
            size_bytes=size, total_s=total,
        )  # fmt: skip

    big = 3 * 2**40  # beyond 32 bits
    store.record_checkpoint_reports(
        [
            sized(0, 10, 10, big, 2.0),
            sized(1, 10, 11, big + 2, 4.0),
            sized(2, 10, 12, None, None),
            sized(0, 20, 20, 0, 0.0),
            sized(0, 30, 30, None, None),
        ]
    )
    stored = {r.report_id: r for r in store.list_checkpoint_reports("j1")}
    assert (stored["s0-10-10"].size_bytes, stored["s0-10-10"].total_s) == (big, 2.0)
    assert (stored["s0-20-20"].size_bytes, stored["s0-20-20"].total_s) == (0, 0.0)
    assert (stored["s0-30-30"].size_bytes, stored["s0-30-30"].total_s) == (None, None)
    assert stored["s0-10-10"] == sized(0, 10, 10, big, 2.0)
    # One record per checkpoint: the means over the ranks that gave them.
    history = store.job_history("j1", group_window_s=30)
    summary = [(r.step, r.tier, r.size_bytes, r.total_s) for r in history.checkpoints]
    assert summary == [(10, "ram", big + 1, 3.0), (20, "ram", 0, 0.0), (30, "ram", None, None)]
    assert all(isinstance(r.size_bytes, int | None) for r in history.checkpoints)


def test_job_history_holds_only_that_job_oldest_first(store: Store) -> None:
    store.record_checkpoint_reports([_report("x", 20, 20), _report("y", 10, 10, job="other")])
    store.record_progress_samples(
        [
            ProgressSample("j1", 7, at(7)),
            ProgressSample("j1", 3, at(3)),
            ProgressSample("k", 1, at(1)),
        ]
    )
    store.record([Event(EventType.HANG, at(5), job="j1"), Event(EventType.HANG, at(6), job="k")])
    store.create_action(ActionRequest(ActionType.RESTART_WORKLOAD, job="j1"), key="a1", source="t")
    history = store.job_history("j1")
    assert [(r.step, r.time) for r in history.checkpoints] == [(20, at(20))]
    assert history.checkpoint_reports == 1
    assert [(s.step, s.time) for s in history.samples] == [(3, at(3)), (7, at(7))]
    assert [e.time for e in history.events] == [at(5)]
    assert [a.type for a in history.actions] == [ActionType.RESTART_WORKLOAD]
    assert history.job is None and history.created_at is None  # never seen by the sensor


# --- the API (ASGI, real app and database) --------------------------------------------------


class Api:
    def __init__(self, client: httpx.AsyncClient, supervisor: Supervisor) -> None:
        self.client = client
        self.supervisor = supervisor

    async def post_checkpoints(
        self, reports: list[dict[str, Any]], headers: dict[str, str] = AGENT
    ) -> httpx.Response:
        return await self.client.post(
            "/api/v1/checkpoints", json={"reports": reports}, headers=headers
        )

    async def get(self, path: str, **params: Any) -> Any:
        response = await self.client.get(path, params=params, headers=OPERATOR)
        assert response.status_code == 200, response.text
        return response.json()

    async def join(self, job: str = "j1", node: str = "n1") -> None:
        """A heartbeat naming the job, whose workers report no step yet."""
        body = {
            "node": node,
            "state": "running",
            "job": job,
            "workers": [{"rank": 0, "local_rank": 0, "pid": 10, "state": "running"}],
        }
        r = await self.client.post("/api/v1/heartbeats", json=body, headers=AGENT)
        assert r.status_code in (202, 204), r.text


@asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[Api]:
    supervisor = Supervisor(settings, backend=RecordingBackend())
    app = create_app(settings, supervisor)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield Api(client, supervisor)


@pytest.fixture
async def api(make_settings: SettingsFactory) -> AsyncIterator[Api]:
    # No sampling during the test: the history is exactly what the test writes. Its
    # reports are dated around T0, a fixed day: agents' clocks are trusted within a few
    # years here (the bound itself: tests/test_agent_time.py).
    settings = make_settings(
        heartbeat_timeout_s=600, goodput_sample_period_s=3600, agent_clock_skew_s=1e9
    )
    async with running(settings) as a:
        yield a


async def test_checkpoint_batches_need_the_agent_token(api: Api) -> None:
    for headers in ({}, OPERATOR, {"Authorization": "Bearer nope"}):
        r = await api.post_checkpoints([checkpoint("a")], headers=headers)
        assert r.status_code == 401, r.text
    assert api.supervisor.store.list_checkpoint_reports() == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tier": "ramdisk"}, "reports.1.tier"),
        ({"bytes": -1}, "reports.1.bytes"),
        ({"bytes": 2**62 + 1}, "reports.1.bytes"),
        ({"bytes": 1.5}, "reports.1.bytes"),
        ({"bytes": "many"}, "reports.1.bytes"),
        ({"total_s": -0.1}, "reports.1.total_s"),
        ({"total_s": 604_801}, "reports.1.total_s"),
        ({"event": "deleted"}, "reports.1.event"),
        ({"event": "failed"}, "reports.1.error"),  # a failed save says why
        ({"error": "disk full"}, "reports.1.error"),  # and only a failed save does
        ({"event": "failed", "error": "x" * 1001}, "reports.1.error"),
        ({"step": -1}, "reports.1.step"),
        ({"duration_s": -0.1}, "reports.1.duration_s"),
        ({"time": "2026-01-05T12:00:00"}, "reports.1.time"),  # no zone
        # Valid with their zone, out of range once in UTC: a 500 before.
        ({"time": "9999-12-31T23:59:59-14:00"}, "reports.1.time"),
        ({"time": "0001-01-01T00:00:00+14:00"}, "reports.1.time"),
        ({"step": 2**63}, "reports.1.step"),
        ({"id": ""}, "reports.1.id"),
        ({"node": "bad name"}, "reports.1.node"),
        ({"surprise": 1}, "reports.1.surprise"),
    ],
)
async def test_a_bad_report_refuses_the_batch_naming_the_field(
    api: Api, change: dict[str, Any], field: str
) -> None:
    r = await api.post_checkpoints([checkpoint("good"), {**checkpoint("bad"), **change}])
    assert r.status_code == 422, r.text
    assert r.json()["message"].startswith(f"{field}:"), r.json()
    assert api.supervisor.store.list_checkpoint_reports() == []  # nothing changed


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
async def test_a_total_time_that_is_not_finite_is_refused(api: Api, value: str) -> None:
    good = json.dumps(checkpoint("good", bytes=1, total_s=1.0))
    bad = json.dumps(checkpoint("bad", bytes=1)).removesuffix("}") + f', "total_s": {value}}}'
    r = await api.client.post(
        "/api/v1/checkpoints",
        content=f'{{"reports": [{good}, {bad}]}}',
        headers={**AGENT, "Content-Type": "application/json"},
    )
    assert r.status_code == 422, r.text
    assert r.json()["message"].startswith("reports.1.total_s:"), r.json()
    assert api.supervisor.store.list_checkpoint_reports() == []


async def test_new_tiers_sizes_and_total_times_round_trip(api: Api) -> None:
    mib = 2**20
    batch = [
        checkpoint("old", step=10, t=10),  # an older host monitor: neither field
        checkpoint("ram", step=20, t=20, tier="ram", bytes=64 * mib, total_s=0.5),
        checkpoint("peer", event="loaded", step=20, t=30, tier="peer", bytes=64 * mib),
        checkpoint("zero", step=30, t=40, tier="durable", bytes=0, total_s=0.0),
    ]
    assert (await api.post_checkpoints(batch)).json() == {"stored": 4, "duplicates": 0}
    await api.join()
    listed = {r["id"]: r for r in await api.get("/api/v1/checkpoints", job="j1")}
    assert {k: (r["tier"], r["bytes"], r["total_s"]) for k, r in listed.items()} == {
        "old": ("local", None, None),
        "ram": ("ram", 64 * mib, 0.5),
        "peer": ("peer", 64 * mib, None),
        "zero": ("durable", 0, 0.0),
    }
    assert listed["peer"]["event"] == "loaded" and listed["ram"]["duration_s"] == 0.5


async def test_goodput_per_tier_sizes_and_throughputs(api: Api) -> None:
    mib = 2**20
    await api.join()
    reports = [
        # Step 10 to RAM by two ranks (one record: mean size 96 MiB over mean 1.5 s), step
        # 20 by one rank (128 MiB in 0.5 s), step 30 by an old client (no sizes).
        checkpoint("r10-0", step=10, t=10, tier="ram", duration_s=0.2, bytes=64 * mib,
                   total_s=1.0),
        checkpoint("r10-1", step=10, t=10.5, tier="ram", duration_s=0.4, rank=1,
                   bytes=128 * mib, total_s=2.0),
        checkpoint("r20-0", step=20, t=20, tier="ram", duration_s=0.3, bytes=128 * mib,
                   total_s=0.5),
        checkpoint("r30-0", step=30, t=30, tier="ram", duration_s=0.1),
        # A restart loaded step 30 from the partner's copy: 128 MiB in 0.25 s.
        checkpoint("p30-0", event="loaded", step=30, t=50, tier="peer", duration_s=0.25,
                   bytes=128 * mib, total_s=0.25),
        # The host monitor's own copy to its partner: no blocking time, 2 s in all.
        checkpoint("c30-0", step=30, t=33, tier="peer", duration_s=0.0, bytes=128 * mib,
                   total_s=2.0),
    ]  # fmt: skip
    assert (await api.post_checkpoints(reports)).status_code == 200
    data = await api.get("/api/v1/jobs/j1/goodput", points=0)
    tiers = {t["tier"]: t for t in data["tiers"]}
    ram, peer = tiers["ram"], tiers["peer"]
    assert (ram["saves"], ram["loads"]) == (3, 0)
    assert ram["mean_save_bytes"] == approx(112 * mib)  # (96 + 128) / 2: sized saves only
    assert ram["save_mib_per_s"] == approx((96 / 1.5 + 128 / 0.5) / 2)
    assert ram["mean_save_s"] == approx((0.4 + 0.3 + 0.1) / 3)  # blocking: duration_s
    assert ram["mean_load_bytes"] is None and ram["load_mib_per_s"] is None
    assert (peer["saves"], peer["loads"]) == (1, 1)
    assert peer["mean_load_bytes"] == approx(128 * mib)
    assert peer["load_mib_per_s"] == approx(512.0)
    assert peer["mean_load_s"] == approx(0.25)
    assert peer["save_mib_per_s"] == approx(64.0) and peer["mean_save_s"] == 0
    # Badput counts the blocking seconds only (0.4 + 0.3 + 0.1), never total_s.
    assert data["badput"]["checkpoint_save_s"] == approx(0.8)


async def test_the_forwarder_sends_old_outbox_lines_and_the_new_fields(
    api: Api, tmp_path: Path
) -> None:
    """The host monitor's forwarder against the real app: a line an older host monitor left
    in the outbox (no bytes, no total_s) and new reports, with and without them."""
    outbox = tmp_path / "n1.checkpoint-outbox.jsonl"
    old = checkpoint("n1-old", step=10, t=10)
    outbox.write_text(json.dumps(old) + "\n")
    forwarder = CheckpointForwarder("http://test", AGENT_TOKEN, "n1", outbox)
    assert forwarder.pending == 1
    saved = WorkerReport(
        event="saved", step=20, duration_s=0.0, tier=Tier.PEER, bytes=5 * 2**30, total_s=1.5
    )
    peer = forwarder.add(saved, rank=1, job="j1")
    loaded = WorkerReport(event="loaded", step=20, duration_s=0.1, tier=Tier.RAM)
    ram = forwarder.add(loaded, rank=1, job="j1", time=at(30).isoformat())
    # What the worker's report does not say, and the supervisor would refuse.
    for change, field in (
        ({"rank": -1}, "rank"),
        ({"job": "no such name!"}, "job"),
        ({"time": "yesterday"}, "time"),
        ({"time": "2024-05-01T12:00:00Z", "world": -1}, "world"),
    ):
        args: dict[str, Any] = {"rank": 1, "job": "j1", **change}
        with pytest.raises(ValueError, match=field):
            forwarder.add(loaded, **args)
    assert forwarder.pending == 3  # nothing kept of the refused ones
    lines = [json.loads(line) for line in outbox.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["n1-old", peer, ram]
    assert (lines[1]["tier"], lines[1]["bytes"], lines[1]["total_s"]) == ("peer", 5 * 2**30, 1.5)
    assert datetime.fromisoformat(lines[1]["time"]).tzinfo is not None  # default: now
    # Unknown fields are left out: what a supervisor that predates them takes.
    assert "bytes" not in lines[2] and "total_s" not in lines[2]

    api.client.headers.update(AGENT)
    assert await forwarder._send(api.client)
    assert forwarder.pending == 0 and outbox.read_text() == ""
    stored = {r.report_id: r for r in api.supervisor.store.list_checkpoint_reports("j1")}
    assert {k: (r.tier, r.size_bytes, r.total_s) for k, r in stored.items()} == {
        "n1-old": ("local", None, None),
        peer: ("peer", 5 * 2**30, 1.5),
        ram: ("ram", None, None),
    }


async def test_empty_or_oversized_batches_are_refused(api: Api) -> None:
    assert (await api.post_checkpoints([])).status_code == 422
    many = [checkpoint(f"r{i}") for i in range(1001)]
    r = await api.post_checkpoints(many)
    assert r.status_code == 422 and r.json()["message"].startswith("reports:")


async def test_a_retried_batch_is_stored_once_and_committed_before_the_ack(
    api: Api, sqlite_url: str
) -> None:
    batch = [checkpoint("a", step=10), checkpoint("b", step=20, t=20)]
    first = await api.post_checkpoints(batch)
    assert first.status_code == 200 and first.json() == {"stored": 2, "duplicates": 0}
    # Another connection sees them as soon as the ack is sent.
    other = open_store(sqlite_url)
    try:
        assert sorted(r.report_id for r in other.list_checkpoint_reports()) == ["a", "b"]
    finally:
        other.close()
    second = await api.post_checkpoints([*batch, checkpoint("c", step=30, t=30)])
    assert second.json() == {"stored": 1, "duplicates": 2}
    await api.join()
    listed = await api.get("/api/v1/checkpoints", job="j1", limit=2)
    assert [(r["id"], r["step"], r["tier"]) for r in listed] == [
        ("c", 30, "local"),
        ("b", 20, "local"),
    ]
    assert listed[0]["time"].startswith("2026-01-05T12:00:30")
    assert (
        await api.client.get("/api/v1/checkpoints?job=nope", headers=OPERATOR)
    ).status_code == 404


async def _put_worked_example(api: Api) -> None:
    """The worked example of tests/test_goodput_history.py (see its docstring there), in
    the database: the job first seen at T0, samples, checkpoint reports over HTTP,
    events, and the actions with their start and end times."""
    await api.join()
    store = api.supervisor.store
    with store.engine.begin() as conn:
        conn.execute(update(JobRow).where(JobRow.name == "j1").values(created_at=T0))
    store.record_progress_samples(
        [
            ProgressSample("j1", s, at(t))
            for s, t in ((10, 10), (20, 20), (25, 26), (30, 57), (40, 67))
        ]
    )
    reports = [
        checkpoint("s20-0", step=20, t=20.5, duration_s=0.5, rank=0),
        checkpoint("s20-1", step=20, t=21.0, duration_s=1.0, rank=1),
        checkpoint("e25-0", step=25, t=41.5, duration_s=0.8, tier="emergency", rank=0),
        checkpoint("e25-1", step=25, t=41.4, duration_s=0.7, tier="emergency", rank=1),
        checkpoint("l25-0", event="loaded", step=25, t=52.0, duration_s=2.0, tier="emergency"),
        checkpoint(
            "l25-1", event="loaded", step=25, t=51.9, duration_s=1.9, tier="emergency", rank=1
        ),
    ]
    assert (await api.post_checkpoints(reports)).json() == {"stored": 6, "duplicates": 0}
    store.record(
        [
            Event(
                EventType.HOST_HEARTBEAT_LOST,
                at(40),
                node="n1",
                job="j1",
                details={"last_heartbeat": at(28).isoformat()},
            ),
            Event(EventType.WORKER_EXITED, at(41), node="n2", job="j1", details={"exit_code": -9}),
            Event(EventType.WORKER_EXITED, at(67), node="n2", job="j1", details={"exit_code": 0}),
        ]
    )
    for key, type_, start, end in (
        ("e", ActionType.EMERGENCY_CHECKPOINT, 40.5, 41.5),
        ("h", ActionType.HOT_SWAP, 42, 50),
    ):
        action, _ = store.create_action(
            ActionRequest(type_, job="j1", node="n1"), key=key, source="test"
        )
        with store.engine.begin() as conn:
            conn.execute(
                update(ActionRow)
                .where(ActionRow.id == action.id)
                .values(
                    status=ActionStatus.SUCCEEDED.value,
                    started_at=at(start),
                    finished_at=at(end),
                )
            )


async def test_goodput_endpoint_on_the_worked_example(api: Api) -> None:
    await _put_worked_example(api)
    data = await api.get("/api/v1/jobs/j1/goodput", points=67)
    # From tests/test_goodput_history.py::test_worked_example_goodput: productive 20 + 5
    # + 5 + 10 = 40 s of 67 s; save 1, lost 2 (26 -> 28), detection 12 (28 -> 40),
    # remediation 10 (40 -> 50), restart 2 (loading 50 -> 52).
    assert data["start"] == "2026-01-05T12:00:00Z" and data["end"] == "2026-01-05T12:01:07Z"
    assert data["wall_s"] == approx(67.0)
    assert data["productive_s"] == approx(40.0)
    assert data["goodput"] == approx(40 / 67)
    assert data["badput"] == {
        "lost_progress_s": approx(2.0),
        "detection_s": approx(12.0),
        "remediation_s": approx(10.0),
        "restart_s": approx(2.0),
        "checkpoint_save_s": approx(1.0),
        "reduced_capacity_s": approx(0.0),
        "idle_s": approx(0.0),
    }
    assert data["badput_total_s"] == approx(27.0)
    assert (data["attempts"], data["failures"], data["last_step"]) == (2, 1, 40)
    assert data["steps_redone"] == 0 and data["step_time_s"] == approx(1.0)
    assert data["downtime_per_failure_s"] == approx(24.0)  # (12 + 10 + 2) / 1
    tiers = {t["tier"]: t for t in data["tiers"]}
    assert tiers["local"]["mean_blocking_save_s"] == 1.0
    assert tiers["emergency"]["emergency_saves"] == 1 and tiers["emergency"]["recoveries"] == 1
    assert data["sources"] == {
        "events": 3,
        "failure_events": 2,
        "actions": 2,
        "checkpoint_reports": 6,
        "progress_samples": 5,
    }
    # The series: one point per second; at 20 s steps 1-20 took all 20 s (goodput 1);
    # the last point is the whole report.
    series = data["series"]
    assert len(series) == 67
    assert series[19]["wall_s"] == approx(20.0) and series[19]["goodput"] == approx(1.0)
    assert series[-1]["productive_s"] == approx(40.0) and series[-1]["time"] == data["end"]
    # Nothing was written by reading.
    assert data == await api.get("/api/v1/jobs/j1/goodput", points=67)


async def test_advice_endpoint_on_the_worked_example(api: Api) -> None:
    await _put_worked_example(api)
    data = await api.get("/api/v1/jobs/j1/advice", mtbf_s=3600, parameters=7e10)
    # Observed: 1 failure in 67 s is not enough for an MTBF; 3600 s is given instead.
    assert data["observed"]["failures"] == 1 and data["observed"]["mtbf_s"] is None
    assert data["mtbf_s"] == 3600
    local = next(t for t in data["tiers"] if t["name"] == "local")
    # C = 1 s measured (the local save 20-21), M = 3600 s. Young sqrt(2 x 1 x 3600) = 84.85;
    # Daly 84.85 x (1 + sqrt(1/7200)/3 + 1/7200/9) - 1 = 84.19 s -> 84 steps of 1 s.
    assert local["save_cost_s"] == 1.0
    assert local["young_interval_s"] == approx(84.853, abs=1e-3)
    assert local["daly_interval_s"] == approx(84.19, abs=0.01)
    assert local["recommended_interval_steps"] == 84
    # Downtime per failure 24 s; expected goodput at 84 steps:
    # 1 - (1/84 + 84/7200) - 24/3600 = 1 - 0.011905 - 0.011667 - 0.006667 = 0.96976.
    assert data["expected_goodput_recommended"] == approx(0.96976, abs=1e-4)
    assert data["measured_goodput"] == approx(40 / 67)
    # Ramdisk: hosts default to the job's nodes now (1): 7e10 x 12 x 2 x 1.15 bytes.
    assert data["ramdisk"]["hosts"] == 1
    assert data["ramdisk"]["size_bytes"] == 7 * 10**10 * 12 * 2 * 115 // 100
    sized = await api.get("/api/v1/jobs/j1/advice", parameters=7e10, hosts=16)
    assert sized["ramdisk"]["size_bytes"] == 120_750_000_000  # GKE's rule, 16 hosts


async def test_goodput_and_advice_errors(api: Api, make_settings: SettingsFactory) -> None:
    for path in ("/api/v1/jobs/nope/goodput", "/api/v1/jobs/nope/advice"):
        r = await api.client.get(path, headers=OPERATOR)
        assert r.status_code == 404 and "nope" in r.json()["detail"]
    await api.join()
    for path in ("/api/v1/jobs/j1/goodput", "/api/v1/jobs/j1/advice"):
        assert (await api.client.get(path)).status_code == 401
        assert (await api.client.get(path, headers=AGENT)).status_code == 401
    r = await api.client.get("/api/v1/jobs/j1/goodput?points=201", headers=OPERATOR)
    assert r.status_code == 422 and r.json()["message"].startswith("query.points:")
    r = await api.client.get("/api/v1/jobs/j1/advice?hosts=4", headers=OPERATOR)
    assert r.status_code == 422 and r.json()["detail"].startswith("parameters:")
    r = await api.client.get("/api/v1/jobs/j1/advice?mtbf_s=-1", headers=OPERATOR)
    assert r.status_code == 422 and r.json()["message"].startswith("query.mtbf_s:")
    # An empty history answers, with nothing measured.
    data = await api.get("/api/v1/jobs/j1/goodput", points=0)
    assert data["failures"] == 0 and data["tiers"] == [] and data["series"] == []
    advice = await api.get("/api/v1/jobs/j1/advice")
    assert advice["tiers"] == [] and advice["ramdisk"] is None and advice["warnings"]


async def test_reads_open_when_tokens_are_not_required(make_settings: SettingsFactory) -> None:
    async with running(make_settings(read_requires_token=False)) as api:
        await api.join()
        assert (await api.client.get("/api/v1/jobs/j1/goodput")).status_code == 200
        assert (await api.client.get("/api/v1/jobs/j1/advice")).status_code == 200
        # Writing checkpoints still needs the agent token.
        assert (await api.post_checkpoints([checkpoint("a")], headers={})).status_code == 401


async def test_openapi_documents_the_schemas(api: Api) -> None:
    spec = (await api.client.get("/openapi.json")).json()
    paths = spec["paths"]
    assert paths["/api/v1/jobs/{job}/goodput"]["get"]["responses"]["200"]["content"][
        "application/json"
    ]["schema"] == {"$ref": "#/components/schemas/GoodputOut"}
    assert "/api/v1/jobs/{job}/advice" in paths
    assert "post" in paths["/api/v1/checkpoints"] and "get" in paths["/api/v1/checkpoints"]
    schemas = spec["components"]["schemas"]
    for name in ("GoodputOut", "BadputOut", "GoodputPointOut", "AdviceOut", "TierAdviceOut"):
        assert name in schemas
    assert set(schemas["BadputOut"]["required"]) == {
        "lost_progress_s",
        "detection_s",
        "remediation_s",
        "restart_s",
        "checkpoint_save_s",
        "reduced_capacity_s",
        "idle_s",
    }


async def test_steps_are_sampled_periodically_not_per_heartbeat(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(heartbeat_timeout_s=600, goodput_sample_period_s=0.2)
    async with running(settings) as api:
        body = {"node": "n1", "state": "running", "job": "j1"}
        for step in range(1, 41):
            worker = {"rank": 0, "local_rank": 0, "pid": 10, "state": "running", "step": step}
            r = await api.client.post(
                "/api/v1/heartbeats", json={**body, "workers": [worker]}, headers=AGENT
            )
            assert r.status_code in (202, 204)
        store = api.supervisor.store

        def sampled() -> list[ProgressSample]:
            return store.job_history("j1").samples

        # 40 heartbeats, but samples only when the period passes and the step moved.
        for _ in range(200):  # up to 10 s
            if sampled() and sampled()[-1].step == 40:
                break
            await asyncio.sleep(0.05)
        samples = sampled()
        assert 1 <= len(samples) < 40 and samples[-1].step == 40
        # No movement, no new row.
        count = len(sampled())
        await asyncio.sleep(0.6)
        assert len(sampled()) == count
        data = await api.get("/api/v1/jobs/j1/goodput")
        assert data["last_step"] == 40


# --- real processes: a host monitor forwards to `supervisor serve` ---------------------------

# A worker using the real worker client: counts steps every 50 ms up to LAST_STEP, saves a
# checkpoint (tier SAVE_TIER, default local) every SAVE_EVERY steps and reports it, then
# idles (still reporting progress, its heartbeat). With SAVE_BYTES, its reports carry that
# size and 0.5 s in all; with LOAD_TIER, it first reports a load of step 0 from that tier.
WORKER_SCRIPT = r"""
import os, time
from pathlib import Path
from training.worker_client import WorkerClient

Path(os.environ["PID_DIR"], str(os.getpid())).write_text(os.environ["RANK"])
client = WorkerClient.from_env(report_interval_s=0.05)
client.register()
if "GO_FILE" in os.environ:  # the test's cue to start training
    while not Path(os.environ["GO_FILE"]).exists():
        time.sleep(0.02)
every, last = int(os.environ["SAVE_EVERY"]), int(os.environ["LAST_STEP"])
tier = os.environ.get("SAVE_TIER", "local")
sizes = {}
if "SAVE_BYTES" in os.environ:
    sizes = {"size_bytes": int(os.environ["SAVE_BYTES"]), "total_s": 0.5}
if "LOAD_TIER" in os.environ:
    client.report_checkpoint_loaded(0, 0.02, os.environ["LOAD_TIER"], **sizes)
step = 0
while True:
    if step < last:
        step += 1
        client.report_step(step)
        if step % every == 0:
            client.report_checkpoint_saved(step, 0.01, tier, **sizes)
    time.sleep(0.05)
"""


class Workers(Cluster):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.script.write_text(WORKER_SCRIPT)

    def run(self, agent: Any, job: str, *, save_every: int, last_step: int, **env: str) -> None:
        env.update(
            {"SAVE_EVERY": str(save_every), "LAST_STEP": str(last_step), "PYTHONPATH": str(ROOT)}
        )
        self.start_workers(agent, [0], job=job, env=env)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    c = Workers(tmp_path)
    try:
        yield c
    finally:
        c.teardown()


def start_server(tmp: Path, port: int | None = None) -> ServerProcess:
    server = ServerProcess(tmp, port)
    server.env["SUPERVISOR_GOODPUT_SAMPLE_PERIOD_S"] = "0.2"
    server.env["SUPERVISOR_HEARTBEAT_TIMEOUT_S"] = "5"
    server.start()
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_server(tmp_path_factory.mktemp("supervisor"))
    try:
        yield s
    finally:
        s.stop()


def stored(server: ServerProcess, job: str) -> list[dict[str, Any]]:
    r = server.http.get("/api/v1/checkpoints", params={"job": job, "limit": 1000})
    return r.json() if r.status_code == 200 else []  # type: ignore[no-any-return]


def test_a_workers_checkpoints_reach_the_supervisor_and_its_goodput(
    server: ServerProcess, workers: Workers
) -> None:
    job = f"jg-{uuid.uuid4().hex[:6]}"
    agent = workers.start_agent(server.url)
    workers.run(agent, job, save_every=5, last_step=30)
    reports = wait_for(lambda: len(stored(server, job)) == 6 and stored(server, job), 20, "6 saves")
    assert sorted(r["step"] for r in reports) == [5, 10, 15, 20, 25, 30]
    assert all(r["node"] == agent.node and r["tier"] == "local" for r in reports)
    assert all(r["id"].startswith(f"{agent.node}-") for r in reports)
    # The host monitor kept them too, and its outbox is empty once acknowledged.
    local = agent.api.get("/v1/checkpoints").json()
    assert sorted(c["report"]["step"] for c in local) == [5, 10, 15, 20, 25, 30]
    outbox = workers.tmp / "run" / f"{agent.node}.checkpoint-outbox.jsonl"
    wait_for(lambda: outbox.read_text() == "", 5, "outbox emptied")

    def goodput() -> dict[str, Any] | None:
        r = server.http.get(f"/api/v1/jobs/{job}/goodput", params={"points": 5})
        data = r.json() if r.status_code == 200 else None
        return data if data and data["last_step"] == 30 else None

    data = wait_for(goodput, 10, "goodput with step 30")
    tier = {t["tier"]: t for t in data["tiers"]}["local"]
    assert (tier["saves"], tier["interval_steps"]) == (6, 5)
    assert data["sources"]["checkpoint_reports"] == 6 and data["sources"]["progress_samples"] >= 1
    assert 0 < data["goodput"] <= 1 and len(data["series"]) == 5
    total = data["productive_s"] + data["badput_total_s"]
    assert total == approx(data["wall_s"], rel=1e-6)


def test_sizes_and_new_tiers_go_from_the_worker_to_the_api(
    server: ServerProcess, workers: Workers
) -> None:
    """The worker client -> a real host monitor (its outbox) -> `supervisor serve` -> its
    API and goodput: tiers ram and peer, with bytes and total seconds."""
    job = f"jt-{uuid.uuid4().hex[:6]}"
    size = 3 * 2**30  # 3 GiB, 0.5 s in all: 6144 MiB/s
    agent = workers.start_agent(server.url)
    workers.run(
        agent, job, save_every=5, last_step=10, SAVE_TIER="ram", SAVE_BYTES=str(size),
        LOAD_TIER="peer",
    )  # fmt: skip
    reports = wait_for(lambda: len(stored(server, job)) == 3 and stored(server, job), 20, "3")
    got = sorted((r["event"], r["step"], r["tier"], r["bytes"], r["total_s"]) for r in reports)
    assert got == [
        ("loaded", 0, "peer", size, 0.5),
        ("saved", 5, "ram", size, 0.5),
        ("saved", 10, "ram", size, 0.5),
    ]
    assert {r["duration_s"] for r in reports} == {0.02, 0.01}
    local = agent.api.get("/v1/checkpoints").json()
    assert {(c["report"]["tier"], c["report"]["bytes"]) for c in local} == {
        ("peer", size),
        ("ram", size),
    }

    def goodput() -> dict[str, Any] | None:
        r = server.http.get(f"/api/v1/jobs/{job}/goodput", params={"points": 0})
        data = r.json() if r.status_code == 200 else None
        return data if data and data["last_step"] == 10 else None

    data = wait_for(goodput, 10, "goodput with step 10")
    tiers = {t["tier"]: t for t in data["tiers"]}
    assert (tiers["ram"]["saves"], tiers["ram"]["interval_steps"]) == (2, 5)
    assert tiers["ram"]["mean_save_bytes"] == size
    assert tiers["ram"]["save_mib_per_s"] == approx(6144)
    assert (tiers["peer"]["loads"], tiers["peer"]["load_mib_per_s"]) == (1, approx(6144))
    # Two saves blocked 0.01 s each; their 0.5 s in all is not badput.
    assert data["badput"]["checkpoint_save_s"] == approx(0.02)


def test_reports_a_slow_host_monitor_answered_too_late_are_sent_again_and_kept_once(
    server: ServerProcess, workers: Workers
) -> None:
    """A host monitor that answers after the worker's request timed out (a node busy with
    its data loaders: here frozen past the client's 2-s timeout, twice over) still ends up
    with every checkpoint report, each once, and so does the supervisor."""
    job = f"js-{uuid.uuid4().hex[:6]}"
    agent = workers.start_agent(server.url)
    go = workers.tmp / "go"
    workers.run(agent, job, save_every=5, last_step=10, GO_FILE=str(go))
    workers.wait_running(agent, [0], min_step=0)
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGSTOP)
    try:
        go.touch()
        time.sleep(5.0)  # the fault: a host monitor this late to answer
    finally:
        agent.proc.send_signal(signal.SIGCONT)

    def steps_at_the_monitor() -> list[int]:
        return sorted(c["report"]["step"] for c in agent.api.get("/v1/checkpoints").json())

    # In order, one at a time: once step 10 is in, every try of step 5 came before it.
    wait_for(lambda: 10 in steps_at_the_monitor(), 20, "step 10 at the host monitor")
    assert steps_at_the_monitor() == [5, 10]
    reports = wait_for(lambda: len(stored(server, job)) >= 2 and stored(server, job), 20, "2")
    assert sorted(r["step"] for r in reports) == [5, 10]
    log = (workers.tmp / "run" / f"{agent.node}.{job}.rank0.log").read_text()
    assert "checkpoint to host monitor failed" in log  # the timeout, said once


def test_reports_survive_a_down_supervisor_and_a_killed_host_monitor(
    tmp_path: Path, workers: Workers
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    job = "jdown"
    first = workers.start_agent(url, initial_state="running", job=job)
    workers.run(first, job, save_every=5, last_step=10)
    # The host monitor took both reports (202 to the worker) although nothing answers.
    wait_for(lambda: len(first.api.get("/v1/checkpoints").json()) == 2, 10, "2 reports taken")
    outbox = workers.tmp / "run" / f"{first.node}.checkpoint-outbox.jsonl"
    kept = [json.loads(line) for line in outbox.read_text().splitlines()]
    assert [r["step"] for r in kept] == [5, 10] and {r["job"] for r in kept} == {job}
    # The host monitor dies before delivering them, and is started again on the node.
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait(5)
    again = workers.start_agent(url, node=first.node, initial_state="running", job=job)
    server = start_server(tmp_path, port)
    try:
        got = wait_for(lambda: len(stored(server, job)) >= 2 and stored(server, job), 20, "late")
        assert sorted(r["id"] for r in got) == sorted(r["id"] for r in kept)  # once each
        assert sorted(r["step"] for r in got) == [5, 10]
        wait_for(lambda: outbox.read_text() == "", 5, "outbox emptied")
        # (Both host monitors of the node log to one file: look at the second one's part.)
        restarted = "2 report(s) from a previous run to send"
        assert restarted in again.log.read_text()
        log = wait_for(
            lambda: (
                "checkpoint reports delivered" in (text := again.log.read_text())
                and text.split(restarted)[-1]
            ),
            5,
            "the delivery said",
        )
        assert log.count("checkpoint reports to") == 1, log  # one line, not one per retry
        # And the goodput of the job counts them.
        data = wait_for(
            lambda: server.http.get(f"/api/v1/jobs/{job}/goodput").json(), 10, "job known"
        )
        assert {t["tier"]: t["saves"] for t in data["tiers"]} == {"local": 2}
        assert len(stored(server, job)) == 2
    finally:
        server.stop()


# --- the CLI against `supervisor serve` ---------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**full, **(env or {})},
    )


def test_cli_online(server: ServerProcess) -> None:
    job = f"jcli-{uuid.uuid4().hex[:6]}"
    agent = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {HM_AGENT_TOKEN}"})
    worker = {"rank": 0, "local_rank": 0, "pid": 10, "state": "running", "step": 1}
    body = {"node": f"{job}-n", "state": "running", "job": job, "workers": [worker]}
    assert agent.post("/api/v1/heartbeats", json=body).status_code in (202, 204)
    now = datetime.now(UTC)
    reports = [
        {
            **checkpoint(f"{job}-{s}", job=job, step=s, duration_s=0.5),
            "time": (now + timedelta(seconds=s)).isoformat(),
        }
        for s in (10, 20, 30)
    ]
    r = agent.post("/api/v1/checkpoints", json={"reports": reports})
    assert r.status_code == 200, r.text
    agent.close()
    token = HM_OPERATOR_TOKEN

    table = cli("goodput", "--url", server.url, "--job", job, "--token", token)
    assert table.returncode == 0, table.stderr
    assert f"Goodput of job {job}:" in table.stdout
    assert "checkpoint save" in table.stdout and "3 checkpoint reports" in table.stdout
    data = json.loads(
        cli(
            "goodput",
            "--url",
            server.url,
            "--job",
            job,
            "--json",
            env={"SUPERVISOR_OPERATOR_TOKEN": token},
        ).stdout
    )
    assert data["job"] == job and {t["tier"]: t["saves"] for t in data["tiers"]} == {"local": 3}

    advice = cli(
        "advise", "--url", server.url, "--job", job, "--token", token,
        "--mtbf-s", "3600", "--parameters", "70e9", "--hosts", "16",
    )  # fmt: skip
    assert advice.returncode == 0, advice.stderr
    assert "Checkpoint advice" in advice.stdout and "local" in advice.stdout
    assert "120,750,000,000 bytes" in advice.stdout  # GKE's rule: 70e9 on 16 hosts

    every = cli("goodput", "--url", server.url, "--token", token)  # no --job: every job's
    assert every.returncode == 0, every.stderr
    assert any(line.split()[0] == job for line in every.stdout.splitlines()[1:])

    # The exit codes of the operator commands (supervisor.ops.errors) online; 1 offline.
    for args, code, expected in (
        (("goodput", "--url", server.url, "--job", job, "--token", "wrong"), 5, "HTTP 401"),
        (("goodput", "--url", server.url, "--job", "nope", "--token", token), 3, "HTTP 404"),
        (("advise", "--url", server.url), 1, "--job is required with --server"),
        (("advise", "--url", server.url, "--job", job, "--step-time-s", "1"), 1, "offline"),
        (("goodput", "--url", "http://127.0.0.1:9", "--job", job), 4, "cannot reach"),
        (("advise", "--step-time-s", "2"), 1, "--mtbf-s is required offline"),
    ):
        result = cli(*args)
        assert result.returncode == code, (args, result.stdout)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (args, lines)


async def test_concurrent_requests_share_one_computation() -> None:
    calls: list[int] = []

    def compute() -> int:
        calls.append(1)
        return len(calls)

    cache = ResultCache(min_age_s=0.3)
    results = await asyncio.gather(*(cache.get("k", compute) for _ in range(5)))
    assert results == [1] * 5 and len(calls) == 1
    assert await cache.get("other", compute) == 2  # another key computes
    await asyncio.sleep(0.4)
    assert await cache.get("k", compute) == 3  # stale: computed again
