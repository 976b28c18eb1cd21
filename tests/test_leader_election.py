"""Leader election over a coordination.k8s.io/v1 Lease (supervisor/kube/leader.py).

Through the real `kubernetes` client over HTTP against the fake API server (tests/kube),
for what the real one cannot be made to do on demand: a 409 on one chosen write, an API
that hangs or fails, and the runtime and processes built on those. The rounds a real API
server answers (creation, renewal, takeover, races, release) are in
tests/test_leader_election_real.py. The elector tests drive single rounds with a
hand-moved monotonic clock; the end-to-end tests run two `supervisor serve` processes
sharing one SQLite database (harness in bench/failover.py) and SIGKILL the leader.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from bench.failover import (
    AGENT,
    KUBE_TOKEN,
    LEASE,
    NAMESPACE,
    OPERATOR,
    Replica,
    Timing,
    actions,
    heartbeat,
    inject_xids,
    pair,
    query,
    register,
    write_kubeconfig,
)
from supervisor.config import Settings
from supervisor.kube.leader import (
    EXIT_LEADERSHIP_LOST,
    ElectionConfig,
    LeaderElector,
    Leadership,
    LeadershipLost,
    micro_time,
)
from supervisor.runtime import Supervisor
from tests.conftest import SettingsFactory
from tests.kube import FakeKube
from tests.timing import scaled, wait_until_async

# What the server's MicroTime parser takes: six fractional digits, always (client 37
# sends UTC as +00:00).
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|\+00:00)$")
LEASE_PATH = rf"/namespaces/{NAMESPACE}/leases"


class Clock:
    """A monotonic clock moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(token=KUBE_TOKEN, tick=0.5) as fake:
        yield fake


@pytest.fixture
def api(kube: FakeKube) -> Iterator[client.CoordinationV1Api]:
    with kube.client() as api_client:
        yield client.CoordinationV1Api(api_client)


ElectorFactory = Callable[..., LeaderElector]


@pytest.fixture
def elector(api: client.CoordinationV1Api) -> ElectorFactory:
    def build(
        identity: str,
        clock: Callable[[], float] = time.monotonic,
        *,
        duration: float = 2.0,
        deadline: float = 1.0,
        retry: float = 0.1,
    ) -> LeaderElector:
        config = ElectionConfig(LEASE, NAMESPACE, identity, duration, deadline, retry)
        return LeaderElector(api, config, clock=clock)

    return build


def spec(kube: FakeKube) -> dict[str, Any]:
    lease = kube.get("Lease", LEASE, NAMESPACE)
    assert lease is not None
    return dict(lease["spec"])


def test_lease_times_always_have_six_fractional_digits() -> None:
    whole_second = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert micro_time(whole_second) == "2026-01-02T03:04:05.000001Z"
    # What the client makes of it on the wire (it re-serialises through its models).
    sent = client.ApiClient().sanitize_for_serialization(
        client.V1LeaseSpec(renew_time=datetime.fromisoformat(micro_time(whole_second)))
    )
    assert MICRO_TIME.match(sent["renewTime"])


# --- one round at a time -------------------------------------------------------------------


async def test_a_409_on_the_write_loses_the_round(kube: FakeKube, elector: ElectorFactory) -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    clock.advance(2.0)
    conflict = kube.fail_next("update", LEASE_PATH, status=409)
    assert not await b.try_acquire_or_renew()
    assert conflict.hits == 1 and not b.is_leader
    assert spec(kube)["holderIdentity"] == "a"


async def test_leader_that_cannot_renew_stops_within_the_renew_deadline(
    kube: FakeKube, elector: ElectorFactory
) -> None:
    a = elector("a", duration=3.0, deadline=1.0, retry=0.1)
    # The deadline runs from the start of the last renewal, somewhere within this call
    # (timed from its end, a slow call under load made the loss look 0.4 s early).
    before = time.monotonic()
    assert await a.try_acquire_or_renew()
    call_s = time.monotonic() - before
    kube.fail_next("*", LEASE_PATH, status=500, times=1000)
    with pytest.raises(LeadershipLost, match="within 1 s"):
        await a.hold()
    lost_after = time.monotonic() - before
    # Never later than the deadline (plus scheduling), and not at the first error.
    assert 0.99 <= lost_after < call_s + 1.0 + 1.5


