"""A budget judged by progress, never spent in silence: a job whose remedies are not
followed by progress is given up after `max_no_progress_restarts` (a `job_given_up` event
with its reason, the job's state, the metric), a lost node of it is still swapped for a
spare, an operator resets it (recorded); a job that progresses between faults is healed
every time. Over HTTP, as host monitors report and operators act."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from supervisor.domain import EventType
from supervisor.store import EventFilter
from tests.conftest import OPERATOR_TOKEN, SettingsFactory
from tests.test_api import Api, running
from tests.test_notifications import Receiver, route
from tests.timing import scaled

OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
SPARE = {"node": "s1", "state": "spare"}


def worker(node: str, step: int, pid: int, state: str = "running", **extra: Any) -> Any:
    rank = int(node.lstrip("n"))
    report = {"rank": rank, "local_rank": 0, "pid": pid, "state": state, "step": step, **extra}
    return {"node": node, "state": "running", "job": "j1", "workers": [report]}


class Job:
    """Two nodes of job j1 and a spare, as their host monitors report them."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.pids = {"n0": 100, "n1": 101}
        self.steps = {"n0": 0, "n1": 0}

    async def beat(self, *skip: str, **states: Any) -> None:
        bodies = [
            worker(n, self.steps[n], self.pids[n], **states.get(n, {}))
            for n in ("n0", "n1")
            if n not in skip
        ]
        for body in [*bodies, SPARE]:
            assert (await self.api.beat(body)).status_code in (202, 204), body

    async def train_to(self, step: int) -> None:
        while self.steps["n0"] < step:
            self.steps = {n: s + 1 for n, s in self.steps.items()}
            await self.beat()
            await asyncio.sleep(0.01)

    async def fail(self) -> None:
        """n0's worker exits with 1, and the supervisor settles."""
        await self.beat(n0={"state": "exited", "exit_code": 1})
        await self.api.settle()

    async def crash(self) -> list[dict[str, Any]]:
        """n0's worker exits with 1; the actions decided for it."""
        before = len(await actions(self.api))
        await self.fail()
        # The remedy restarted it: a new process, from the step every rank stood at.
        self.pids["n0"] += 100
        await self.beat()
        return (await actions(self.api))[before:]


async def actions(api: Api) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = (await api.get("/api/v1/actions", limit=200))["items"]
    return items[::-1]


@pytest.fixture
async def api(make_settings: SettingsFactory) -> AsyncIterator[Api]:
    # The test beats between its steps only: a timeout shorter than a settle under load
    # lost nodes the test meant to keep (seen under two CPU burners).
    settings = make_settings(
        heartbeat_polling_period_s=0.05, heartbeat_timeout_s=4.0, max_no_progress_restarts=3
    )
    async with running(settings) as a:
        yield a


async def given_up_gauge(api: Api) -> float:
    text = (await api.client.get("/metrics")).text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("supervisor_jobs_given_up ")]
    return float(line.split()[1])


async def test_remedies_without_progress_give_the_job_up_and_say_so(api: Api) -> None:
    job = Job(api)
    await job.train_to(5)
    for _ in range(3):  # each restart resumes at step 5 and crashes before step 6
        assert [a["type"] for a in await job.crash()][-1].startswith("restart")
    assert (await api.get("/api/v1/events", type="job_given_up"))["items"] == []

    before = len(await actions(api))
    await job.fail()  # the fourth: no remedy, and the supervisor says why
    # Raised while the controller drained, the give-up is recorded once settled: read
    # at once, nothing awaited in between.
    recorded = api.supervisor.store.list_events(EventFilter(types=[EventType.JOB_GIVEN_UP]))
    assert len(recorded.items) == 1, "settled before the give-up was recorded"
    assert (await actions(api))[before:] == []
    (given_up,) = (await api.get("/api/v1/events", type="job_given_up"))["items"]
    assert given_up["job"] == "j1" and given_up["details"]["no_progress_restarts"] == 3
    assert "3 remedies in a row were not followed by progress" in given_up["details"]["reason"]
    assert "worker_exited on n0" in given_up["details"]["reason"]
    view = await api.get("/api/v1/jobs/j1")
    assert view["state"] == "given_up" and view["given_up_reason"] == given_up["details"]["reason"]
    assert await given_up_gauge(api) == 1
    assert await job.crash() == []  # said once, not at every failure
    assert len((await api.get("/api/v1/events", type="job_given_up"))["items"]) == 1

    # A lost node is not the job's fault: swapped for the spare whatever the budget.
    before = len(await actions(api))
    deadline = asyncio.get_running_loop().time() + scaled(30)
    while len(await actions(api)) < before + 2:
        assert asyncio.get_running_loop().time() < deadline, "n1 was not swapped"
        await job.beat("n1")
        await asyncio.sleep(0.05)
    await api.settle()
    swapped = (await actions(api))[before:]
    assert [(a["type"], a["node"]) for a in swapped] == [
        ("emergency_checkpoint", None),
        ("hot_swap", "n1"),
    ], swapped
    assert swapped[1]["params"]["spare"] == "s1"
    # The swap restarted every rank: n0 runs a new process (the old one's end, had it been
    # reported, belongs to the swap's incident, not to a new failure).
    job.pids["n0"] += 100
    await job.beat("n1")

    # The operator fixed the cause: the job is healed again, and the reset is recorded.
    r = await api.client.post("/api/v1/jobs/j1/reset-budget", headers=OPERATOR)
    assert r.status_code == 200, r.text
    reset = r.json()
    assert reset["event"]["type"] == "job_budget_reset" and reset["job"]["state"] != "given_up"
    # The three restarts and the hot swap: none followed by progress yet.
    assert reset["event"]["details"] == {"was_given_up": True, "no_progress_restarts": 4}
    assert await given_up_gauge(api) == 0
    job.pids["n1"] = 900  # its node back, with a new worker
    assert [a["type"] for a in await job.crash()][-1].startswith("restart")


