"""Leader election (supervisor/kube/leader.py) on a real coordination.k8s.io/v1 Lease: the
real API server's optimistic concurrency (a stale write answered 409), its MicroTime
parsing and its validation, with the chart's ServiceAccount token, whose Role grants
`create` on Leases and `get`/`update` on the chart's Lease name only.

The rounds run with a hand-moved monotonic clock, as in tests/test_leader_election.py (and two
`supervisor serve` replicas, one of them killed, at the end);
what the real server cannot be made to do on demand (a 409 on one chosen write, a
hanging or failing API) stays there, on the fake server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from bench.failover import Replica, Timing
from supervisor.kube.leader import ElectionConfig, LeaderElector, LeadershipLost
from tests.chart_rbac import chart_identity
from tests.control_plane import ControlPlane
from tests.kube_real import get
from tests.test_helm_chart import DEFAULT_VALUES
from tests.test_leader_election import MICRO_TIME, Clock
from tests.timing import scaled, wait_until

NAMESPACE = "default"
LEASE = DEFAULT_VALUES["config"]["leader_election_lease_name"]
LEASE_URL = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{LEASE}"

ElectorFactory = Callable[..., LeaderElector]


@pytest.fixture(scope="module")
def api(control_plane: ControlPlane) -> Iterator[client.CoordinationV1Api]:
    who = chart_identity(control_plane, NAMESPACE)
    built = config.new_client_from_config(config_file=str(who.kubeconfig))  # type: ignore[no-untyped-call]
    with built as api_client:
        yield client.CoordinationV1Api(api_client)


@pytest.fixture
def lease(control_plane: ControlPlane) -> Iterator[Callable[[], dict[str, Any] | None]]:
    """The Lease as the API server has it (None when there is none); none at the start
    and at the end of each test, which all use the chart's one name."""

    def read() -> dict[str, Any] | None:
        return get(control_plane, LEASE_URL)

    def delete() -> None:
        with control_plane.client() as admin:
            assert admin.delete(LEASE_URL).status_code in (200, 404)

    delete()
    yield read
    delete()


@pytest.fixture
def elector(api: client.CoordinationV1Api) -> ElectorFactory:
    def build(identity: str, clock: Callable[[], float] | None = None) -> LeaderElector:
        settings = ElectionConfig(LEASE, NAMESPACE, identity, 2.0, 1.0, 0.1)
        return LeaderElector(api, settings, clock=clock or Clock())

    return build


def spec(lease: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
    found = lease()
    assert found is not None, "no Lease"
    return dict(found["spec"])


async def test_the_first_candidate_creates_the_lease_and_renews_it(
    elector: ElectorFactory, lease: Callable[[], dict[str, Any] | None]
) -> None:
    a, b = elector("a"), elector("b")
    assert await a.try_acquire_or_renew()
    assert a.is_leader and a.leader == "a"
    first = spec(lease)
    assert first["holderIdentity"] == "a" and first["leaseDurationSeconds"] == 2
    assert first.get("leaseTransitions", 0) == 0
    # The server parsed and gave back MicroTimes of six fractional digits.
    assert MICRO_TIME.match(first["acquireTime"]) and MICRO_TIME.match(first["renewTime"])
    assert not await b.try_acquire_or_renew()
    assert not b.is_leader and b.leader == "a"
    await asyncio.sleep(0.01)
    assert await a.try_acquire_or_renew()
    second = spec(lease)
    assert second["renewTime"] > first["renewTime"]
    assert second["acquireTime"] == first["acquireTime"]


async def test_a_standby_takes_over_a_silent_lease_and_the_old_leader_learns_it(
    elector: ElectorFactory, lease: Callable[[], dict[str, Any] | None]
) -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    clock.advance(1.9)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    clock.advance(2.1)  # a has not renewed for 2 s, as far as b has seen
    assert await b.try_acquire_or_renew()
    taken = spec(lease)
    assert taken["holderIdentity"] == "b" and taken["leaseTransitions"] == 1
    with pytest.raises(LeadershipLost, match="held by 'b'"):
        await a.try_acquire_or_renew()
    assert not a.is_leader


async def test_expiry_is_judged_by_own_observation_not_by_renew_time(
    control_plane: ControlPlane,
    elector: ElectorFactory,
    lease: Callable[[], dict[str, Any] | None],
) -> None:
    """A Lease renewed by a clock 26 years behind: a standby still waits a whole lease
    duration of silence."""
    control_plane.apply(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": LEASE, "namespace": NAMESPACE},
            "spec": {
                "holderIdentity": "x",
                "leaseDurationSeconds": 2,
                "acquireTime": "2000-01-01T00:00:00.000000Z",
                "renewTime": "2000-01-01T00:00:00.000000Z",
                "leaseTransitions": 4,
            },
        }
    )
    clock = Clock()
    b = elector("b", clock)
    assert not await b.try_acquire_or_renew()
    clock.advance(1.5)
    assert not await b.try_acquire_or_renew()
    clock.advance(0.5)
    assert await b.try_acquire_or_renew()
    assert spec(lease)["leaseTransitions"] == 5


