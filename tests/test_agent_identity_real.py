"""Host monitors' Kubernetes service account tokens (agent_auth kubernetes) on the real
control plane (tests/control_plane.py): bound tokens the real API server issues
(TokenRequest, bound to a pod on a node, for the supervisor's audience) and reviews
(TokenReview, whose `user.extra` names the pod's node), the supervisor holding the
chart's RBAC as `hostMonitor.identity.mode: kubernetes` renders it.

The supervisor reaches the API server through a proxy of the test (tests/kube_proxy.py)
that counts its TokenReviews and stands in for an API server that cannot answer (503)
or answers late: the real one cannot be made to on demand.

Each test keeps to nodes and pods of its own (named after a tag of the test), so that
the tests share the session's control plane.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from resiliency_protocol.heartbeat_batch import encode_batch
from supervisor.config import Settings
from tests.chart_rbac import chart_identity_without
from tests.conftest import SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.kube_proxy import Fault, KubeProxy
from tests.kube_real import pool_nodes
from tests.test_agent_identity import bearer, checkpoint, refused
from tests.test_api import heartbeat, running
from tests.test_helm_chart import FULLNAME, KUBE_IDENTITY, NAMESPACE, render
from tests.test_host_monitor import Cluster, wait_for
from tests.test_host_monitor import Supervisor as SupervisorProcess
from tests.timing import scaled

#: The chart's host monitors: their ServiceAccount, and the audience their tokens carry.
HOST_MONITOR = f"{FULLNAME}-host-monitor"
HOST_MONITOR_USER = f"system:serviceaccount:{NAMESPACE}:{HOST_MONITOR}"
AUDIENCE = "resiliency-supervisor"
#: The chart's heartbeat relays: their ServiceAccount, whose tokens carry batches only.
RELAY = f"{FULLNAME}-heartbeat-relay"
RELAY_USER = f"system:serviceaccount:{NAMESPACE}:{RELAY}"
#: A ServiceAccount of the namespace that is not the host monitors'.
OTHER = "not-a-host-monitor"
REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
tags = itertools.count()


@pytest.fixture(scope="module")
def reviewer(control_plane: ControlPlane) -> Identity:
    """The supervisor's identity: a ServiceAccount of its own holding the chart's RBAC
    with Kubernetes identity on (TokenReview create), and the chart's host monitor
    ServiceAccount beside another one."""
    who = chart_identity_without(
        control_plane, "none", "none", name=f"{FULLNAME}-identity", values=KUBE_IDENTITY
    )
    for account in render(KUBE_IDENTITY):
        if account["kind"] == "ServiceAccount" and account["metadata"]["name"] in (
            HOST_MONITOR,
            RELAY,
        ):
            control_plane.apply(account)
    control_plane.apply(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": OTHER, "namespace": NAMESPACE},
        }
    )
    return who


@dataclass
class Tokens:
    """Two nodes of the test, a host monitor's pod on each, a pod of another
    ServiceAccount and a heartbeat relay's pod on the second; tokens the API server issues
    for them."""

    plane: ControlPlane
    proxy: KubeProxy
    kubeconfig: Path
    nodes: list[str]
    pods: dict[str, str]  # pod name: its node

    def token(self, pod: str | None, account: str = HOST_MONITOR, audience: str = AUDIENCE) -> str:
        """A token of `account` for `audience` (TokenRequest), bound to `pod` if given,
        as the kubelet asks for a pod's projected token."""
        spec: dict[str, Any] = {"audiences": [audience], "expirationSeconds": 600}
        with self.plane.client() as api:
            if pod is not None:
                found = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
                assert found.status_code == 200, found.text
                uid = found.json()["metadata"]["uid"]
                spec["boundObjectRef"] = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod,
                    "uid": uid,
                }
            r = api.post(
                f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{account}/token",
                json={
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "TokenRequest",
                    "spec": spec,
                },
            )
        assert r.status_code == 201, r.text
        token: str = r.json()["status"]["token"]
        return token

    def reviews(self) -> int:
        """The TokenReviews the supervisor sent."""
        return self.proxy.count("POST", REVIEWS)

    def delete_pod(self, pod: str) -> None:
        with self.plane.client() as api:
            r = api.delete(
                f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}", params={"gracePeriodSeconds": 0}
            )
        assert r.status_code in (200, 404), r.text


@pytest.fixture
def tokens(control_plane: ControlPlane, reviewer: Identity, tmp_path: Path) -> Iterator[Tokens]:
    tag = f"ident{next(tags)}"
    nodes = pool_nodes(control_plane, tag, 2)
    pods = {
        f"{tag}-hm-0": nodes[0],
        f"{tag}-hm-1": nodes[1],
        f"{tag}-other-1": nodes[1],
        f"{tag}-relay-1": nodes[1],
    }
    accounts = {"-other-": OTHER, "-relay-": RELAY}
    for pod, node in pods.items():
        control_plane.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod, "namespace": NAMESPACE},
                "spec": {
                    "serviceAccountName": next(
                        (sa for part, sa in accounts.items() if part in pod), HOST_MONITOR
                    ),
                    "nodeName": node,
                    "containers": [{"name": "host-monitor", "image": "host-monitor:1"}],
                },
            }
        )
    with KubeProxy(control_plane) as proxy:
        kubeconfig = proxy.kubeconfig(reviewer, tmp_path / "kubeconfig")
        found = Tokens(control_plane, proxy, kubeconfig, nodes, pods)
        try:
            yield found
        finally:
            for pod in pods:
                found.delete_pod(pod)
            with control_plane.client() as api:
                for node in nodes:
                    api.delete(f"/api/v1/nodes/{node}")


