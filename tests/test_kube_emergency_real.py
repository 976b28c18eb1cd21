"""The Kubernetes backend's emergency checkpoint through real host monitor processes, on
the real control plane (tests/control_plane.py): the JobSet's pods are placed by the
real scheduler, the backend (the chart's ServiceAccount) finds their nodes by its
watches, and reaches each node's host monitor by the address its heartbeats give, else
by the Node's InternalIP on host_monitor_port, over HTTP or HTTPS. Each test keeps to a
pool of nodes and a JobSet of its own (tests/kube_real.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor.actuator.backend import ActionError
from supervisor.domain import ActionType
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.local.ports import free_port
from tests.conftest import SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.kube.harness import Hooks, action
from tests.kube_real import backend_on, events_about, merge_patch, running_jobset, until
from tests.test_host_monitor import ACTUATOR_TOKEN, Agent, Cluster
from tests.test_tls import (
    MONITOR_NAME,
    VERIFY_FAILED,
    Pki,
    start_tls_agent,
    start_tls_workers,
    wait_steps,
)
from tests.test_tls import cluster as cluster  # the fixture: its TLS workers stopped too
from tests.test_tls import pki as pki  # the fixture

LOOPBACK = "127.0.0.1"


@dataclass
class Monitors:
    """The JobSet `name` on two of the three nodes of its pool (`nodes`, sorted), a host
    monitor on each: the first reached by its heartbeat's address, the second by the
    Node's InternalIP (the loopback, as its kubelet would post it) on `port`."""

    name: str
    nodes: list[str]
    by_heartbeat: Agent
    by_ip: Agent
    port: int

    @classmethod
    def start(cls, plane: ControlPlane, name: str, start_agent: Callable[..., Agent]) -> Monitors:
        nodes = sorted(p["spec"]["nodeName"] for p in running_jobset(plane, name, 3))
        by_heartbeat = start_agent(node=nodes[0])
        port = free_port()
        by_ip = start_agent(node=nodes[1], port=port, host=LOOPBACK)
        # kwok keeps the addresses it finds.
        addresses = [
            {"type": "InternalIP", "address": LOOPBACK},
            {"type": "Hostname", "address": nodes[1]},
        ]
        merge_patch(plane, f"/api/v1/nodes/{nodes[1]}/status", {"status": {"addresses": addresses}})
        return cls(name, nodes, by_heartbeat, by_ip, port)

    @asynccontextmanager
    async def backend(
        self, plane: ControlPlane, who: Identity, make_settings: SettingsFactory, **overrides: Any
    ) -> AsyncIterator[KubeBackend]:
        """The backend with the actuator token, once its watches see the JobSet's pods
        and the second node's address."""
        hooks = Hooks(addresses={self.nodes[0]: self.by_heartbeat.url})
        async with backend_on(
            plane,
            who,
            make_settings,
            self.name,
            hooks,
            host_monitor_port=self.port,
            host_monitor_actuator_token=ACTUATOR_TOKEN,
            **overrides,
        ) as backend:
            await until(
                backend,
                lambda: (
                    backend.discovery.nodes_of(self.name) == self.nodes
                    and o.internal_ip(backend.discovery.node(self.nodes[1]) or {}) == LOOPBACK
                ),
                "the pods and the node's address seen",
            )
            yield backend

    async def every_rank_acks(self, backend: KubeBackend) -> None:
        result = await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT, job=self.name))
        assert result["nodes"] == self.nodes and result["acked_ranks"] == ["0", "1"], result


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
    m = Monitors.start(control_plane, "ec", lambda **at: cluster.start_agent(None, **at))
    cluster.start_workers(m.by_heartbeat, [0])
    cluster.start_workers(m.by_ip, [1], env={"NO_ACK_RANKS": ""})
    cluster.wait_running(m.by_heartbeat, [0])
    cluster.wait_running(m.by_ip, [1])
    async with m.backend(
        control_plane, kube_supervisor, make_settings, emergency_checkpoint_timeout_s=1.5
    ) as backend:
        await m.every_rank_acks(backend)
        assert events_about(control_plane, m.name, "EmergencyCheckpoint")

        # Excluding the failed node: only the other one is asked.
        only = await backend.execute(
            action(
                ActionType.EMERGENCY_CHECKPOINT, job=m.name, key="k2", exclude_nodes=[m.nodes[0]]
            )
        )
        assert only["nodes"] == [m.nodes[1]] and only["acked_ranks"] == ["1"], only

        cluster.start_workers(m.by_ip, [2], env={"NO_ACK_RANKS": "2"})
        cluster.wait_running(m.by_ip, [2])
        with pytest.raises(ActionError, match=rf"{m.nodes[1]}: no answer from ranks \[2\]"):
            await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT, job=m.name, key="k3"))
        assert events_about(control_plane, m.name, "EmergencyCheckpointFailed")


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
    m = Monitors.start(control_plane, "ectls", lambda **at: start_tls_agent(cluster, pki, **at))
    out = tmp_path / "workers"
    out.mkdir()
    start_tls_workers(m.by_heartbeat, [0], out, job=m.name)
    start_tls_workers(m.by_ip, [1], out, job=m.name)
    wait_steps(m.by_heartbeat, [0])
    wait_steps(m.by_ip, [1])
    tls: dict[str, Any] = {
        "emergency_checkpoint_timeout_s": 3.0,
        "tls_host_monitor_server_name": MONITOR_NAME,
    }
    async with m.backend(
        control_plane, kube_supervisor, make_settings, tls_ca_file=str(pki.ca), **tls
    ) as backend:
        assert backend.settings.host_monitor_scheme == "https"
        await m.every_rank_acks(backend)
    async with m.backend(
        control_plane, kube_supervisor, make_settings, tls_ca_file=str(pki.wrong_ca), **tls
    ) as backend:
        with pytest.raises(ActionError, match=VERIFY_FAILED):
            await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT, job=m.name, key="k2"))
    (out / "stop").touch()  # the workers end now, not at the fixture's SIGTERM
