"""A job's end is a state: workers that left their loop report `finishing`, the job is not
watched for hangs then (only bounded by `finishing_timeout_s`), and its state reads
finishing, then finished. Over HTTP, as host monitors and operators use the API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from supervisor.domain import WorkerState, WorkerView
from supervisor.sensor.finishing import phase
from tests.conftest import SettingsFactory
from tests.test_api import OPERATOR, Api, running
from tests.timing import scaled

HANG_S = 0.3
#: The finishing bound of the tests that wait for it to pass.
FINISHING_S = 3.0
#: The finishing bound of the tests in which no job may pass it: a hold of 4 x HANG_S
#: took 3.4 s beside two CPU burners (a busy event loop's beats), and a finishing hang
#: past the bound would then be right.
PATIENT_FINISHING_S = 60.0


def beat(node: str, job: str, state: str, step: int, **worker: Any) -> dict[str, Any]:
    rank = int(node.lstrip("n"))
    report = {"rank": rank, "local_rank": 0, "pid": 100 + rank, "state": state, "step": step}
    return {"node": node, "state": "running", "job": job, "workers": [{**report, **worker}]}


def settings_with(make_settings: SettingsFactory, finishing_s: float) -> Any:
    return make_settings(
        heartbeat_polling_period_s=0.05,
        heartbeat_timeout_s=30,
        hang_timeout_s=HANG_S,
        hang_warmup_intervals=0,
        finishing_timeout_s=finishing_s,
    )


@pytest.fixture
async def api(make_settings: SettingsFactory) -> AsyncIterator[Api]:
    async with running(settings_with(make_settings, FINISHING_S)) as a:
        yield a


@pytest.fixture
async def patient_api(make_settings: SettingsFactory) -> AsyncIterator[Api]:
    async with running(settings_with(make_settings, PATIENT_FINISHING_S)) as a:
        yield a


async def train(api: Api, job: str, steps: int) -> None:
    for step in range(1, steps + 1):
        for node in ("n0", "n1"):
            assert (await api.beat(beat(node, job, "running", step))).status_code in (202, 204)
        await asyncio.sleep(0.02)


async def hold(api: Api, job: str, state: str, step: int, seconds: float, **worker: Any) -> None:
    """Both nodes report their worker in `state` for `seconds`, each polling period (by
    the clock: on a busy machine a period's requests take longer, and a count of periods
    would overrun the bound a test stays within)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for node in ("n0", "n1"):
            assert (await api.beat(beat(node, job, state, step, **worker))).status_code in (
                202,
                204,
            )
        await asyncio.sleep(0.05)


async def hangs(api: Api) -> list[dict[str, Any]]:
    """The hang events, waited for: on a busy machine the steps came slower, and the hang
    timeout the sensor learned from them is longer than HANG_S."""
    deadline = time.monotonic() + scaled(10)
    while not (found := (await api.get("/api/v1/events", type="hang"))["items"]):
        assert time.monotonic() < deadline, "no hang event"
        await asyncio.sleep(0.05)
    return list(found)


async def stall_until_it_hangs(api: Api, job: str, step: int) -> list[dict[str, Any]]:
    """Both nodes report their worker running at `step` until a hang event comes. Not for
    a fixed time: on a busy machine the steps of `train` came slower, the hang timeout the
    sensor learned from them is longer than HANG_S, and once the beats stop the silent
    nodes explain the stall (no hang until their heartbeat timeout)."""
    deadline = time.monotonic() + scaled(30)
    while not (found := (await api.get("/api/v1/events", type="hang"))["items"]):
        assert time.monotonic() < deadline, "no hang event"
        await hold(api, job, "running", step, 0.1)
    return list(found)


async def state_of(api: Api, job: str) -> str:
    view = await api.get(f"/api/v1/jobs/{job}")
    assert isinstance(view["state"], str)
    return view["state"]