def kube_settings(make_settings: SettingsFactory, tokens: Tokens, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "agent_auth": ["kubernetes"],
        "kube_config": str(tokens.kubeconfig),
        "agent_kube_service_account": HOST_MONITOR_USER,
        "heartbeat_timeout_s": 30,
        "heartbeat_polling_period_s": 5,
        **overrides,
    }
    return make_settings(**values)


async def test_a_service_account_token_speaks_for_the_node_of_its_pod(
    make_settings: SettingsFactory, tokens: Tokens
) -> None:
    (hm0, hm1, other1, _relay1), (n0, n1) = tokens.pods, tokens.nodes
    async with running(kube_settings(make_settings, tokens)) as api:
        token = tokens.token(hm0)
        for _ in range(3):
            r = await api.beat(heartbeat(n0, job=None), headers=bearer(token))
            assert r.status_code in (202, 204), r.text
        assert tokens.reviews() == 1  # reviewed once, then taken from the cache
        # The node comes from the review, not from what the body says.
        r = await api.beat(heartbeat(n1, job=None), headers=bearer(token))
        assert r.status_code == 403
        assert r.json()["message"] == f"node: '{n1}' is not the node of this credential ('{n0}')"
        assert not api.supervisor.sensor.has_node(n1)
        r = await api.client.post(
            "/api/v1/checkpoints", json={"reports": [checkpoint(n1, "c")]}, headers=bearer(token)
        )
        assert r.status_code == 403

        wrong = {
            "another audience": tokens.token(hm1, audience="https://kubernetes.default.svc"),
            "another service account": tokens.token(other1, account=OTHER),
            "no pod, so no node": tokens.token(None),
            "not a token at all": "a.b.c",
        }
        for why, bad in wrong.items():
            r = await api.beat(heartbeat(n1, job=None), headers=bearer(bad))
            assert r.status_code == 401, why
        assert not api.supervisor.sensor.has_node(n1)
        assert tokens.reviews() == 1 + len(wrong)
        assert (await refused(api)) == {
            "invalid_credential": len(wrong),
            "other_node": 2,
            "rank_claimed": 0,
        }


async def test_a_relays_token_carries_the_nodes_own_heartbeats_and_speaks_for_no_node(
    make_settings: SettingsFactory, tokens: Tokens
) -> None:
    """The chart's relays present their own ServiceAccount's token (bound to their pod):
    the supervisor takes it as the carrier of a batch, each entry taken with its node's own
    token, and for nothing else: not as a heartbeat of the node the relay runs on, not as
    an entry of a batch, not for a checkpoint report."""
    (hm0, hm1, other1, relay1), (n0, n1) = tokens.pods, tokens.nodes
    settings = kube_settings(make_settings, tokens, agent_kube_relay_service_account=RELAY_USER)
    async with running(settings) as api:
        relay = tokens.token(relay1, account=RELAY)
        beats = [(tokens.token(hm0), heartbeat(n0, job=None)), (relay, heartbeat(n1, job=None))]
        batch = encode_batch([(credential, json.dumps(hb).encode()) for credential, hb in beats])

        async def carried(carrier: str) -> httpx.Response:
            return await api.client.post(
                "/api/v1/heartbeats/batch",
                content=batch,
                headers={**bearer(carrier), "Content-Type": "application/json"},
            )

        r = await carried(relay)
        assert r.status_code == 200, r.text
        # The node's own token is taken; the relay's, as an entry, speaks for no node.
        assert [result["status"] for result in r.json()["results"]] == [202, 401]
        assert api.supervisor.sensor.has_node(n0) and not api.supervisor.sensor.has_node(n1)
        # Alone, the relay's token is no host monitor's: not even of the node it runs on.
        r = await api.beat(heartbeat(n1, job=None), headers=bearer(relay))
        assert r.status_code == 401, r.text
        r = await api.client.post(
            "/api/v1/checkpoints", json={"reports": [checkpoint(n1, "c")]}, headers=bearer(relay)
        )
        assert r.status_code == 401, r.text
        assert not api.supervisor.sensor.has_node(n1)
        # A host monitor's token carries a batch too; another ServiceAccount's does not.
        assert (await carried(tokens.token(hm1))).status_code == 200
        assert (await carried(tokens.token(other1, account=OTHER))).status_code == 401
        # One review per token, the relay's included, however often it was used.
        assert tokens.reviews() == 4

    # Without the relays' ServiceAccount in the settings, their token carries nothing.
    async with running(kube_settings(make_settings, tokens)) as api:
        r = await api.client.post(
            "/api/v1/heartbeats/batch",
            content=batch,
            headers={**bearer(relay), "Content-Type": "application/json"},
        )
        assert r.status_code == 401, r.text


