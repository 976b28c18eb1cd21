"""Per-job metrics at /metrics: a real app driven through its HTTP API (heartbeats, a
fault the policy heals, operator actions), scraped and parsed as Prometheus would; and the
recovery and step-time figures on a timeline worked by hand."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.actuator import ActionError
from supervisor.api import create_app
from supervisor.api.job_metrics import (
    JobMetrics,
    RecoveryHistogram,
    recent_step_seconds,
    recoveries,
)
from supervisor.config import Settings
from supervisor.domain import ActionRecord, utcnow
from supervisor.goodput import service as goodput_service
from supervisor.goodput.model import (
    CheckpointLoaded,
    FailureDetected,
    JobStarted,
    StepReported,
    Timeline,
)
from supervisor.runtime import Supervisor
from tests.acting_stand_in import RecordingBackend
from tests.conftest import SettingsFactory
from tests.test_api import OPERATOR, Api, heartbeat

approx = pytest.approx
Labels = tuple[tuple[str, str], ...]


class HealingBackend(RecordingBackend):
    """Dry run, except that a restart asked `in_process` reports it healed in-process (as
    the Kubernetes and local backends do) and a checkpoint asked to `fail` fails."""

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        result = dict(await super().execute(action))
        if action.params.get("fail"):
            raise ActionError("the workers did not answer")
        if action.params.get("in_process"):
            result["path"] = "in_process"
        return result


@asynccontextmanager
async def served(settings: Settings) -> AsyncIterator[tuple[Api, JobMetrics]]:
    supervisor = Supervisor(settings, backend=HealingBackend())
    app = create_app(settings, supervisor)
    job_metrics: JobMetrics = app.state.job_metrics
    job_metrics.cost_factor = 0  # every scrape past goodput_sample_period_s computes anew
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield Api(client, supervisor), job_metrics


def settings_for_metrics(make_settings: SettingsFactory) -> Settings:
    return make_settings(
        heartbeat_timeout_s=60,
        heartbeat_polling_period_s=5,
        goodput_sample_period_s=0.05,
        max_restarts_in_window=5,
    )


async def scrape(api: Api) -> dict[str, dict[Labels, float]]:
    """Each sample of /metrics by name, then by its labels."""
    await asyncio.sleep(0.06)  # past goodput_sample_period_s: the history is read again
    response = await api.client.get("/metrics")
    assert response.status_code == 200
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


def job(name: str, **labels: str) -> Labels:
    return tuple(sorted({"job_name": name, **labels}.items()))


@dataclass
class Driven:
    """What `drive` did, to compare the metrics with."""

    last_step: int
    last_step_at: float  # Unix time
    seconds_per_step: float  # as the heartbeats advanced after the restart


async def beat_steps(api: Api, first: int, count: int, gap_s: float) -> list[tuple[int, float]]:
    """Heartbeats of n1 and n2 (job j1) whose step advances by 10 every `gap_s`."""
    sent = []
    for i in range(count):
        step = first + 10 * i
        for node in ("n1", "n2"):
            assert (await api.beat(heartbeat(node, step=step))).status_code in (202, 204)
        sent.append((step, time.time()))
        await asyncio.sleep(gap_s)
    return sent


async def drive(api: Api) -> Driven:
    """A job that trains, is healed of an XID by the default policy (an emergency
    checkpoint, then a hot swap to the spare), trains again, and gets two operator actions:
    an in-process restart and an emergency checkpoint that fails. Two heartbeats are
    refused on the way."""
    assert (await api.beat(heartbeat("s1", job=None))).status_code in (202, 204)
    await beat_steps(api, 10, 5, 0.05)
    assert (await api.beat(heartbeat("n1"), headers={})).status_code == 401
    assert (await api.beat({"node": "n1", "state": "sleeping"})).status_code == 422
    fault = await api.client.post(
        "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79}, headers=OPERATOR
    )
    assert fault.status_code == 201, fault.text
    await api.settle()
    actions = (await api.get("/api/v1/actions"))["items"][::-1]
    assert [(a["type"], a["status"]) for a in actions] == [
        ("emergency_checkpoint", "succeeded"),
        ("hot_swap", "succeeded"),
    ]
    await asyncio.sleep(0.1)  # the step after the restart comes later than it
    sent = await beat_steps(api, 100, 12, 0.05)
    for body in (
        {"type": "restart_in_place", "job": "j1", "params": {"in_process": True}},
        {"type": "emergency_checkpoint", "job": "j1", "params": {"fail": True}},
    ):
        response = await api.client.post("/api/v1/actions", json=body, headers=OPERATOR)
        assert response.status_code == 202, response.text
    await api.settle()
    (first_step, first_at), (last_step, last_at) = sent[0], sent[-1]
    return Driven(last_step, last_at, (last_at - first_at) / (last_step - first_step))


async def test_per_job_series_follow_what_the_api_was_told(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with served(settings_for_metrics(make_settings)) as (api, _):
        driven = await drive(api)
        # The job stands still from here: its goodput falls as the time since its last step
        # grows (a few points a second). Both figures below are read as of one instant, so
        # that they agree however long the machine takes between them.
        now = utcnow()
        monkeypatch.setattr(goodput_service, "utcnow", lambda: now)
        metrics = await scrape(api)
        goodput = (await api.get("/api/v1/jobs/j1/goodput"))["goodput"]
        monkeypatch.undo()

    j1 = job("j1")
    assert metrics["supervisor_job_last_step"] == {j1: driven.last_step}
    assert metrics["supervisor_job_last_progress_timestamp_seconds"][j1] == approx(
        driven.last_step_at, abs=1.0
    )
    assert metrics["supervisor_job_running"] == {j1: 1.0}
    # The same model as GET .../goodput.
    assert 0 < metrics["supervisor_job_goodput_ratio"][j1] == approx(goodput, abs=0.02)
    assert metrics["supervisor_job_step_seconds"][j1] == approx(driven.seconds_per_step, rel=0.5)
    restarts = {
        dict(labels)["kind"]: value
        for labels, value in metrics["supervisor_job_restarts_total"].items()
    }
    assert restarts == {
        "restart_in_place": 0,
        "in_process_restart": 1,
        "restart_workload": 0,
        "hot_swap": 1,
        "in_process_hot_swap": 0,
        "scale_down": 0,
        "scale_up": 0,
    }
    assert metrics["supervisor_job_emergency_checkpoints_total"] == {
        job("j1", outcome="succeeded"): 1,
        job("j1", outcome="failed"): 1,
    }
    # 5 allowed per window; the hot swap and the in-process restart were taken.
    assert metrics["supervisor_job_restarts_remaining"] == {j1: 3}
    # One incident (the XID), recovered at the first step after the hot swap: under 10 s.
    assert metrics["supervisor_job_recovery_seconds_count"] == {j1: 1}
    assert 0 < metrics["supervisor_job_recovery_seconds_sum"][j1] < 10
    buckets = metrics["supervisor_job_recovery_seconds_bucket"]
    assert buckets[job("j1", le="10.0")] == 1 and buckets[job("j1", le="+Inf")] == 1
    assert metrics["supervisor_spare_nodes"] == {(): 1}
    rejected = {
        dict(k)["reason"]: v for k, v in metrics["supervisor_heartbeats_rejected_total"].items()
    }
    assert rejected == {
        "unauthorized": 1,
        "invalid": 1,
        "too_large": 0,
        "not_json": 0,
        "not_ready": 0,
        "wrong_method": 0,
    }
    assert metrics["supervisor_leader"] == {(): 1}


async def test_recoveries_are_counted_once_and_jobs_that_go_take_their_series(
    make_settings: SettingsFactory,
) -> None:
    async with served(settings_for_metrics(make_settings)) as (api, _):
        await drive(api)
        await api.beat(heartbeat("n3", job="j2", step=5))
        first = await scrape(api)
        again = await scrape(api)
        assert (
            again["supervisor_job_recovery_seconds_count"]
            == first["supervisor_job_recovery_seconds_count"]
            == {job("j1"): 1, job("j2"): 0}
        )
        # A job that finished: its node reports complete, it no longer runs.
        await api.beat({"node": "n3", "state": "complete", "job": "j2"})
        assert (await scrape(api))["supervisor_job_running"][job("j2")] == 0
        # A job the sensor no longer knows has no series left, counters included (taken
        # out of its records by hand: nothing the sensor is told makes it forget a job).
        del api.supervisor.sensor._jobs["j2"]
        gone = await scrape(api)
        for name in (
            "supervisor_job_last_step",
            "supervisor_job_running",
            "supervisor_job_goodput_ratio",
            "supervisor_job_restarts_total",
            "supervisor_job_recovery_seconds_count",
        ):
            assert {dict(labels)["job_name"] for labels in gone[name]} == {"j1"}, name
        # A replica that stops acting (a lost Lease) exports no job, and no spares.
        api.supervisor.ready = False
        standby = await scrape(api)
        api.supervisor.ready = True
        assert "supervisor_job_last_step" not in standby
        assert "supervisor_spare_nodes" not in standby
        assert (
            standby["supervisor_heartbeats_received_total"]
            == gone["supervisor_heartbeats_received_total"]
        )


async def test_a_scrape_does_not_compute_again_while_the_figures_are_fresh(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(heartbeat_timeout_s=60, goodput_sample_period_s=3600)
    async with served(settings) as (api, job_metrics):
        await beat_steps(api, 10, 2, 0)
        computed = []
        compute = job_metrics._compute

        def counting(*args: Any) -> Any:
            computed.append(args)
            return compute(*args)

        monkeypatch.setattr(job_metrics, "_compute", counting)
        for _ in range(3):
            assert (await api.client.get("/metrics")).status_code == 200
        assert len(computed) == 1


# --- the figures on a timeline worked by hand --------------------------------------------


# The worked example of tests/test_goodput_history.py: steps sampled at (step, time)
# (10, 10), (20, 20), (25, 26), (30, 57), (40, 67); the heartbeat of n1 lost at 40 (its
# last at 28); the hot swap ends at 50, the workers load step 25 from 50 to 52.
WORKED = Timeline(
    job="j1",
    start=0.0,
    end=67.0,
    job_starts=(JobStarted(0.0), JobStarted(50.0)),
    steps=tuple(StepReported(s, t) for s, t in ((10, 10), (20, 20), (25, 26), (30, 57), (40, 67))),
    loads=(CheckpointLoaded(25, 52.0, 2.0),),
    failures=(FailureDetected(40.0, 28.0, "host_heartbeat_lost", "n1"),),
)


def test_time_to_recover_runs_from_detection_to_the_first_step_after_the_restart() -> None:
    assert recoveries(WORKED) == [(40.0, 17.0)]  # detected at 40, step 30 seen at 57
    # Not restarted yet, or restarted without a step since: not recovered yet.
    assert recoveries(Timeline(job="j1", steps=WORKED.steps, failures=WORKED.failures)) == []
    restarted = Timeline(
        job="j1", job_starts=(JobStarted(60.0),), steps=WORKED.steps[:3], failures=WORKED.failures
    )
    assert recoveries(restarted) == []


def test_a_recovery_is_observed_once_in_its_bucket() -> None:
    histogram = RecoveryHistogram()
    histogram.observe([(40.0, 17.0)])
    histogram.observe([(40.0, 17.0), (100.0, 5.0)])  # the first one again, and a new one
    assert (histogram.total, histogram.sum_s) == (2, 22.0)
    buckets = dict(histogram.buckets())
    assert buckets["10.0"] == 1 and buckets["30.0"] == 2 and buckets["+Inf"] == 2


def test_step_time_is_measured_within_the_current_attempt() -> None:
    # After the load at 52, only (30, 57) and (40, 67) belong to the attempt: 1 s per step.
    assert recent_step_seconds(WORKED) == approx(1.0)
    # Before the failure: (10, 10) .. (25, 26), 16 s for 15 steps.
    before = Timeline(job="j1", job_starts=(JobStarted(0.0),), steps=WORKED.steps[:3])
    assert recent_step_seconds(before) == approx(16 / 15)
    # The window keeps only the newest reports: (20, 20) .. (25, 26) within 10 s.
    assert recent_step_seconds(before, window_s=10) == approx(6 / 5)
    assert recent_step_seconds(Timeline(job="j1", steps=WORKED.steps[:1])) is None