async def test_ten_normal_finishes_in_a_row_raise_no_hang_and_take_no_action(
    patient_api: Api,
) -> None:
    """Held at their last step for several hang timeouts while finishing: not watched for
    hangs then (a stall of 4 x HANG_S while running is one: the test below)."""
    api = patient_api
    for i in range(10):
        job = f"job-{i}"
        await train(api, job, 8)
        assert await state_of(api, job) == "running"
        # Its last save and its output take several hang timeouts, at the last step.
        await hold(api, job, "finishing", 8, 4 * HANG_S)
        assert await state_of(api, job) == "finishing"
        await hold(api, job, "exited", 8, 0.1, exit_code=0)
        await api.settle()
        assert await state_of(api, job) == "finished"
        jobs = {j["name"]: j["state"] for j in await api.get("/api/v1/jobs")}
        assert jobs[job] == "finished"
    events = (await api.get("/api/v1/events", limit=1000))["items"]
    kinds = {(e["type"], e["details"].get("exit_code")) for e in events}
    assert kinds == {("worker_exited", 0)}, [
        (e["job"], e["details"]) for e in events if e["type"] == "hang"
    ]
    assert (await api.get("/api/v1/actions"))["items"] == []


@pytest.mark.parametrize(
    ("finishing_since", "exits", "expected"),
    [
        (None, [0, 0], "finished"),  # a normal end
        (5.0, [0, 0], "finished"),
        (5.0, [0, 134], "finished"),  # rank 0's output written; a rank aborted at exit
        (5.0, [None, None], "finished"),  # ended, exit codes not known (a pod)
        (None, [1, 1], "running"),  # failed: remedied
        # Said they were finishing (a worker's close() on its way out of a failure), then
        # all failed: not an end, whatever the order.
        (5.0, [1, 1], "running"),
        (5.0, [3, None], "running"),
    ],
)
def test_a_jobs_end_is_a_success_not_any_exit_after_finishing(
    finishing_since: float | None, exits: list[int | None], expected: str
) -> None:
    workers = [
        WorkerView(rank, 0, 100, WorkerState.EXITED, 8, code) for rank, code in enumerate(exits)
    ]
    assert phase(finishing_since, workers) == expected
    running = [*workers, WorkerView(9, 0, 109, WorkerState.RUNNING, 8)]
    assert phase(finishing_since, running) == (
        "running" if finishing_since is None else "finishing"
    )


async def test_a_job_that_stalls_while_running_still_hangs(api: Api) -> None:
    """The same stall with its workers still in their loop is a hang (the check above
    could not pass by hang detection being off)."""
    await train(api, "j1", 8)
    (hang,) = await stall_until_it_hangs(api, "j1", 8)
    assert hang["details"].get("kind") is None and hang["details"]["last_step"] == 8


async def test_a_worker_stuck_finishing_is_a_hang_of_its_own_kind(api: Api) -> None:
    await train(api, "j1", 8)
    await hold(api, "j1", "finishing", 8, FINISHING_S + 0.5)  # past the bound
    (hang,) = await hangs(api)
    assert hang["details"]["kind"] == "finishing", hang
    assert hang["details"]["hang_timeout_s"] == FINISHING_S
    # Not before the bound: by the sensor's own clock, whatever a busy machine did to the
    # test's holds.
    assert hang["details"]["stalled_for_s"] >= FINISHING_S, hang
    assert hang["details"]["last_step"] == 8
    assert hang["node"] == "n0" and hang["rank"] == 0


async def test_a_rank_still_at_work_past_the_ends_bound_is_a_hang(api: Api) -> None:
    """n0 finished; n1 never left its loop and stands still: not a silent end."""
    await train(api, "j1", 8)
    finishing, ended = beat("n0", "j1", "finishing", 8), beat("n0", "j1", "exited", 8, exit_code=0)
    deadline, beats = time.monotonic() + scaled(FINISHING_S + 10), 0
    while not (found := (await api.get("/api/v1/events", type="hang"))["items"]):
        assert time.monotonic() < deadline, "no hang event"
        await api.beat(finishing if beats < 5 else ended)
        await api.beat(beat("n1", "j1", "running", 8))
        await asyncio.sleep(0.05)
        beats += 1
    (hang,) = found
    assert hang["details"]["kind"] == "finishing" and (hang["node"], hang["rank"]) == ("n1", 1)
    assert await state_of(api, "j1") != "finished"


