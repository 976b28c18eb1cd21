"""The chaos bench's stall rule (bench/stall.py) against a real `supervisor serve`: a job
with no new step for several hang timeouts, unfinished, fails the run with what the
supervisor said of it; a job that progresses, or finished, does not. The watch's clock
is the test's, so no test waits for the timeouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.stall import Stalled, StallWatch
from tests.http import http
from tests.test_e2e import OPERATOR, serving
from tests.test_ops_cli import beat
from tests.timing import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def worker(step: int, state: str = "running", **extra: Any) -> dict[str, Any]:
    report = {"rank": 0, "local_rank": 0, "pid": 100, "state": state, "step": step, **extra}
    return {"node": "n1", "state": "running", "job": "j1", "workers": [report]}


def test_a_stalled_job_fails_the_run_with_what_the_supervisor_said(tmp_path: Path) -> None:
    with serving(
        tmp_path,
        heartbeat_polling_period_s=5,
        heartbeat_timeout_s=600,
        hang_timeout_s=2,
        hang_warmup_intervals=0,
    ) as server:

        def api(path: str, **params: Any) -> Any:
            return http.get(f"{server.url}{path}", params=params, headers=OPERATOR).json()

        clock = Clock()
        watch = StallWatch(api, "j1", hang_timeouts=3, floor_s=0, clock=clock)
        for step in range(1, 5):
            beat(server, worker(step))
            clock.now += 5  # a slow step, but a step: progress
            watch.check()
        clock.now += 5.9  # 3 hang timeouts of 2 s: not yet
        watch.check()
        clock.now += 0.2
        with pytest.raises(Stalled) as stalled:
            watch.check()
        message = str(stalled.value)
        assert "made no progress for 6 s (3 hang timeouts of 2 s) past step 4" in message
        assert "state running" in message

        # The supervisor's own word on it, when it said something.
        beat(server, worker(4, "exited", exit_code=1))

        def told() -> bool:
            try:
                watch.check()
            except Stalled as exc:
                if "last action" in str(exc):
                    assert "last event worker_exited on n1" in str(exc), exc
                    return True
            return False

        wait_until(told, "the actions told", 15)

        # The remedies of that exit finish (until then the job is recovering, not done).
        def healed() -> bool:
            actions = api("/api/v1/actions", job="j1")["items"]
            done = all(a["status"] in ("succeeded", "failed") for a in actions)
            return done and api("/api/v1/jobs/j1")["state"] != "recovering"

        wait_until(healed, "the remedies finished", 15)

        # A job that finished is no stall, however long it stands still.
        beat(server, worker(4, "finishing"), worker(4, "exited", exit_code=0))
        clock.now += 1000
        watch.check()
