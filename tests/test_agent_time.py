"""Every time an agent sends goes through one rule: with a zone, within the UTC range,
within `agent_clock_skew_s` of the supervisor's clock; else a 422 naming the field and
nothing recorded. Driven over HTTP as a host monitor sends them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from tests.conftest import SettingsFactory
from tests.test_api import AGENT, Api, heartbeat, running


@pytest.fixture
async def api(make_settings: SettingsFactory) -> AsyncIterator[Api]:
    settings = make_settings(
        heartbeat_timeout_s=600, heartbeat_polling_period_s=5, agent_clock_skew_s=300
    )
    async with running(settings) as a:
        yield a


def now() -> datetime:
    return datetime.now(UTC)


def report(report_id: str, time: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": report_id,
        "node": "n1",
        "job": "j1",
        "rank": 2,
        "event": "saved",
        "step": 10,
        "duration_s": 1.0,
        "tier": "ram",
        "time": time,
        **extra,
    }


#: A time relative to now is made when the test runs, not when it is collected: a test
#: run many minutes after its collection (a parallel run) would find "ten minutes
#: ahead" in the past.
BAD_TIMES = [
    pytest.param(lambda: "2020-01-01T00:00:00", "zone", id="naive"),
    pytest.param(lambda: "0001-01-01T00:00:00+14:00", "range", id="before-year-1-in-utc"),
    pytest.param(lambda: (now() - timedelta(days=90)).isoformat(), "behind", id="months-behind"),
    pytest.param(
        lambda: (now() + timedelta(minutes=10)).isoformat(), "ahead", id="ten-minutes-ahead"
    ),
]


@pytest.mark.parametrize(("time", "why"), BAD_TIMES)
async def test_a_gpu_report_time_outside_the_rule_is_a_422_naming_it(
    api: Api, time: Callable[[], str], why: str
) -> None:
    ok = {"kind": "xid", "code": 79, "gpu": 0, "time": now().isoformat()}
    bad = {"kind": "xid", "code": 48, "gpu": 1, "time": time()}
    r = await api.beat(heartbeat("n1", gpu_reports=[ok, bad]))
    assert r.status_code == 422, r.text
    message = r.json()["message"]
    assert message.startswith("gpu_reports.1.time: ") and why in message, message
    assert (await api.get("/api/v1/events"))["items"] == []  # nothing of it recorded

    r = await api.beat(heartbeat("n1", gpu_reports=[ok]))
    assert r.status_code == 202, r.text
    (event,) = (await api.get("/api/v1/events", type="gpu_xid"))["items"]
    assert event["details"]["code"] == 79


@pytest.mark.parametrize(("time", "why"), BAD_TIMES)
async def test_a_checkpoint_report_time_outside_the_rule_is_a_422_naming_it(
    api: Api, time: Callable[[], str], why: str
) -> None:
    batch = [report("good", now().isoformat()), report("bad", time())]
    r = await api.client.post("/api/v1/checkpoints", json={"reports": batch}, headers=AGENT)
    assert r.status_code == 422, r.text
    message = r.json()["message"]
    assert message.startswith("reports.1.time: "), message
    assert api.supervisor.store.list_checkpoint_reports() == []

    r = await api.client.post("/api/v1/checkpoints", json={"reports": batch[:1]}, headers=AGENT)
    assert r.status_code == 200 and r.json()["stored"] == 1, r.text


async def test_reports_kept_while_the_supervisor_was_down_are_taken_against_sent_at(
    api: Api,
) -> None:
    """A host monitor keeps reports in its outbox while the supervisor is down and sends
    them later with `sent_at`: the agent's clock is checked on `sent_at`, the reports'
    times against it (at most a week before it, never after it)."""
    held = report("held", (now() - timedelta(hours=3)).isoformat())
    url, fresh = "/api/v1/checkpoints", now().isoformat()
    alone = await api.client.post(url, json={"reports": [held]}, headers=AGENT)
    assert alone.status_code == 422  # without sent_at: 3 hours is past the skew
    refused = [
        ({"sent_at": (now() - timedelta(days=90)).isoformat()}, "sent_at: "),
        ({"sent_at": "2026-01-05T12:00:00"}, "sent_at: "),  # no zone
        ({"sent_at": fresh, "reports": [report("x", (now() - timedelta(days=8)).isoformat())]},
         "reports.0.time: "),
        ({"sent_at": fresh, "reports": [report("y", (now() + timedelta(hours=1)).isoformat())]},
         "reports.0.time: "),
    ]  # fmt: skip
    for change, field in refused:
        r = await api.client.post(url, json={"reports": [held], **change}, headers=AGENT)
        assert r.status_code == 422, r.text
        assert r.json()["message"].startswith(field), r.json()
    assert api.supervisor.store.list_checkpoint_reports() == []  # nothing of those kept
    r = await api.client.post(url, json={"reports": [held], "sent_at": fresh}, headers=AGENT)
    assert r.status_code == 200 and r.json()["stored"] == 1, r.text


async def test_a_time_just_within_the_bound_is_taken_in_utc(api: Api) -> None:
    local = (now() - timedelta(minutes=4)).astimezone(timezone(timedelta(hours=2)))
    r = await api.client.post(
        "/api/v1/checkpoints",
        json={"reports": [report("r1", local.isoformat())]},
        headers=AGENT,
    )
    assert r.status_code == 200, r.text
    (stored,) = await api.get("/api/v1/checkpoints")
    assert stored["time"].endswith("Z")
    assert abs(datetime.fromisoformat(stored["time"]) - local) < timedelta(seconds=1)


async def test_goodput_never_starts_a_job_long_before_it_was_seen(api: Api) -> None:
    """A report within the bound that blocked for a week (its `duration_s`) moves the
    job's start at most the bound before the supervisor first saw the job."""
    assert (await api.beat(heartbeat("n1"))).status_code in (202, 204)
    long_load = report("r1", now().isoformat(), event="loaded", duration_s=604_800)
    r = await api.client.post("/api/v1/checkpoints", json={"reports": [long_load]}, headers=AGENT)
    assert r.status_code == 200, r.text
    goodput = await api.get("/api/v1/jobs/j1/goodput")
    assert 300 <= goodput["wall_s"] <= 300 + 60, goodput