async def test_a_job_that_progresses_between_faults_is_healed_every_time(api: Api) -> None:
    job = Job(api)
    await job.train_to(5)
    for i in range(6):
        remedy = await job.crash()
        assert remedy and remedy[-1]["type"].startswith("restart"), (i, remedy)
        await job.train_to(job.steps["n0"] + 3)  # past the step it stood at
    assert (await api.get("/api/v1/events", type="job_given_up"))["items"] == []
    assert (await api.get("/api/v1/jobs/j1"))["no_progress_restarts"] == 0


async def test_reset_budget_names_an_unknown_job(api: Api) -> None:
    r = await api.client.post("/api/v1/jobs/nope/reset-budget", headers=OPERATOR)
    assert r.status_code == 404 and r.json()["message"].startswith("name: ")
    r = await api.client.post("/api/v1/jobs/nope/reset-budget")
    assert r.status_code == 401


async def test_a_job_given_up_pages_its_route(make_settings: SettingsFactory) -> None:
    hook = Receiver()
    routes = [route("owners", f"{hook.url}/owners", events=["job_given_up"], jobs=["j1"])]
    settings = make_settings(
        heartbeat_polling_period_s=0.05,
        heartbeat_timeout_s=30,
        max_no_progress_restarts=1,
        notification_routes=routes,
    )
    with hook.serving():
        async with running(settings) as api:
            job = Job(api)
            await job.train_to(3)
            await job.crash()
            assert await job.crash() == []
            deadline = asyncio.get_running_loop().time() + scaled(5)
            while not hook.requests:
                assert asyncio.get_running_loop().time() < deadline, "no notification sent"
                await asyncio.sleep(0.05)
    (sent,) = hook.bodies("/owners")
    assert (sent["type"], sent["job"], sent["severity"]) == ("job_given_up", "j1", "critical")
    assert sent["reason"].startswith("1 remedies in a row were not followed by progress")


async def test_a_usage_error_before_the_first_step_is_given_up_at_once(api: Api) -> None:
    def starting(node: str, **report: Any) -> Any:
        body = worker(node, 0, 100 + int(node.lstrip("n")), **report)
        body["workers"][0]["step"] = None  # no step reported yet
        return body

    for body in (starting("n0"), starting("n1"), SPARE):
        assert (await api.beat(body)).status_code in (202, 204)
    await api.beat(starting("n0", state="exited", exit_code=2))
    await api.beat(starting("n1", state="exited", exit_code=2))
    await api.settle()
    assert await actions(api) == []  # whatever the policy: no restart mends bad arguments
    (given_up,) = (await api.get("/api/v1/events", type="job_given_up"))["items"]
    assert given_up["details"]["reason"] == (
        "rank 0 on n0 exited with code 2 (a usage error: bad arguments or settings) before "
        "the job's first step: not restarted"
    )


async def test_exit_code_2_after_the_first_step_is_healed_as_any_crash(api: Api) -> None:
    job = Job(api)
    await job.train_to(3)
    before = len(await actions(api))
    await job.beat(n0={"state": "exited", "exit_code": 2})
    await api.settle()
    assert [a["type"] for a in await actions(api)][before:][-1].startswith("restart")
    assert (await api.get("/api/v1/events", type="job_given_up"))["items"] == []