async def test_the_fence_closes_at_the_renew_deadline_of_the_last_renewal(
    kube: FakeKube, elector: ElectorFactory
) -> None:
    """`check` lets a replica act only while its last renewal started less than the
    renew deadline ago: a replica frozen past it cannot know whether the Lease is still
    its own, so it may not act, even before its renewal loop has run."""
    clock = Clock()
    a = elector("a", clock, duration=2.0, deadline=1.0)
    with pytest.raises(LeadershipLost, match="does not hold"):
        a.check()
    assert await a.try_acquire_or_renew()
    clock.advance(0.99)
    a.check()
    clock.advance(0.02)
    with pytest.raises(LeadershipLost, match=r"1\.0 s ago, past the renew deadline"):
        a.check()
    # A renewal opens it again.
    assert await a.try_acquire_or_renew()
    a.check()


async def test_leader_with_a_hanging_api_stops_within_the_renew_deadline(
    kube: FakeKube, elector: ElectorFactory
) -> None:
    a = elector("a", duration=3.0, deadline=1.0, retry=0.1)
    assert await a.try_acquire_or_renew()
    renewed = time.monotonic()
    kube.fail_next("get", LEASE_PATH, status=None, delay=3)
    with pytest.raises(LeadershipLost, match="too slow"):
        await a.hold()
    assert time.monotonic() - renewed < 1.0 + 1.5


@pytest.mark.parametrize("status", [500, 409])
async def test_a_transient_api_error_does_not_cost_the_lease(
    kube: FakeKube, elector: ElectorFactory, status: int
) -> None:
    """A 500, or a 409 from a write that left us the holder (someone edited a label),
    loses a round, not the Lease: the next read shows it is still ours, and the next
    renewal goes through."""
    # A renew deadline of 3 s: the two refused writes and the renewal after them took
    # more than 1 s on two cores beside two CPU burners, which is a loss by the deadline,
    # not by the errors this test is about.
    a = elector("a", duration=6.0, deadline=3.0, retry=0.1)
    assert await a.try_acquire_or_renew()
    renewed = spec(kube)["renewTime"]
    fault = kube.fail_next("update", LEASE_PATH, status=status, times=2)
    holding = asyncio.create_task(a.hold())
    await wait_until_async(
        lambda: holding.done() or (fault.hits == 2 and spec(kube)["renewTime"] != renewed),
        "the renewal after two refused writes",
        10,
    )
    assert not holding.done() and a.is_leader
    holding.cancel()
    assert spec(kube)["holderIdentity"] == "a"


# --- the runtime follows the Lease (in process) ---------------------------------------------