async def test_reviews_expire_and_an_api_server_outage_spares_known_tokens(
    make_settings: SettingsFactory, tokens: Tokens
) -> None:
    (hm0, hm1, *_), (n0, n1) = tokens.pods, tokens.nodes
    settings = kube_settings(make_settings, tokens, agent_kube_review_ttl_s=0.2)
    async with running(settings) as api:
        a, b = tokens.token(hm0), tokens.token(hm1)
        assert (await api.beat(heartbeat(n0, job=None), headers=bearer(a))).status_code == 202
        await asyncio.sleep(0.3)  # past the TTL: reviewed again
        assert (await api.beat(heartbeat(n0, job=None), headers=bearer(a))).status_code == 204
        assert tokens.reviews() == 2

        # The API server cannot answer: a token it accepted before stays accepted; a new
        # one gets 503 (send it again), not 401.
        await asyncio.sleep(0.3)
        outage = tokens.proxy.inject(Fault("POST", REVIEWS, status=503, times=100))
        assert (await api.beat(heartbeat(n0, job=None), headers=bearer(a))).status_code == 204
        r = await api.beat(heartbeat(n1, job=None), headers=bearer(b))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "cannot check the token now" in r.json()["message"]
        assert outage.hits >= 2  # both tokens were sent, and answered 503
        outage.times = outage.hits  # the API server answers again

        # A token whose pod is gone: the API server refuses it at a review, once its
        # cache of authenticated tokens lets go of it (10 s after it first took it).
        tokens.delete_pod(hm0)
        deadline = asyncio.get_running_loop().time() + scaled(20)
        while (await api.beat(heartbeat(n0, job=None), headers=bearer(a))).status_code != 401:
            assert asyncio.get_running_loop().time() < deadline, "the token of a gone pod taken"
            await asyncio.sleep(0.3)  # past the TTL: reviewed again
        assert (await api.beat(heartbeat(n1, job=None), headers=bearer(b))).status_code == 202


async def test_concurrent_first_requests_share_one_review_that_stalls_no_one(
    make_settings: SettingsFactory, tokens: Tokens
) -> None:
    (hm0, hm1, *_), (n0, n1) = tokens.pods, tokens.nodes
    async with running(kube_settings(make_settings, tokens)) as api:
        a, b = tokens.token(hm0), tokens.token(hm1)
        assert (await api.beat(heartbeat(n1, job=None), headers=bearer(b))).status_code == 202
        slow = tokens.proxy.inject(Fault("POST", REVIEWS, delay_s=0.5))  # a slow API server
        first = asyncio.gather(
            *(api.beat(heartbeat(n0, job=None), headers=bearer(a)) for _ in range(5))
        )
        await asyncio.sleep(0.05)
        # Meanwhile the node whose token is already verified is not held up.
        loop = asyncio.get_running_loop()
        started = loop.time()
        known = await api.beat(heartbeat(n1, job=None), headers=bearer(b))
        assert known.status_code == 204 and loop.time() - started < 0.2
        assert not first.done()
        assert {r.status_code for r in await first} <= {202, 204}
        assert slow.hits == 1
        assert tokens.reviews() == 2  # b's, then one for the five requests with a


def test_a_host_monitor_heartbeats_with_its_rotating_service_account_token(
    tokens: Tokens, tmp_path: Path
) -> None:
    """A real supervisor (agent_auth kubernetes, the API server through a kubeconfig) and
    a real host monitor reading its projected token from a file, which the kubelet
    rewrites: the new token is sent, reviewed, and the node stays in service."""
    hm0, n0 = next(iter(tokens.pods)), tokens.nodes[0]
    server = SupervisorProcess(
        tmp_path,
        env={
            "SUPERVISOR_AGENT_AUTH": "kubernetes",
            "SUPERVISOR_KUBE_CONFIG": str(tokens.kubeconfig),
            "SUPERVISOR_AGENT_KUBE_SERVICE_ACCOUNT": HOST_MONITOR_USER,
        },
    )
    cluster = Cluster(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(tokens.token(hm0))
    try:
        server.start()
        cluster.start_agent(
            server.url,
            node=n0,
            env={
                "HOST_MONITOR_AGENT_TOKEN": "",
                "HOST_MONITOR_SERVICE_ACCOUNT_TOKEN_FILE": str(token_file),
            },
        )
        wait_for(lambda: server.node(n0), 10, f"{n0} at the supervisor")
        assert tokens.reviews() == 1
        # The kubelet writes the next token before the first expires (atomically).
        rotated = tmp_path / "token.new"
        rotated.write_text(tokens.token(hm0))
        rotated.replace(token_file)
        wait_for(lambda: tokens.reviews() == 2, 5, "the new token reviewed")
        time.sleep(0.5)  # a few more heartbeats, from the cache
        assert tokens.reviews() == 2
        node = server.node(n0)
        assert node is not None and node["alive"]
        assert server.events(n0, "host_heartbeat_lost") == []
    finally:
        cluster.teardown()
        server.stop()
