"""`supervisor describe job` says when the supervisor gave a job up, and why;
`supervisor reset-budget JOB` starts its budget over, recorded. Against a real
`supervisor serve`, fed real heartbeats."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from supervisor.ops.errors import ExitCode
from tests.http import http
from tests.test_e2e import OPERATOR, Server, serving
from tests.test_ops_cli import beat, cli, failed, ok
from tests.timing import wait_until

GIVEN_UP = re.compile(r"^state:\s+given_up$", re.M)


def worker(node: str, pid: int, state: str = "running", **extra: Any) -> dict[str, Any]:
    report = {"rank": 0, "local_rank": 0, "pid": pid, "state": state, "step": 7, **extra}
    return {"node": node, "state": "running", "job": "j1", "workers": [report]}


def remedied(server: Server) -> bool:
    """The job's restart was decided and carried out: it is no longer recovering."""

    def api(path: str, **params: Any) -> Any:
        return http.get(f"{server.url}{path}", params=params, headers=OPERATOR).json()

    actions = api("/api/v1/actions", job="j1")["items"]
    restarted = any(a["type"] == "restart_in_place" for a in actions)
    finished = all(a["status"] in ("succeeded", "failed") for a in actions)
    return restarted and finished and api("/api/v1/jobs/j1")["state"] != "recovering"


def given_up_described(tmp: Path, server: Server) -> str | None:
    """`describe job j1` once it shows the job given up, with the event saying so (it is
    recorded after the state changed)."""
    described = ok(cli(tmp, "describe", "job", "j1", server=server))
    return described if GIVEN_UP.search(described) and "job_given_up" in described else None


def test_describe_shows_a_job_given_up_and_reset_budget_heals_it_again(tmp_path: Path) -> None:
    with serving(
        tmp_path, heartbeat_polling_period_s=5, heartbeat_timeout_s=600, max_no_progress_restarts=1
    ) as server:
        beat(server, worker("n1", 100))
        # A restart that resumes at the same step and crashes again: no progress. The
        # restarted worker is the restart's own, so it crashes once the restart is carried
        # out (a crash told while the remedy runs is part of its incident).
        beat(server, worker("n1", 100, "exited", exit_code=1))
        wait_until(lambda: remedied(server), "the restart carried out", 20)
        beat(server, worker("n1", 200))
        beat(server, worker("n1", 200, "exited", exit_code=1))
        beat(server, worker("n1", 300))
        described = wait_until(lambda: given_up_described(tmp_path, server), "the job given up", 20)
        assert "1 remedies in a row were not followed by progress" in described

        out = ok(cli(tmp_path, "reset-budget", "j1", server=server))
        assert out.startswith("job j1: budget reset (it was given up), now running"), out
        described = ok(cli(tmp_path, "describe", "job", "j1", server=server))
        assert re.search(r"^state:\s+running$", described, re.M), described
        assert "job_budget_reset" in described
        failed(cli(tmp_path, "reset-budget", "nope", server=server), ExitCode.NOT_FOUND, "nope")
