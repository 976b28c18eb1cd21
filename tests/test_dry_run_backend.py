"""The dry-run backend (`backend: dry_run`, the default) is a dry run, and says so: in
/api/v1/info, on each action it records (the API, the metrics, the CLI), and in a picture
where no node moved: nothing cordoned, no spare taken, the job's nodes as they were."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from supervisor.domain import ActionRecord, ActionStatus, ActionType
from supervisor.notices import action_notice
from supervisor.ops.client import StreamMessage
from supervisor.ops.commands import _watch_line
from supervisor.ops.listing import ACTION_COLUMNS
from supervisor.ops.output import table
from supervisor.runtime import make_backend
from tests.conftest import SettingsFactory
from tests.test_api import Api, heartbeat, running


async def test_the_dry_run_backend_says_it_is_a_dry_run(make_settings: SettingsFactory) -> None:
    settings = make_settings()
    assert settings.backend == "dry_run" and not settings.dry_run  # as `supervisor serve`
    async with running(settings, make_backend(settings)) as api:
        info = await api.get("/api/v1/info")
        assert (info["backend"], info["dry_run"]) == ("dry_run", True)
        # What the dashboard's fault form shows of each kind: its row's parameters.
        assert info["fault_params"] == {
            "ecc": ["count", "gpu"],
            "heartbeat_loss": ["duration_s"],
            "xid": ["code", "gpu", "rank"],
        }


async def until_swapped(api: Api, silent: str, alive: dict[str, str | None]) -> dict[str, Any]:
    """Heartbeats from `alive` (node -> job) while `silent` says nothing, until the hot
    swap of `silent` finished; that action."""
    deadline = time.monotonic() + 15
    while True:
        for node, job in alive.items():
            response = await api.beat(heartbeat(node, job=job))
            assert response.status_code in (202, 204), response.text
        swaps = (await api.get("/api/v1/actions", type="hot_swap", node=silent))["items"]
        if swaps and swaps[0]["status"] in ("succeeded", "failed"):
            return dict(swaps[0])
        assert time.monotonic() < deadline, f"no hot swap of {silent}: {swaps}"
        await asyncio.sleep(0.1)


async def test_a_dry_run_hot_swap_is_marked_and_moves_no_node(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(heartbeat_timeout_s=0.5, heartbeat_polling_period_s=0.1)
    async with running(settings, make_backend(settings)) as api:
        for node, job in (("n1", "j1"), ("n2", "j1"), ("s1", None)):
            await api.beat(heartbeat(node, job=job))
        swap = await until_swapped(api, "n1", {"n2": "j1", "s1": None})
        assert (swap["status"], swap["params"], swap["dry_run"]) == (
            "succeeded",
            {"spare": "s1"},
            True,
        )
        assert swap["result"] == {"dry_run": True}
        await api.settle()
        lost = await api.get("/api/v1/nodes/n1")
        assert (lost["status"], lost["cordoned"], lost["dry_run_cordoned"]) == ("lost", False, True)
        spare = await api.get("/api/v1/nodes/s1")
        assert (spare["status"], spare["job"], spare["cordoned"]) == ("spare", None, False)
        assert (await api.get("/api/v1/jobs/j1"))["nodes"] == ["n1", "n2"]
        # Counted apart: no hot swap among the actions carried out.
        metrics = (await api.client.get("/metrics")).text
        done = 'outcome="succeeded",type="hot_swap"'
        assert f"supervisor_dry_run_actions_total{{{done}}} 1.0" in metrics
        assert f"supervisor_actions_total{{{done}}}" not in metrics


def test_the_cli_marks_a_dry_run_action() -> None:
    action = {
        "id": 7,
        "created_at": "2026-01-01T00:00:00+00:00",
        "finished_at": "2026-01-01T00:00:01+00:00",
        "type": "hot_swap",
        "status": "succeeded",
        "node": "n1",
        "job": "j1",
        "source": "policy",
        "event_id": 3,
        "attempts": 1,
        "duration_s": 0.01,
        "error": None,
        "reason": "lost",
        "dry_run": True,
    }
    [_, row] = table([action], ACTION_COLUMNS).splitlines()
    assert row.split()[2:5] == ["hot_swap", "succeeded(dry-run)", "n1"]
    line = _watch_line(StreamMessage("action", "7", action), "table")
    assert "hot_swap succeeded (dry run)" in line
    carried_out = table([{**action, "dry_run": False}], ACTION_COLUMNS).splitlines()[1]
    assert carried_out.split()[3] == "succeeded"


def test_a_notification_says_the_action_was_a_dry_run() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    swap = ActionRecord(
        id=7,
        type=ActionType.HOT_SWAP,
        status=ActionStatus.SUCCEEDED,
        idempotency_key="k",
        source="policy",
        created_at=at,
        node="n1",
        dry_run=True,
    )
    notice = action_notice(swap)
    assert notice is not None and notice.details["dry_run"] is True
    assert notice.summary == "dry run, nothing done: hot swap succeeded: node n1"
    carried_out = action_notice(replace(swap, dry_run=False))
    assert carried_out is not None and "dry_run" not in carried_out.details
