"""A chaos run's job that stalls is a failure of the run: no new step for several hang
timeouts while the job is not finished. Told with what the supervisor said of the job:
why it gave it up, else its newest event and action."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: The hang timeout to count in while the job's is not learned yet (its warm-up).
DEFAULT_HANG_TIMEOUT_S = 60.0


class Stalled(RuntimeError):
    """The job made no progress for several hang timeouts and is not finished."""


class StallWatch:
    """Watches a job's step through the supervisor's API (`api(path, **params)`, None
    when it does not answer)."""

    def __init__(
        self,
        api: Callable[..., Any],
        job: str,
        *,
        hang_timeouts: float = 3.0,
        floor_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.job = job
        self.hang_timeouts = hang_timeouts
        self.floor_s = floor_s
        self.clock = clock
        self.best: int | None = None
        self.since = clock()

    def check(self) -> None:
        """Raise Stalled once the job went `hang_timeouts` hang timeouts (at least
        `floor_s`) without a step past the highest it reached, unfinished."""
        view = self.api(f"/api/v1/jobs/{self.job}")
        if not isinstance(view, dict) or view.get("state") == "finished":
            return
        now = self.clock()
        step = view.get("last_step")
        if step is not None and (self.best is None or step > self.best):
            self.best, self.since = step, now
            return
        timeout = view.get("hang_timeout_s") or DEFAULT_HANG_TIMEOUT_S
        limit = max(self.floor_s, self.hang_timeouts * timeout)
        if now - self.since >= limit:
            raise Stalled(
                f"job {self.job} made no progress for {now - self.since:.0f} s "
                f"({self.hang_timeouts:g} hang timeouts of {timeout:g} s) past step "
                f"{self.best}, state {view.get('state')}: {self.reason(view)}"
            )

    def reason(self, view: dict[str, Any]) -> str:
        """What the supervisor said of the job."""
        if view.get("given_up_reason"):
            return f"the supervisor gave it up: {view['given_up_reason']}"
        said = []
        events = self.api("/api/v1/events", job=self.job, limit=1)
        if isinstance(events, dict) and events.get("items"):
            e = events["items"][0]
            said.append(f"last event {e['type']}" + (f" on {e['node']}" if e["node"] else ""))
        actions = self.api("/api/v1/actions", job=self.job, limit=1)
        if isinstance(actions, dict) and actions.get("items"):
            a = actions["items"][0]
            said.append(
                f"last action {a['type']} {a['status']}"
                + (f" ({a['error']})" if a.get("error") else "")
                + (f": {a['reason']}" if a.get("reason") else "")
            )
        return "; ".join(said) or "the supervisor said nothing of it"
