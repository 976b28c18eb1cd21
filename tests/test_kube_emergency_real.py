"""The Kubernetes backend's emergency checkpoint through real host monitor processes, on
the real control plane (tests/control_plane.py): the JobSet's pods are placed by the
real scheduler, the backend (the chart's ServiceAccount) finds their nodes by its
watches, and reaches each node's host monitor by the address its heartbeats give, else
by the Node's InternalIP on host_monitor_port, over HTTP or HTTPS.

Each test keeps to nodes of its own (labelled `pool=<test>`, the backend's GPU node
selector) and a JobSet of its own name, so that they share one control plane.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.actuator.backend import ActionError
from supervisor.domain import ActionType
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.local.cluster_state import free_port
from tests.conftest import SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.kube.harness import Hooks, action
from tests.kube_real import (
    backend_on,
    events_about,
    merge_patch,
    pool_nodes,
    start_jobset,
    until,
    wait_running,
)
from tests.test_host_monitor import ACTUATOR_TOKEN, Cluster
from tests.test_tls import (
    MONITOR_NAME,
    VERIFY_FAILED,
    Pki,
    make_pki,
    start_tls_agent,
    start_tls_workers,
    wait_steps,
)

LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        for script in tmp_path.glob("*/worker.py"):  # TLS workers end on their own too
            (script.parent / "stop").touch()
        c.teardown()


def jobset_on_pool(plane: ControlPlane, name: str) -> list[str]:
    """The JobSet `name` running on two of three nodes of its pool: their names, sorted."""
    pool_nodes(plane, name, 3)
    start_jobset(plane, name, name)
    return sorted(p["spec"]["nodeName"] for p in wait_running(plane, name, 2, "0"))


def at_loopback(plane: ControlPlane, node: str) -> None:
    """The Node's InternalIP the loopback, as its kubelet would post it (kwok keeps
    addresses it finds)."""
    addresses = [{"type": "InternalIP", "address": LOOPBACK}, {"type": "Hostname", "address": node}]
    merge_patch(plane, f"/api/v1/nodes/{node}/status", {"status": {"addresses": addresses}})


async def seen(backend: KubeBackend, name: str, nodes: list[str], by_ip: str) -> None:
    """The backend's watches see the JobSet's pods on `nodes`, and `by_ip` at the loopback."""
    await until(
        backend,
        lambda: (
            backend.discovery.nodes_of(name) == nodes
            and o.internal_ip(backend.discovery.node(by_ip) or {}) == LOOPBACK
        ),
        "the pods and the node's address seen",
    )


async def test_emergency_checkpoint_goes_through_the_host_monitors(
    control_plane: ControlPlane,
    kube_supervisor: Identity,
    make_settings: SettingsFactory,
    cluster: Cluster,
) -> None:
    """Two real host monitor processes, one per node of the JobSet, with real workers:
    the node found by the heartbeat's address, the other by its InternalIP and
    host_monitor_port; the actuator token is presented; every rank acks. Excluding a
    node asks only the other. A rank that never acks makes the action fail and say
    which; Events on the JobSet say each outcome."""
    name = "ec"
    nodes = jobset_on_pool(control_plane, name)
    by_heartbeat = cluster.start_agent(None, node=nodes[0])
    port = free_port()
    by_ip = cluster.start_agent(None, node=nodes[1], port=port, host=LOOPBACK)
    cluster.start_workers(by_heartbeat, [0])
    cluster.start_workers(by_ip, [1], env={"NO_ACK_RANKS": ""})
    cluster.wait_running(by_heartbeat, [0])
    cluster.wait_running(by_ip, [1])
    at_loopback(control_plane, nodes[1])
    hooks = Hooks(addresses={nodes[0]: by_heartbeat.url})
    async with backend_on(
        control_plane,
        kube_supervisor,
        make_settings,
        name,
        hooks,
        host_monitor_port=port,
        host_monitor_actuator_token=ACTUATOR_TOKEN,
        emergency_checkpoint_timeout_s=1.5,
    ) as backend:
        await seen(backend, name, nodes, nodes[1])
        result = await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT, job=name))
        assert result["nodes"] == nodes and result["acked_ranks"] == ["0", "1"], result
        assert events_about(control_plane, name, "EmergencyCheckpoint")

        # Excluding the failed node: only the other one is asked.
        only = await backend.execute(
            action(ActionType.EMERGENCY_CHECKPOINT, job=name, key="k2", exclude_nodes=[nodes[0]])
        )
        assert only["nodes"] == [nodes[1]] and only["acked_ranks"] == ["1"], only

        cluster.start_workers(by_ip, [2], env={"NO_ACK_RANKS": "2"})
        cluster.wait_running(by_ip, [2])
        with pytest.raises(ActionError, match=rf"{nodes[1]}: no answer from ranks \[2\]"):
            await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT, job=name, key="k3"))
        assert events_about(control_plane, name, "EmergencyCheckpointFailed")


async def test_the_kube_backend_checkpoints_through_https_host_monitors(
    control_plane: ControlPlane,
    kube_supervisor: Identity,
    make_settings: SettingsFactory,
    cluster: Cluster,
    pki: Pki,
    tmp_path: Path,
) -> None:
    """One node found by its heartbeat's https:// address, the other by its InternalIP
    (https with tls_ca_file set): both verified against the CA and the name; a backend
    trusting another CA reaches neither."""
    name = "ectls"
    nodes = jobset_on_pool(control_plane, name)
    by_heartbeat = start_tls_agent(cluster, pki, node=nodes[0])
    port = free_port()
    by_ip = start_tls_agent(cluster, pki, node=nodes[1], port=port, host=LOOPBACK)
    out = tmp_path / "workers"
    out.mkdir()
    start_tls_workers(by_heartbeat, [0], out, job=name)
    start_tls_workers(by_ip, [1], out, job=name)
    wait_steps(by_heartbeat, [0])
    wait_steps(by_ip, [1])
    at_loopback(control_plane, nodes[1])
    hooks = Hooks(addresses={nodes[0]: by_heartbeat.url})
    common: dict[str, Any] = {
        "host_monitor_port": port,
        "host_monitor_actuator_token": ACTUATOR_TOKEN,
        "emergency_checkpoint_timeout_s": 3.0,
        "tls_host_monitor_server_name": MONITOR_NAME,
    }
    async with backend_on(
        control_plane,
        kube_supervisor,
        make_settings,
        name,
        hooks,
        tls_ca_file=str(pki.ca),
        **common,
    ) as backend:
        assert backend.settings.host_monitor_scheme == "https"
        await seen(backend, name, nodes, nodes[1])
        result = await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT, job=name))
        assert result["nodes"] == nodes and result["acked_ranks"] == ["0", "1"], result
    async with backend_on(
        control_plane,
        kube_supervisor,
        make_settings,
        name,
        hooks,
        tls_ca_file=str(pki.wrong_ca),
        **common,
    ) as backend:
        await seen(backend, name, nodes, nodes[1])
        with pytest.raises(ActionError, match=VERIFY_FAILED):
            await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT, job=name, key="k2"))
    (out / "stop").touch()  # the workers end now, not at the fixture's SIGTERM