async def test_of_candidates_racing_for_the_lease_the_server_lets_one_win(
    elector: ElectorFactory, lease: Callable[[], dict[str, Any] | None]
) -> None:
    """Five create at once (one 201, the rest 409 AlreadyExists); once the winner is
    silent, the four write the same resourceVersion at once (one 200, the rest 409)."""
    clock = Clock()
    candidates = [elector(name, clock) for name in "abcde"]
    won = await asyncio.gather(*(c.try_acquire_or_renew() for c in candidates))
    assert sum(won) == 1
    winner = candidates[won.index(True)]
    assert spec(lease)["holderIdentity"] == winner.identity
    rest = [c for c in candidates if c is not winner]
    assert not any(await asyncio.gather(*(c.try_acquire_or_renew() for c in rest)))
    clock.advance(2.0)
    won = await asyncio.gather(*(c.try_acquire_or_renew() for c in rest))
    assert sum(won) == 1
    assert spec(lease)["holderIdentity"] == rest[won.index(True)].identity
    assert spec(lease)["leaseTransitions"] == 1


@pytest.mark.parametrize("how", ["stolen", "deleted", "cleared"])
async def test_a_leader_loses_when_the_lease_is_taken(
    control_plane: ControlPlane,
    elector: ElectorFactory,
    lease: Callable[[], dict[str, Any] | None],
    how: str,
) -> None:
    a = elector("a")
    assert await a.try_acquire_or_renew()
    with control_plane.client() as admin:
        if how == "deleted":
            assert admin.delete(LEASE_URL).status_code == 200
        else:
            r = admin.patch(
                LEASE_URL,
                json={"spec": {"holderIdentity": "thief" if how == "stolen" else None}},
                headers={"Content-Type": "application/merge-patch+json"},
            )
            assert r.status_code == 200, r.text
    with pytest.raises(LeadershipLost, match="deleted" if how == "deleted" else "now held by"):
        await a.hold()
    assert not a.is_leader
    if how == "deleted":  # and it did not quietly create a new one
        assert lease() is None


async def test_a_release_lets_a_standby_take_over_at_once(
    elector: ElectorFactory, lease: Callable[[], dict[str, Any] | None]
) -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    await a.release()
    released = spec(lease)
    assert released.get("holderIdentity") is None and released["leaseDurationSeconds"] == 1
    assert await b.try_acquire_or_renew()  # no waiting: the clock did not move
    assert spec(lease)["leaseTransitions"] == 1


async def test_the_same_identity_after_a_restart_continues_its_term(
    elector: ElectorFactory, lease: Callable[[], dict[str, Any] | None]
) -> None:
    """A restarted container of the same pod (same identity) need not wait for its own
    Lease to expire: its previous process is gone."""
    assert await elector("a").try_acquire_or_renew()
    acquired = spec(lease)["acquireTime"]
    assert await elector("a").try_acquire_or_renew()
    again = spec(lease)
    assert again["acquireTime"] == acquired and again.get("leaseTransitions", 0) == 0


# --- two `supervisor serve` replicas ------------------------------------------------------

#: The bench's timings (a 2 s lease renewed every 0.25 s) with the lease's margins scaled:
#: beside the suite's other session a leader's renewal can take over a second, and a leader
#: that misses its deadline steps down, so that the replica called the standby may be the
#: one starting to lead.
LOADED_TIMING = Timing(
    lease_duration_s=scaled(2.0), renew_deadline_s=scaled(1.5), retry_period_s=0.25
)


def answer(replica: Replica) -> tuple[int, dict[str, Any]] | None:
    """`replica`'s /readyz once it answers at all (a loaded machine can take past the
    client's 2 s to)."""
    status, body = replica.readyz()
    return (status, body) if status else None


def test_of_two_replicas_on_a_real_lease_the_standby_leads_once_the_leader_is_killed(
    control_plane: ControlPlane, lease: Callable[[], dict[str, Any] | None], tmp_path: Path
) -> None:
    """Two `supervisor serve` processes (the dry-run backend, one SQLite database) elect a
    leader on the real Lease with the chart's ServiceAccount token; the standby answers
    503 naming it. The leader is SIGKILLed: the standby takes the Lease once it has been
    silent a lease duration, and serves."""
    who = chart_identity(control_plane, NAMESPACE)
    replicas = [Replica(name, tmp_path, who.kubeconfig, LOADED_TIMING) for name in ("a", "b")]
    try:
        for replica in replicas:
            replica.start(scaled(60))

        def single_leader() -> Replica | None:
            ready = [r for r in replicas if r.running and r.readyz()[0] == 200]
            return ready[0] if len(ready) == 1 else None

        leader = wait_until(single_leader, "one leader", 30)
        standby = next(r for r in replicas if r is not leader)
        status, body = wait_until(lambda: answer(standby), "the standby answering", 10)
        assert status == 503 and body["leader"] == leader.identity, body
        assert spec(lease)["holderIdentity"] == leader.identity

        leader.kill()
        wait_until(lambda: standby.readyz()[0] == 200, "the standby leading", 30)
        taken = spec(lease)
        assert taken["holderIdentity"] == standby.identity, taken
        assert taken["leaseTransitions"] >= 1, taken
    except AssertionError as failed:
        for replica in replicas:
            failed.add_note(f"--- replica {replica.identity}'s log:\n{replica.log_text()[-6000:]}")
        raise
    finally:
        for replica in replicas:
            replica.close()
