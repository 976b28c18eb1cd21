"""The local cluster's state: its nodes and their addresses, the job and where each rank
runs, the cordoned nodes, the actions already carried out. Kept in `cluster.json` in the
run directory, written atomically (supervisor/local/cluster.py acts on it)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field

from resiliency_protocol.launch import master_port, ranks_of
from supervisor.local.ports import free_port

STATE_FILE = "cluster.json"
MAX_REMEMBERED_KEYS = 1000


class NodeInfo(BaseModel):
    address: str
    # The `checkpoint_root` its host monitor runs with; None: the host monitor's default.
    checkpoint_root: str | None = None


class JobSpec(BaseModel):
    name: str
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    num_dp_replicas: int = Field(ge=1)
    num_nodes_per_dp: int = Field(ge=1)
    # placement[g] is the node of group rank g (torchrun's GROUP_RANK): it runs the
    # `nproc_per_node` ranks g * nproc_per_node ... (g + 1) * nproc_per_node - 1.
    placement: list[str]
    nproc_per_node: int = Field(1, ge=1)
    attempt: int = 0
    # The action key that started the current attempt: a resumed action does not stop
    # the workers it already started, and its start requests are deduplicated.
    started_by: str | None = None
    # Nodes to stop and hand back as spares at the next restart (set with the placement).
    pending_release: list[str] = Field(default_factory=list)
    # The torch.distributed rendezvous port of the current attempt (MASTER_PORT), on rank
    # 0's node: a fresh one per attempt, so that a new world never meets ranks of the old.
    master_port: int | None = None
    # The workload can heal in-process (the torch workload): restart in place and hot-swap
    # then keep the survivors' processes and start only the replaced ranks.
    in_process_restart: bool = False
    # The node the last hot-swap put in (a resumed hot-swap starts its rank anew).
    swapped_in: str | None = None
    # Modules a warm standby of the command imports ahead of time on every node of the job
    # and on the spares (host_monitor/standby.py): a rank started anew skips that import.
    standby_preload: list[str] = Field(default_factory=list)
    # A job its hosts launched (`host-monitor --launch`): the rendezvous they agreed on; its
    # workers get no run directory of ours. None: this machine's, a free port per attempt.
    hosts_master_addr: str | None = None
    hosts_master_port: int | None = None
    # The node rank 0 ran on when the hosts launched: `hosts_master_addr` is its; once a
    # spare took its place, rank 0's new node is the rendezvous host.
    hosts_master_node: str | None = None

    @property
    def world_size(self) -> int:
        return len(self.placement) * self.nproc_per_node

    def ranks_of(self, group_rank: int) -> range:
        """The global ranks the node of `group_rank` runs."""
        return ranks_of(group_rank, self.nproc_per_node)

    def next_master_port(self) -> int:
        """MASTER_PORT of the current attempt: the hosts' agreed one, else a free port here."""
        base = self.hosts_master_port
        return free_port() if base is None else master_port(base, self.attempt)


class ClusterState(BaseModel):
    run_dir: str
    actuator_token: str
    nodes: dict[str, NodeInfo] = Field(default_factory=dict)
    cordoned: list[str] = Field(default_factory=list)
    job: JobSpec | None = None
    done_keys: list[str] = Field(default_factory=list)

    @classmethod
    def load(cls, run_dir: Path) -> ClusterState:
        return cls.model_validate_json((run_dir / STATE_FILE).read_text())

    def save(self) -> None:
        path = Path(self.run_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            f.write(self.model_dump_json(indent=2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def spares(self) -> list[str]:
        used = set(self.job.placement) if self.job else set()
        return sorted(n for n in self.nodes if n not in used and n not in self.cordoned)

    def remember(self, key: str) -> None:
        self.done_keys.append(key)
        del self.done_keys[:-MAX_REMEMBERED_KEYS]