async def spare(api: Api, node: str) -> None:
    body = {"node": node, "state": "spare", "job": None, "workers": []}
    assert (await api.beat(body)).status_code in (202, 204)


async def gpu_off_the_bus(api: Api, node: str) -> list[tuple[str, str | None]]:
    """Inject an XID 79 on `node`; the actions it caused, as (type, node)."""
    body = {"kind": "xid", "node": node, "code": 79}
    response = await api.client.post("/api/v1/faults", json=body, headers=OPERATOR)
    assert response.status_code == 201, response.text
    await api.settle()
    fault = await api.get(f"/api/v1/faults/{response.json()['id']}")
    assert fault["events"], fault
    caused = [await api.get(f"/api/v1/actions/{i}") for i in fault["actions"]]
    return [(a["type"], a["node"]) for a in caused]


async def test_a_node_of_a_finished_job_that_fails_is_only_cordoned(api: Api) -> None:
    """A job that trained to its end needs no emergency checkpoint, hot-swap or scale-up
    when one of its nodes fails afterwards, even with a spare at hand: bad hardware is
    cordoned, nothing else."""
    await spare(api, "s9")
    await train(api, "j1", 8)
    await hold(api, "j1", "finishing", 8, 0.2)
    await hold(api, "j1", "exited", 8, 0.1, exit_code=0)
    await api.settle()
    assert await state_of(api, "j1") == "finished"
    assert await gpu_off_the_bus(api, "n0") == [("cordon", "n0")]
    assert await state_of(api, "j1") == "finished"
    nodes = {n["name"]: n for n in await api.get("/api/v1/nodes")}
    assert nodes["s9"]["state"] == "spare" and nodes["s9"]["job"] is None


async def test_the_same_failure_while_the_job_trains_is_remedied(api: Api) -> None:
    """The counterpart: a running job's node with a dead GPU goes to the spare."""
    await spare(api, "s9")
    await train(api, "j1", 8)
    caused = await gpu_off_the_bus(api, "n0")
    assert ("hot_swap", "n0") in caused, caused


async def test_every_host_of_a_finished_job_leaving_takes_no_action(
    make_settings: SettingsFactory,
) -> None:
    """The hosts of a job that ended exit one after the other (as `host-monitor --launch`
    does, as pods are deleted): each is lost, the job stays finished, nothing is done for
    it, even with a spare at hand, and even once no host of it is left."""
    # Lost after 2 s of silence: on a loaded machine a round of beats has taken over
    # 0.5 s (a node still beating was lost so in tests/test_incidents.py), and the hosts
    # still beating here (the spare, n0 while n1 leaves) must not be.
    settings = make_settings(heartbeat_polling_period_s=0.05, heartbeat_timeout_s=2.0)
    async with running(settings) as api:
        await train(api, "j1", 8)
        await hold(api, "j1", "exited", 8, 0.1, exit_code=0)
        await api.settle()
        assert await state_of(api, "j1") == "finished"

        def alive(node: str) -> bool:
            view = api.supervisor.sensor.node_view(node)
            return view is not None and view.alive

        # n1 leaves first, then n0; a spare keeps beating throughout.
        staying = ["n0", "n1"]
        for leaving in ("n1", "n0"):
            staying.remove(leaving)
            deadline = time.monotonic() + scaled(30)
            while alive(leaving):  # until its loss is seen
                assert time.monotonic() < deadline, f"{leaving} was never lost"
                for node in staying:
                    await api.beat(beat(node, "j1", "exited", 8, exit_code=0))
                await spare(api, "s9")
                await asyncio.sleep(0.05)
        await api.settle()
        lost = (await api.get("/api/v1/events", type="host_heartbeat_lost"))["items"]
        assert {e["node"] for e in lost} == {"n0", "n1"}, lost
        assert (await api.get("/api/v1/actions"))["items"] == []
        assert await state_of(api, "j1") == "finished"