async def test_only_the_lease_holder_runs_the_supervisor(
    kube: FakeKube, make_settings: SettingsFactory, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", kube.url, KUBE_TOKEN)

    def settings(identity: str) -> Settings:
        return make_settings(
            leader_election=True,
            leader_election_identity=identity,
            # Both replicas share this test's event loop, where a runtime's start-up (its
            # database, its migrations) holds it for a while on a loaded machine: a renew
            # deadline shorter than that loses the Lease to "API too slow", not the thief.
            leader_election_lease_duration_s=scaled(3.0),
            leader_election_renew_deadline_s=scaled(2.0),
            leader_election_retry_period_s=0.1,
            kube_config=str(kubeconfig),
        )

    lost: dict[str, str] = {}
    replicas: dict[str, tuple[Supervisor, Leadership]] = {}
    for identity in ("a", "b"):
        runtime = Supervisor(settings(identity))
        leadership = Leadership(
            settings(identity), runtime, on_lost=lambda why, i=identity: lost.setdefault(i, why)
        )
        replicas[identity] = (runtime, leadership)
        await leadership.start()

    async def until(predicate: Callable[[], bool], within: float = 15.0) -> None:
        deadline = time.monotonic() + scaled(within)
        while not predicate():
            assert time.monotonic() < deadline, "condition not met in time"
            await asyncio.sleep(0.02)

    try:
        await until(lambda: sum(r.ready for r, _ in replicas.values()) == 1)
        leader = next(i for i, (r, _) in replicas.items() if r.ready)
        standby = "b" if leader == "a" else "a"
        await until(lambda: replicas[standby][0].readiness.get("leader") == leader)
        waiting = replicas[standby][0]
        assert waiting.readiness["status"] == "standby"
        assert waiting.readiness["identity"] == standby
        assert waiting.metrics.registry.get_sample_value("supervisor_leader") == 0
        assert replicas[leader][0].metrics.registry.get_sample_value("supervisor_leader") == 1
        with pytest.raises(RuntimeError, match="not started"):
            _ = waiting.store  # the standby never opened the database
        # Someone takes the Lease: the leader stops acting; the standby keeps waiting
        # (the thief holds it now).
        kube.patch("Lease", LEASE, {"spec": {"holderIdentity": "thief"}}, NAMESPACE)
        await until(lambda: leader in lost)
        assert "thief" in lost[leader]
        assert not replicas[leader][0].ready
        assert replicas[leader][0].readiness["status"] == "lost leadership"
        assert not waiting.ready
        # The thief never renews: once its record has been still for a lease duration,
        # the standby takes over and starts.
        await until(lambda: waiting.ready)
        assert spec(kube)["holderIdentity"] == standby
        assert spec(kube)["leaseTransitions"] == 1
    finally:
        for _, leadership in replicas.values():
            await leadership.stop()


# --- two real processes ------------------------------------------------------------------


#: The Lease's periods, scaled with the machine's margins: at 1.5 s to renew, a leader of
#: the loaded suite gave up its lead before the test's first step (the API too slow).
TIMING = Timing(lease_duration_s=scaled(2.0), renew_deadline_s=scaled(1.5), retry_period_s=0.25)
#: A replica's start (its imports) and the first election: under two CPU burners beside
#: the suite a replica printed nothing within the bench's unscaled 30 s.
START_S = scaled(30)


#: A policy that takes a while over each decision, as a real one may: with 8 events, some
#: are always in flight when the leader is killed right after acknowledging them (a quick
#: machine otherwise decides and acts on all of them before the kill lands).
SLOW_POLICY = """
import time

from policies.default import DefaultPolicy


class SlowPolicy(DefaultPolicy):
    def event_policy(self, event, context):
        time.sleep(0.1)
        return super().event_policy(event, context)
"""


async def test_failover_after_sigkill_does_every_action_exactly_once(tmp_path: Path) -> None:
    policy = tmp_path / "slow_policy.py"
    policy.write_text(SLOW_POLICY)
    env = {"SUPERVISOR_POLICY": f"{policy}:SlowPolicy"}
    with pair(tmp_path, TIMING, env=env, start_timeout_s=START_S) as cluster:
        leader, standby = cluster.wait_leader(START_S)
        status, body = standby.readyz()
        assert status == 503
        assert body["status"] == "standby" and body["leader"] == leader.identity
        assert leader.identity in body["detail"]
        lease = cluster.lease()
        assert lease is not None and lease["spec"]["holderIdentity"] == leader.identity

        async with httpx.AsyncClient(timeout=10) as http:
            # A standby refuses heartbeats and API calls, saying who leads; nothing is
            # recorded there.
            r = await http.post(
                f"{standby.url}/api/v1/heartbeats", json=heartbeat("n1", "j1"), headers=AGENT
            )
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["leader"] == leader.identity
            r = await http.get(f"{standby.url}/api/v1/actions", headers=OPERATOR)
            assert r.status_code == 503 and "standby" in r.json()["detail"]
            r = await http.get(f"{standby.url}/metrics")
            assert "supervisor_leader 0.0" in r.text
            r = await http.get(f"{leader.url}/metrics")
            assert "supervisor_leader 1.0" in r.text

        await register(leader, {"n1": "j1", "n2": "j1"})
        acknowledged = await inject_xids(leader, ["n1", "n2"], [13, 31, 43, 48])
        killed = time.monotonic()
        leader.kill()  # at once: the policy's decisions and actions are in flight
        unhandled, unfinished = cluster.in_flight()
        assert len(acknowledged) == 8
        finished = (
            "SELECT id, status, attempts, finished_at, result FROM actions "
            "WHERE status NOT IN ('pending', 'running') ORDER BY id"
        )
        finished_before = query(cluster.db, finished)
        # Nothing was done by the standby while the leader lived.
        assert "supervisor ready" not in standby.log_text()
        assert "dry run: would" not in standby.log_text()

        deadline = time.monotonic() + TIMING.lease_duration_s + TIMING.retry_period_s + 20
        while standby.readyz()[0] != 200:
            assert time.monotonic() < deadline, standby.log_text()
            await asyncio.sleep(0.02)
        failover_s = time.monotonic() - killed
        # It waited for the Lease to expire (it cannot know the leader died): at least
        # lease_duration - renew_deadline, as the leader renewed within its deadline; and
        # about a lease duration, plus a retry period and the start (generous bound).
        assert TIMING.lease_duration_s - TIMING.renew_deadline_s < failover_s
        assert failover_s < TIMING.lease_duration_s + TIMING.retry_period_s + 10
        lease = cluster.lease()
        assert lease is not None and lease["spec"]["holderIdentity"] == standby.identity
        assert lease["spec"]["leaseTransitions"] == 1

        deadline = time.monotonic() + 30
        while any(cluster.in_flight()):
            assert time.monotonic() < deadline, standby.log_text()
            await asyncio.sleep(0.05)
        items = actions(standby)
        events = query(cluster.db, "SELECT id, type FROM events ORDER BY id")
        finished_after = query(cluster.db, finished)

    # Every acknowledged event is there once and was handled (by one replica or the other).
    assert sorted(e for e, t in events if t == "gpu_xid") == sorted(acknowledged)
    assert len(events) == len(acknowledged)
    keys = [a["idempotency_key"] for a in items]
    assert len(keys) == len(set(keys)) and items
    assert all(a["status"] == "succeeded" for a in items)
    # What the old leader finished, the new one left alone ...
    assert set(finished_before) <= set(finished_after)
    done_before = {row[0] for row in finished_before}
    # ... and it ran only what was unfinished at the kill, or decided for events that
    # were unhandled then: each action once more at most (an interrupted attempt is
    # repeated with the same idempotency key).
    resumed = [a for a in items if a["id"] not in done_before]
    assert all(a["id"] in unfinished or a["event_id"] in unhandled for a in resumed)
    assert all(a["attempts"] <= 2 for a in items)
    assert unhandled or unfinished, "nothing was in flight at the kill: the test proved little"
    # The new leader's own account: one backend call per resumed action, and none for
    # an action the old leader had finished.
    new_leader_log = standby.log_text()
    assert new_leader_log.count("dry run: would") == len(resumed)
    for action in items:
        mentioned = f"action {action['id']} {action['type']} " in new_leader_log
        assert mentioned == (action["id"] not in done_before)


FREEZING_POLICY = """
import time
from pathlib import Path

from policies.default import DefaultPolicy

MARKER = Path(__file__).with_name("freeze-next-decision")


class FreezingPolicy(DefaultPolicy):
    \"\"\"The default policy, except that the first decision after MARKER appears first
    blocks the whole process for FREEZE_S, as SIGSTOP, a paused VM or a long GC would.\"\"\"

    def event_policy(self, event, context):
        try:
            MARKER.unlink()
        except FileNotFoundError:
            pass
        else:
            time.sleep(FREEZE_S)
        return super().event_policy(event, context)
"""


async def test_a_leader_frozen_past_its_lease_steps_down_without_acting(tmp_path: Path) -> None:
    """The leader freezes while deciding on an event, for longer than the Lease lasts; the
    standby takes over meanwhile. When the old leader wakes, with its decision made, the
    fence is closed: it records nothing, runs nothing and exits; the new leader decides
    on the event and acts, once."""
    freeze_s = 3 * TIMING.lease_duration_s
    policy = tmp_path / "freezing_policy.py"
    policy.write_text(FREEZING_POLICY.replace("FREEZE_S", str(freeze_s)))
    env = {"SUPERVISOR_POLICY": f"{policy}:FreezingPolicy"}
    with pair(tmp_path, TIMING, env=env, start_timeout_s=START_S) as cluster:
        leader, standby = cluster.wait_leader(START_S)
        await register(leader, {"n1": "j1"})
        (tmp_path / "freeze-next-decision").touch()
        (event,) = await inject_xids(leader, ["n1"], [79])
        frozen = time.monotonic()

        deadline = frozen + freeze_s
        while standby.readyz()[0] != 200:
            assert time.monotonic() < deadline, standby.log_text()
            await asyncio.sleep(0.02)
        assert leader.running, "the old leader must still be frozen: the test proves little"

        assert leader.wait_exit(freeze_s + 10) == EXIT_LEADERSHIP_LOST
        old_log = leader.log_text()
        assert "was this replica frozen?" in old_log, old_log
        decided = f"event {event} gpu_xid node=n1"
        assert decided not in old_log and "dry run: would" not in old_log, old_log

        deadline = time.monotonic() + 30
        while any(cluster.in_flight()):
            assert time.monotonic() < deadline, standby.log_text()
            await asyncio.sleep(0.05)
        items = actions(standby)
        assert items and all(a["event_id"] == event for a in items), items
        assert all(a["status"] == "succeeded" and a["attempts"] == 1 for a in items), items
        new_log = standby.log_text()
        assert new_log.count(decided) == 1
        assert new_log.count("dry run: would") == len(items)


def test_a_stopped_leader_hands_over_by_releasing_the_lease(tmp_path: Path) -> None:
    with pair(tmp_path, TIMING, start_timeout_s=START_S) as cluster:
        leader, standby = cluster.wait_leader(START_S)
        leader.stop()  # SIGTERM, as in a rolling update
        # uvicorn re-raises the signal after its graceful shutdown
        assert leader.wait_exit(5) in (0, -signal.SIGTERM)
        assert "released Lease" in leader.log_text()
        deadline = time.monotonic() + 20
        while standby.readyz()[0] != 200:
            assert time.monotonic() < deadline, standby.log_text()
            time.sleep(0.02)
        lease = cluster.lease()
        assert lease is not None and lease["spec"]["holderIdentity"] == standby.identity
        assert lease["spec"]["leaseTransitions"] == 1


@pytest.mark.parametrize("how", ["stolen", "deleted", "unreachable"])
def test_a_leader_that_loses_the_lease_exits(tmp_path: Path, how: str) -> None:
    with pair(tmp_path, TIMING, ("a",), start_timeout_s=START_S) as cluster:
        (leader,) = cluster.replicas
        deadline = time.monotonic() + 30
        while leader.readyz()[0] != 200:
            assert time.monotonic() < deadline, leader.log_text()
            time.sleep(0.05)
        if how == "stolen":
            cluster.kube.patch("Lease", LEASE, {"spec": {"holderIdentity": "thief"}}, NAMESPACE)
        elif how == "deleted":
            cluster.kube.delete("Lease", LEASE, NAMESPACE)
        else:  # the API server answers nothing but errors
            cluster.kube.fail_next("*", LEASE_PATH, status=500, times=100_000)
        taken = time.monotonic()
        assert leader.wait_exit(TIMING.renew_deadline_s + 10) == EXIT_LEADERSHIP_LOST
        # Noticed at the next renewal, or at the renew deadline (generous bound).
        assert time.monotonic() - taken < TIMING.renew_deadline_s + 5
        log = leader.log_text()
        assert "lost leadership" in log
        assert ("could not renew" if how == "unreachable" else "Lease default/") in log


def test_leader_election_without_kubernetes_config_stops_with_one_line(
    tmp_path: Path,
) -> None:
    replica = Replica("a", tmp_path, tmp_path / "missing-kubeconfig", TIMING)
    with pytest.raises(RuntimeError, match="exited"):
        replica.start(START_S)
    lines = replica.log_text().strip().splitlines()
    assert lines[-1].startswith("supervisor: leader election: cannot load Kubernetes")
    assert replica.wait_exit(5) != 0
